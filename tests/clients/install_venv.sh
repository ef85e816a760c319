#!/bin/sh
# Makes the virtual environment the Python client tests use, the way a user
# would: a venv of Debian's /usr/bin/python3 with --system-site-packages (for
# python3-grpcio, python3-protobuf, python3-numpy, python3-torch) and
# `pip install --no-build-isolation` of client/python, which generates the gRPC
# stubs from proto/ with protoc + grpc_python_plugin. No network: --no-index.
# A copy of client/python is built, so that the checkout stays clean.
#   install_venv.sh CLIENT_PYTHON_DIR PROTO_DIR VENV_DIR
set -eu
src=$1
proto=$2
venv=$3
rm -rf "$venv" "$venv.src"
/usr/bin/python3 -m venv --system-site-packages "$venv"
cp -r "$src" "$venv.src"
rm -rf "$venv.src/build" "$venv.src"/*.egg-info "$venv.src/paramsync/v1"
PARAMSYNC_PROTO_DIR=$proto "$venv/bin/pip" install --quiet --no-index --no-build-isolation \
    --disable-pip-version-check "$venv.src"
rm -rf "$venv.src"
cd /
"$venv/bin/python" -c 'import paramsync.distributed as d, paramsync.v1.paramsync_pb2_grpc as g; print("installed", d.__file__)'
