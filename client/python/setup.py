"""Build of the paramsync Python client.

The gRPC stubs (paramsync/v1/paramsync_pb2.py and paramsync_pb2_grpc.py) are
generated from the repository's proto/ directory at build time with `protoc`
and `grpc_python_plugin` (Debian: protobuf-compiler, protobuf-compiler-grpc);
they are never committed. The .proto files are found at ../../proto next to
this file, or in $PARAMSYNC_PROTO_DIR.

    pip install --no-build-isolation client/python     # into a venv made with
                                                       # --system-site-packages
    python3 setup.py gen_proto                         # stubs in place, for a checkout
"""
import os
import shutil
import subprocess

from setuptools import Command, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTOS = ["paramsync/v1/paramsync.proto"]


def proto_dir():
    d = os.environ.get("PARAMSYNC_PROTO_DIR") or os.path.join(HERE, "..", "..", "proto")
    d = os.path.abspath(d)
    if not os.path.isfile(os.path.join(d, PROTOS[0])):
        raise SystemExit(
            "paramsync: cannot find %s under %s; set PARAMSYNC_PROTO_DIR to the repository's proto/"
            % (PROTOS[0], d))
    return d


def generate(out_dir):
    """Runs protoc + grpc_python_plugin; writes paramsync/v1/*.py under out_dir."""
    protoc = shutil.which("protoc")
    plugin = shutil.which("grpc_python_plugin")
    if not protoc or not plugin:
        raise SystemExit("paramsync: protoc and grpc_python_plugin are needed to build "
                         "(Debian: apt-get install protobuf-compiler protobuf-compiler-grpc)")
    src = proto_dir()
    os.makedirs(out_dir, exist_ok=True)
    cmd = [protoc, "--proto_path=" + src, "--python_out=" + out_dir, "--grpc_python_out=" + out_dir,
           "--plugin=protoc-gen-grpc_python=" + plugin] + PROTOS
    subprocess.check_call(cmd)
    # protoc writes modules, not packages: paramsync.v1 needs an __init__.py.
    init = os.path.join(out_dir, "paramsync", "v1", "__init__.py")
    with open(init, "w") as f:
        f.write('"""Generated from proto/paramsync/v1/paramsync.proto at build time."""\n')


class BuildPy(build_py):
    def run(self):
        super().run()
        generate(self.build_lib)


class GenProto(Command):
    description = "generate the gRPC stubs into the source tree (for running from a checkout)"
    user_options = []

    def initialize_options(self):
        pass

    def finalize_options(self):
        pass

    def run(self):
        generate(HERE)


setup(
    name="paramsync",
    version="0.1.0",
    description="torch.distributed's collectives as gRPC calls to paramsyncd",
    packages=["paramsync"],
    python_requires=">=3.9",
    # Debian: python3-grpcio, python3-protobuf, python3-numpy (not from PyPI;
    # listed so that pip checks they are there).
    install_requires=["grpcio", "protobuf", "numpy"],
    cmdclass={"build_py": BuildPy, "gen_proto": GenProto},
)
