"""The wire protocol: generated code in sync with stage.proto, activation codec strict."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inferencemesh.protocol import codec
from inferencemesh.protocol import stage_pb2 as pb

REPO = Path(__file__).resolve().parents[1]


def test_generated_code_matches_proto(tmp_path: Path) -> None:
    subprocess.run(["bash", str(REPO / "tools/gen_proto.sh"), str(tmp_path)], check=True, cwd=REPO)
    for name in ("stage_pb2.py", "stage_pb2.pyi", "stage_pb2_grpc.py"):
        fresh = (tmp_path / "inferencemesh/protocol" / name).read_text()
        committed = (REPO / "src/inferencemesh/protocol" / name).read_text()
        assert fresh == committed, f"{name} is stale: run tools/gen_proto.sh"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_codec_round_trip(dtype: torch.dtype) -> None:
    hidden = torch.randn(3, 8)
    payload = codec.encode(hidden, dtype)
    assert len(payload) == 3 * 8 * torch.finfo(dtype).bits // 8
    back = codec.decode(payload, codec.WIRE_CODES[dtype], (3, 8), 3)
    assert torch.equal(back, hidden.to(dtype))


def test_codec_rejects_mismatches() -> None:
    payload = codec.encode(torch.randn(2, 4), torch.float32)
    with pytest.raises(codec.PayloadError, match="bytes"):
        codec.decode(payload[:-1], pb.F32, (2, 4), 2)
    with pytest.raises(codec.PayloadError, match="not one of"):
        codec.decode(payload, 42, (2, 4), 2)
    with pytest.raises(codec.PayloadError, match="token_count"):
        codec.decode(payload, pb.F32, (2, 4), 3)


def test_protocol_modules_import_without_grpc_tools() -> None:
    code = "import inferencemesh.protocol.stage_pb2_grpc as m; print(m.StageStub.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "StageStub"
