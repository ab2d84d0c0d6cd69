"""Loading one stage's slice of a checkpoint: locally, from a (cached, offline) hub repo, and refusals.

The hub path runs huggingface_hub's real snapshot_download against a Hugging Face cache laid out
as a download leaves it (blobs, snapshots/<commit>, refs/main, trees/<commit>.json listing every
file of the repo), with HF_HUB_OFFLINE=1. The snapshot holds only the shards the stage needs, and
the cached listing names all of them: asking for any other shard would fail.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import huggingface_hub
import huggingface_hub.constants
import pytest
import torch
from huggingface_hub.errors import LocalEntryNotFoundError
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_models import write_tiny_model

from inferencemesh.checkpoint.errors import CheckpointError
from inferencemesh.checkpoint.headers import SAFETENSORS_INDEX
from inferencemesh.checkpoint.hub import CONFIG_FILES
from inferencemesh.compute_dtype import choose_dtype
from inferencemesh.modeling.loader import load_stage
from inferencemesh.modeling.runtime import StageRuntime

REPO = "inferencemesh-tests/tiny-llama"


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    # 6 layers over 4 shards: stages in the middle need some shards and not others.
    return write_tiny_model(tmp_path_factory.mktemp("m") / "llama", "llama", num_layers=6, shards=4)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("m") / "qwen3", "qwen3", num_layers=4, shards=3)


def weight_map(model_dir: Path) -> dict[str, str]:
    return json.loads((model_dir / SAFETENSORS_INDEX).read_text())["weight_map"]


def checkpoint_tensor(model_dir: Path, name: str) -> torch.Tensor:
    with safe_open(str(model_dir / weight_map(model_dir)[name]), framework="pt") as f:
        return f.get_tensor(name)


def needed_shards(model_dir: Path, start: int, end: int, num_layers: int, *, tied: bool = False) -> set[str]:
    """Computed here from the index, independently of the loader."""
    shards = set()
    for name, shard in weight_map(model_dir).items():
        if name.startswith("model.layers."):
            keep = start <= int(name.split(".")[2]) < end
        elif name.startswith("model.embed_tokens."):
            keep = start == 0 or (tied and end == num_layers)
        else:  # model.norm, lm_head
            keep = end == num_layers
        if keep:
            shards.add(shard)
    return shards


# --------------------------------------------------------------------------- local directories


def test_stage_modules_hold_exactly_their_tensors(llama):
    stage = load_stage(llama, 2, 4, dtype="float32")
    assert stage.embed is None and stage.norm is None and stage.lm_head is None
    assert [layer.self_attn.layer_idx for layer in stage.layers] == [2, 3]  # global indices
    assert type(stage.layers[0]).__name__ == "LlamaDecoderLayer"
    for i, layer in zip((2, 3), stage.layers, strict=True):
        for key, value in layer.state_dict().items():
            assert value.device.type == "cpu"  # nothing left on the meta device
            torch.testing.assert_close(value, checkpoint_tensor(llama, f"model.layers.{i}.{key}"), rtol=0, atol=0)
    assert set(stage.facts.tensors) >= {f"model.layers.{i}.mlp.up_proj.weight" for i in (2, 3)}

    first = load_stage(llama, 0, 1, dtype="float32")
    torch.testing.assert_close(first.embed.weight, checkpoint_tensor(llama, "model.embed_tokens.weight"))
    assert first.norm is None and first.lm_head is None

    last = load_stage(llama, 5, 6, dtype="float32")
    assert last.embed is None
    torch.testing.assert_close(last.lm_head.weight, checkpoint_tensor(llama, "lm_head.weight"))
    torch.testing.assert_close(last.norm.weight, checkpoint_tensor(llama, "model.norm.weight"))


def test_shards_without_the_stages_tensors_need_not_exist(llama, tmp_path):
    """A stage reads only its shards: delete the rest and it still loads and runs."""
    needed = needed_shards(llama, 2, 4, 6)
    all_shards = set(weight_map(llama).values())
    assert needed and needed < all_shards  # the test means something only if some shards are unneeded
    partial = tmp_path / "partial"
    partial.mkdir()
    for f in llama.iterdir():
        if f.name not in all_shards or f.name in needed:
            (partial / f.name).symlink_to(f)
    runtime = StageRuntime(partial, 2, 4, dtype="float32")
    hidden = torch.randn(5, runtime.hidden_size)
    whole = StageRuntime(llama, 2, 4, dtype="float32")
    expected = whole.forward(whole.new_session(), 0, hidden=hidden)
    torch.testing.assert_close(runtime.forward(runtime.new_session(), 0, hidden=hidden), expected)
    assert {t.shard for t in runtime.facts.tensors.values()} == needed


def test_tied_head_is_the_embedding_matrix(qwen3):
    assert "lm_head.weight" not in weight_map(qwen3)  # tied heads are not stored
    embedding = checkpoint_tensor(qwen3, "model.embed_tokens.weight")
    last = load_stage(qwen3, 2, 4, dtype="float32")
    assert last.embed is None
    torch.testing.assert_close(last.lm_head.weight, embedding)
    whole = load_stage(qwen3, 0, 4, dtype="float32")
    assert whole.lm_head.weight is whole.embed.weight  # one matrix, not two copies


def test_dtype_and_device_resolution(tmp_path):
    model = write_tiny_model(tmp_path / "bf16", "qwen2", num_layers=2, shards=2, dtype=torch.bfloat16)
    auto = load_stage(model, 0, 1)  # the checkpoint's, unless this CPU would emulate it (compute_dtype)
    want = getattr(torch, choose_dtype("auto", "bfloat16", on_cpu=not torch.cuda.is_available()).name)
    assert auto.dtype == want and auto.embed.weight.dtype == want
    assert auto.device == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    asked = load_stage(model, 0, 1, dtype="bfloat16", device="cpu")
    assert asked.dtype == torch.bfloat16 and asked.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    wide = load_stage(model, 1, 2, dtype="float32", device="cpu")
    assert wide.dtype == torch.float32 and wide.layers[0].self_attn.q_proj.bias.dtype == torch.float32
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        load_stage(model, 0, 1, dtype="int8")


def test_bad_layer_ranges_are_refused(llama):
    for start, end in ((0, 7), (3, 3), (-1, 2), (4, 2)):
        with pytest.raises(CheckpointError, match="layer range"):
            load_stage(llama, start, end)


def test_pickle_only_checkpoint_is_refused(tmp_path):
    model = tmp_path / "pickled"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    (model / "pytorch_model.bin").write_bytes(b"not loaded, never unpickled")
    with pytest.raises(CheckpointError, match=r"no safetensors weights \(found only pickle-based weights: pytorch"):
        StageRuntime(model, 0, 2)


def test_unsupported_family_is_refused(tmp_path):
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    save_file({"wte.weight": torch.zeros(4, 4)}, str(model / "model.safetensors"))
    with pytest.raises(CheckpointError, match="'gpt2' cannot be served: not the standard layout: its decoder"):
        StageRuntime(model, 0, 2)


# --------------------------------------------------------------------------- hub (offline cache)


def populate_hub_cache(cache: Path, repo_id: str, files: dict[str, Path], *, keep: set[str]) -> str:
    """Lay out `files` as huggingface_hub caches a repo: blobs, snapshot symlinks, refs/main, trees listing.

    Every file is in the tree listing (what the Hub would list); only those in `keep` are in the
    snapshot. Returns the commit hash.
    """
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (storage / "blobs").mkdir()
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)
    listing = {}
    for name, path in files.items():
        blob = hashlib.sha256(path.read_bytes()).hexdigest()
        listing[name] = {"size": path.stat().st_size, "blob_id": hashlib.sha1(blob.encode()).hexdigest()}
        if name in keep:
            (storage / "blobs" / blob).write_bytes(path.read_bytes())
            (snapshot / name).symlink_to(Path("../../blobs") / blob)
    (storage / "trees").mkdir()
    (storage / "trees" / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": listing}))
    return commit


@pytest.fixture
def offline(monkeypatch):
    """HF_HUB_OFFLINE=1, and every snapshot_download call's allow_patterns recorded."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    calls: list[list[str]] = []
    real = huggingface_hub.snapshot_download

    def recording(*args, **kwargs):
        calls.append(list(kwargs.get("allow_patterns") or ["<everything>"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    return calls


def test_hub_stage_fetches_only_its_shards(llama, tmp_path, offline):
    cache = tmp_path / "hf-cache"
    needed = needed_shards(llama, 2, 4, 6)
    files = {p.name: p for p in llama.iterdir()}
    shards = set(weight_map(llama).values())
    commit = populate_hub_cache(cache, REPO, files, keep=(set(files) - shards) | needed)

    progress: list[tuple[str, float]] = []
    runtime = StageRuntime(
        REPO, 2, 4, dtype="float32", cache_dir=str(cache), on_progress=lambda s, f: progress.append((s, f))
    )

    # First the config/tokenizer files and the index, then one request per needed shard, nothing else.
    assert offline[0] == [*CONFIG_FILES, SAFETENSORS_INDEX]
    requested = {p for call in offline[1:] for p in call}
    assert requested == needed and all(len(call) == 1 for call in offline[1:])
    assert runtime.model_dir.parent.name == "snapshots"

    # The cached listing makes the check real: an unneeded shard cannot be had from this cache.
    other = sorted(shards - needed)[0]
    with pytest.raises(LocalEntryNotFoundError):
        huggingface_hub.snapshot_download(REPO, revision=commit, cache_dir=str(cache), allow_patterns=[other])

    # Same numbers as loading the directory.
    hidden = torch.randn(4, runtime.hidden_size)
    local = StageRuntime(llama, 2, 4, dtype="float32")
    torch.testing.assert_close(
        runtime.forward(runtime.new_session(), 0, hidden=hidden), local.forward(local.new_session(), 0, hidden=hidden)
    )

    # Progress: downloading -> loading -> ready, fractions rising to 1 in each phase.
    states = [s for s, _ in progress]
    assert states[0] == "downloading" and states[-1] == "ready" and progress[-1] == ("ready", 1.0)
    assert states.index("loading") > max(i for i, s in enumerate(states) if s == "downloading")
    for phase in ("downloading", "loading"):
        fractions = [f for s, f in progress if s == phase]
        assert fractions == sorted(fractions) and fractions[-1] == 1.0


def test_hub_tied_last_stage_fetches_the_embedding_shard(qwen3, tmp_path, offline):
    cache = tmp_path / "hf-cache"
    needed = needed_shards(qwen3, 3, 4, 4, tied=True)
    assert weight_map(qwen3)["model.embed_tokens.weight"] in needed
    files = {p.name: p for p in qwen3.iterdir()}
    populate_hub_cache(cache, "org/tiny-qwen3", files, keep=(set(files) - set(weight_map(qwen3).values())) | needed)
    runtime = StageRuntime("org/tiny-qwen3", 3, 4, dtype="float32", cache_dir=str(cache))
    assert {p for call in offline[1:] for p in call} == needed
    assert runtime.forward(runtime.new_session(), 0, hidden=torch.randn(2, 64)).shape == (1, 320)


def test_hub_pickle_only_repo_is_refused_before_any_weights(tmp_path, offline):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    (src / "pytorch_model.bin").write_bytes(b"never fetched")
    cache = tmp_path / "hf-cache"
    populate_hub_cache(cache, "org/pickled", {p.name: p for p in src.iterdir()}, keep={"config.json"})
    with pytest.raises(CheckpointError, match="org/pickled: no safetensors weights.*pytorch_model.bin"):
        StageRuntime("org/pickled", 0, 2, cache_dir=str(cache))
    assert len(offline) == 1  # refused after the config call: no weight file was ever requested


def test_hub_unsupported_family_is_refused_before_any_weights(tmp_path, offline):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "falcon", "num_hidden_layers": 2}))
    save_file({"w": torch.zeros(2)}, str(src / "model.safetensors"))
    cache = tmp_path / "hf-cache"
    populate_hub_cache(cache, "org/falcon", {p.name: p for p in src.iterdir()}, keep={"config.json"})
    with pytest.raises(CheckpointError, match="org/falcon: model_type 'falcon' cannot be served: not the standard"):
        StageRuntime("org/falcon", 0, 2, cache_dir=str(cache))
    assert len(offline) == 1


# --------------------------------------------------------------------------- memory

_PEAK_RSS = textwrap.dedent(
    """
    import json, sys, torch
    torch.set_num_threads(1)
    from inferencemesh.modeling.runtime import StageRuntime
    rt = StageRuntime(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), dtype="float32")
    kv = rt.new_session()
    feed = {"token_ids": torch.arange(8)} if rt.is_first else {"hidden": torch.randn(8, rt.hidden_size)}
    rt.forward(kv, 0, **feed)  # touch every weight once
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    print(json.dumps({"peak": int(status["VmHWM"].split()[0]) * 1024}))
    """
)


def peak_rss(model_dir: Path, start: int, end: int) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS, str(model_dir), str(start), str(end)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak"]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_stage_peak_memory_scales_with_its_layers(tmp_path, llama):
    """Peak RSS of a process holding k of L layers ~ k/L of the layer weights + end tensors + a fixed overhead.

    Fixed overhead = the peak of the same program on a tiny model (interpreter, torch,
    transformers). Margin: 15% of the stage's weight bytes + 48 MiB (transient copies while
    loading, the allocator, activations).
    """
    big = write_tiny_model(
        tmp_path / "big",
        "llama",
        num_layers=12,
        shards=4,
        hidden_size=512,
        intermediate_size=1536,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=8000,
        tokenizer=False,
    )
    from inferencemesh.checkpoint.read import read_local

    facts = read_local(big)
    layer_bytes = facts.layer_bytes()
    total = sum(t.nbytes for t in facts.tensors.values())
    assert 180e6 < total < 220e6  # ~200 MB of float32 weights
    baseline = peak_rss(llama, 0, 1)
    for start, end in ((4, 7), (9, 12), (0, 2)):
        stage_bytes = sum(layer_bytes[start:end])
        if start == 0:
            stage_bytes += facts.group_bytes("embed")
        if end == facts.num_layers:
            stage_bytes += facts.group_bytes("norm") + facts.head_bytes()
        grew = peak_rss(big, start, end) - baseline
        assert grew <= 1.15 * stage_bytes + 48 * 2**20, (start, end, grew, stage_bytes)
        assert grew >= 0.8 * stage_bytes, (start, end, grew, stage_bytes)  # the weights are really there
        assert grew < total / 2  # nowhere near the whole model
