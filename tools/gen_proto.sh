#!/usr/bin/env bash
# Regenerate the Python modules of the wire protocol from inferencemesh/protocol/stage.proto.
# The generated files are committed; tests/test_protocol.py fails if they drift from the .proto.
# Usage: tools/gen_proto.sh [OUT_ROOT]   (default: src/, i.e. in place)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-src}
# -I src keeps the proto registered as inferencemesh/protocol/stage.proto (its import path).
python -m grpc_tools.protoc -I src --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  src/inferencemesh/protocol/stage.proto
