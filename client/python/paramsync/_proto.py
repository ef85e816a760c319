"""The generated gRPC stubs (paramsync.v1), with a useful error when they were never built."""
try:
    from paramsync.v1 import paramsync_pb2 as pb  # noqa: F401
    from paramsync.v1 import paramsync_pb2_grpc as pb_grpc  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on how the package was installed
    raise ImportError(
        "paramsync: the gRPC stubs (paramsync.v1) are missing. They are generated from "
        "proto/ when the package is built: `pip install --no-build-isolation client/python`, "
        "or `python3 client/python/setup.py gen_proto` to use the checkout in place "
        "(needs protoc and grpc_python_plugin: Debian protobuf-compiler-grpc). (%s)" % e) from e
