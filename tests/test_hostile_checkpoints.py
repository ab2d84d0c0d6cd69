"""Checkpoint bombs: safetensors files crafted by hand (header JSON + body bytes) beside a tiny
model's config and tokenizer, and broken tokenizer files. Each is refused when it is read, in one
line naming the file (and the tensor) with a non-zero exit and no traceback: by `plan`, by a stage,
by the frontend; and `serve` ends at once with the failing stage's reason, never waiting out its
300 s start-up timeout for a stage that already failed. Nothing in a checkpoint is ever executed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from mesh_helpers import free_serve_port
from tiny_models import write_tiny_model

from inferencemesh.programs.cli import main

REPO = Path(__file__).resolve().parents[1]
SHARD = "model-00001-of-00001.safetensors"
INDEX = "model.safetensors.index.json"
CLI = [sys.executable, "-m", "inferencemesh"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama in one safetensors file (+ its index), config and tokenizer: each test
    copies it and breaks the copy."""
    return write_tiny_model(tmp_path_factory.mktemp("good"), "llama", num_layers=2, shards=1)


def read_shard(model: Path) -> tuple[dict, bytes]:
    raw = (model / SHARD).read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def write_shard(model: Path, header: dict | bytes, body: bytes) -> None:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    (model / SHARD).write_bytes(struct.pack("<Q", len(text)) + text + body)


def drop_tensor(model: Path, name: str) -> None:
    """Remove one tensor from the file (its bytes too: the rest stay packed) and from the index:
    a well-formed checkpoint that lacks a tensor its config needs."""
    header, body = read_shard(model)
    begin, end = header.pop(name)["data_offsets"]
    for meta in header.values():
        if "data_offsets" in meta and meta["data_offsets"][0] >= end:
            meta["data_offsets"] = [o - (end - begin) for o in meta["data_offsets"]]
    write_shard(model, header, body[:begin] + body[end:])
    index = json.loads((model / INDEX).read_text())
    del index["weight_map"][name]
    (model / INDEX).write_text(json.dumps(index))


def change(name: str, **meta: object) -> Callable[[Path], None]:
    """Rewrite one tensor's header entry (the body stays as it is)."""
    def apply(model: Path) -> None:
        header, body = read_shard(model)
        header[name].update(meta)
        write_shard(model, header, body)
    return apply


def truncate_body(model: Path) -> None:
    raw = (model / SHARD).read_bytes()
    (model / SHARD).write_bytes(raw[:len(raw) // 2])


def truncate_header(model: Path) -> None:
    raw = (model / SHARD).read_bytes()
    (model / SHARD).write_bytes(raw[:8 + 100])  # the length says ~2 KB of JSON; 100 bytes are there


def garbage_header(model: Path) -> None:
    header, body = read_shard(model)
    write_shard(model, b"\xff\xfe not json " + b"x" * 40, body)


def nested_header(model: Path) -> None:
    _, body = read_shard(model)
    write_shard(model, b"[" * 200_000, body)  # json's parser recurses once per level


def overlapping(model: Path) -> None:
    header, body = read_shard(model)
    header["model.layers.1.mlp.up_proj.weight"]["data_offsets"] = \
        header["model.layers.1.mlp.gate_proj.weight"]["data_offsets"]  # same shape: the same bytes twice
    write_shard(model, header, body)


def index_outside(model: Path) -> None:
    index = json.loads((model / INDEX).read_text())
    index["weight_map"]["model.norm.weight"] = "../../../../etc/shadow.safetensors"
    (model / INDEX).write_text(json.dumps(index))


def quantized(model: Path) -> None:
    """What a GPTQ checkpoint's config says (its tensors would be qweight, qzeros, scales)."""
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (model / "config.json").write_text(json.dumps(config))


def tokenizer_not_json(model: Path) -> None:
    (model / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')


HUGE = 2**20
BOMBS: dict[str, tuple[Callable[[Path], None], str, list[str]]] = {
    # name: (how the copy is broken, the file the line names, what else it says)
    "enormous shape and offsets": (change("model.layers.0.mlp.down_proj.weight", shape=[HUGE, HUGE],
                                          data_offsets=[0, 4 * HUGE * HUGE]),
                                   SHARD, ["model.layers.0.mlp.down_proj.weight", "past the file"]),
    "truncated body": (truncate_body, SHARD, ["past the file", "truncated"]),
    "truncated header": (truncate_header, SHARD, ["header length", "truncated"]),
    "header not JSON": (garbage_header, SHARD, ["not JSON"]),
    "deeply nested header": (nested_header, SHARD, ["not JSON"]),
    "offsets disagree with the shape": (change("model.norm.weight", shape=[8]), SHARD,
                                        ["model.norm.weight", "F32 x [8] is 32 bytes"]),
    "overlapping tensors": (overlapping, SHARD, ["overlaps"]),
    "8-bit float dtype": (change("model.layers.1.mlp.down_proj.weight", dtype="F8_E5M2"), SHARD,
                          ["F8_E5M2", "cannot load yet"]),
    "unknown dtype": (change("model.norm.weight", dtype="Q3_K"), SHARD, ["Q3_K", "dtype"]),
    "quantized config": (quantized, "quantization_config", ["gptq", "no quantized tensors"]),
    "index names a file elsewhere": (index_outside, INDEX, ["shadow", "beside the index"]),
    "tokenizer.json not JSON": (tokenizer_not_json, "tokenizer.json", ["not JSON"]),
}


def broken(tiny: Path, tmp_path: Path, breaking: Callable[[Path], None]) -> Path:
    model = Path(shutil.copytree(tiny, tmp_path / "model"))
    breaking(model)
    return model


def run(*argv: str, timeout: float = 240, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def one_error_line(done: subprocess.CompletedProcess, *words: str) -> str:
    """The one line a refusal prints (no traceback, non-zero exit), containing each of `words`."""
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "Traceback" not in output, output
    lines = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(lines) == 1, output
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("bomb", sorted(BOMBS))
def test_plan_refuses_a_bad_checkpoint_in_one_line(bomb: str, tiny: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The `inferencemesh` command's own entry point, in this process (one interpreter's start-up
    for all of them; the next test runs the command as a process)."""
    breaking, file, words = BOMBS[bomb]
    model = broken(tiny, tmp_path, breaking)
    with pytest.raises(SystemExit) as leaving:
        main(["plan", "--model", str(model), "--stages", "2"])
    captured = capsys.readouterr()
    line = one_error_line(subprocess.CompletedProcess([], leaving.value.code, captured.out, captured.err),
                          file, *words)
    assert len(line) < 600, line  # a forged header's names and numbers are not echoed whole


def test_plan_of_an_enormous_header_is_one_line_and_quick(tiny: Path, tmp_path: Path) -> None:
    """Before: planned as 4096 GiB for layer 0 (a bigger forgery: 317827579904 GiB), exit 0."""
    model = broken(tiny, tmp_path, BOMBS["enormous shape and offsets"][0])
    one_error_line(run("plan", "--model", str(model), "--stages", "2"), SHARD, "past the file")


def test_a_stage_that_cannot_load_exits_at_once_with_its_reason(tiny: Path, tmp_path: Path) -> None:
    """A header that plan accepts (dtype x shape = its bytes) but whose shape the config
    contradicts: the stage process exits (1) with one line naming the tensor, and leaves that line
    in its termination message (what a pod's status and the operator quote), instead of staying up
    unready with a failed state."""
    model = broken(tiny, tmp_path, change("model.layers.1.self_attn.q_proj.weight", shape=[32, 128]))
    note = tmp_path / "termination-log"
    started = time.monotonic()
    done = run("stage", "--model", str(model), "--layers", "1:2", "--stage-index", "1", "--num-stages", "2",
               "--port", "0", "--metrics-port", "0", env={"INFERENCEMESH_TERMINATION_LOG": str(note)}, timeout=120)
    elapsed = time.monotonic() - started
    line = one_error_line(done, "model.layers.1.self_attn.q_proj.weight", "[32, 128]", "[64, 64]")
    assert done.returncode == 1 and elapsed < 60, (done.returncode, elapsed)
    assert note.read_text().strip() == line.strip()


def custom_tokenizer(model: Path) -> None:
    settings = json.loads((model / "tokenizer_config.json").read_text())
    settings.update(auto_map={"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]},
                    tokenizer_class="EvilTokenizer")
    (model / "tokenizer_config.json").write_text(json.dumps(settings))
    (model / "tokenization_evil.py").write_text("raise SystemExit('custom code ran')\n")


def unusable_tokenizer(model: Path) -> None:
    (model / "tokenizer.json").write_text(json.dumps({"model": 5, "version": "1.0"}))


@pytest.mark.parametrize(("breaking", "words"), [
    pytest.param(custom_tokenizer, ["auto_map", "never runs"], id="auto_map"),
    pytest.param(unusable_tokenizer, ["tokenizer cannot be loaded"], id="unusable tokenizer.json"),
])
def test_the_frontend_refuses_a_bad_tokenizer_in_one_line(breaking: Callable[[Path], None], words: list[str],
                                                         tiny: Path, tmp_path: Path) -> None:
    model = broken(tiny, tmp_path, breaking)
    done = run("frontend", "--model", str(model), "--stage-addresses", "127.0.0.1:9", "--port", "0", timeout=120)
    one_error_line(done, str(model), *words)
    assert "custom code ran" not in done.stdout + done.stderr


SERVE_CASES = {
    # plan refuses it: serve ends before it starts anything
    "bomb": (change("model.layers.0.mlp.down_proj.weight", shape=[HUGE, HUGE], data_offsets=[0, 4 * HUGE * HUGE]),
             ["model.layers.0.mlp.down_proj.weight", "past the file"]),
    # well-formed, but stage 1 (a process of its own) lacks a tensor: that process exits, serve with it
    "stage process": (lambda m: drop_tensor(m, "model.layers.1.mlp.down_proj.weight"),
                      ["stage-1 exited (1) while loading", "model.layers.1.mlp.down_proj.weight"]),
    # stage 0, embedded in the frontend, lacks one: the frontend exits, serve with it
    "embedded stage": (lambda m: drop_tensor(m, "model.layers.0.mlp.down_proj.weight"),
                       ["frontend exited (1) before it was ready", "model.layers.0.mlp.down_proj.weight"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(SERVE_CASES))
def test_serve_fails_at_once_with_the_stages_reason(case: str, tiny: Path, tmp_path: Path) -> None:
    """Before: a stage that failed to load stayed up unready and serve waited out its 300 s start-up
    timeout; an embedded stage 0 that failed left the frontend unready and serve running for good.
    Now serve ends within seconds of the failure (the rest is the processes' start-up, slow on a busy
    2-core machine), with the reason."""
    breaking, words = SERVE_CASES[case]
    model = broken(tiny, tmp_path, breaking)
    started = time.monotonic()
    proc = subprocess.Popen([*CLI, "serve", "--model", str(model), "--port", str(free_serve_port()),
                             "--max-sessions", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                                 "PYTHONUNBUFFERED": "1"}, cwd=REPO, start_new_session=True)
    lines: list[tuple[float, str]] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic(), line))
            assert time.monotonic() - started < 240, "".join(text for _, text in lines)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    ended = time.monotonic()
    output = "".join(text for _, text in lines)
    assert proc.returncode != 0, output
    assert "Traceback" not in output, output
    assert any(all(word in line for word in words) for line in output.splitlines()), output
    failed_at = next((at for at, text in lines if "cannot load" in text or "error:" in text), None)
    assert failed_at is not None, output
    assert ended - failed_at < 20, f"serve took {ended - failed_at:.0f}s after the failure to end:\n{output}"
    left = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert not left, f"left running: {left}\n{output}"
