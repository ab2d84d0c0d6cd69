"""--dtype auto: the checkpoint's dtype, except a 16-bit checkpoint on a CPU without native units
for it, which computes in float32; the stage, `plan`, `serve` and the operator decide alike."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import write_tiny_model

from inferencemesh.compute_dtype import choose_dtype, cpu_flags

AVX2 = frozenset({"sse4_2", "avx2", "fma"})
SAPPHIRE_RAPIDS = AVX2 | {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16"}


@pytest.mark.parametrize(("requested", "checkpoint", "on_cpu", "flags", "want"), [
    ("auto", "bfloat16", True, AVX2, "float32"),
    ("auto", "bfloat16", True, SAPPHIRE_RAPIDS, "bfloat16"),
    ("auto", "float16", True, AVX2 | {"avx512_bf16"}, "float32"),  # bf16 units do not compute fp16
    ("auto", "float16", True, SAPPHIRE_RAPIDS, "float16"),
    ("auto", "float32", True, AVX2, "float32"),
    ("auto", "bfloat16", False, AVX2, "bfloat16"),  # a GPU: the checkpoint's
    (None, "bfloat16", True, frozenset(), "float32"),  # the operator, which cannot see the node's CPU
    ("bfloat16", "bfloat16", True, AVX2, "bfloat16"),  # asked for: slow, but as asked
    ("float16", "bfloat16", False, AVX2, "float16"),
])
def test_choice(requested: str | None, checkpoint: str, on_cpu: bool, flags: frozenset[str], want: str) -> None:
    choice = choose_dtype(requested, checkpoint, on_cpu=on_cpu, flags=flags)
    assert choice.name == want and choice.reason


def test_the_reason_names_what_the_cpu_lacks_and_how_to_force_it() -> None:
    reason = choose_dtype("auto", "bfloat16", on_cpu=True, flags=AVX2).reason
    assert "avx512_bf16 or amx_bf16" in reason and "--dtype bfloat16" in reason


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: x\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(info) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()
    if Path("/proc/cpuinfo").exists():
        assert cpu_flags()  # this machine's


def test_a_stage_plan_and_serve_agree_on_a_bf16_checkpoint(tmp_path: Path) -> None:
    """The stage loads a bf16 checkpoint in the dtype `plan` sized it for, on this machine's CPU."""
    from inferencemesh.modeling.runtime import StageRuntime

    model = write_tiny_model(tmp_path / "m", "llama", num_layers=2, shards=1, dtype=torch.bfloat16)
    want = choose_dtype("auto", "bfloat16", on_cpu=True).name
    runtime = StageRuntime(model, 0, 2, dtype="auto", device="cpu", max_context=64)
    assert str(runtime.dtype).removeprefix("torch.") == want

    def planned_weights(*dtype: str) -> int:
        out = subprocess.run([sys.executable, "-m", "inferencemesh", "plan", "--model", str(model), "--stages", "1",
                              "--device", "cpu", "--json", *dtype], capture_output=True, text=True, check=True)
        return json.loads(out.stdout)["stages"][0]["weight_bytes"]

    assert planned_weights() == planned_weights("--dtype", want)  # plan's auto is the stage's
    assert planned_weights("--dtype", "float32") == 2 * planned_weights("--dtype", "bfloat16")
