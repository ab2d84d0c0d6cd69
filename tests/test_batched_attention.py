"""Batched attention: a pass whose sessions attend in one padded call computes what each
session's own pass computes (float32, tight tolerance), and greedy decoding picks the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import FAMILIES, write_tiny_model

from inferencemesh.modeling.attention import padded_mask
from inferencemesh.modeling.positions import attention_mask
from inferencemesh.modeling.runtime import Segment, StageRuntime


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("batched-attention")
    return {f: write_tiny_model(root / f, f, num_layers=3, shards=1) for f in FAMILIES}


def _close(have: torch.Tensor, want: torch.Tensor, tolerance: float) -> None:
    """Equal within `tolerance` of the tensor's scale (float32 rounding, amplified by the layers)."""
    torch.testing.assert_close(have, want, rtol=tolerance, atol=tolerance * float(want.abs().max()))


def _pass(runtime: StageRuntime, form: str, segments: list[Segment]) -> list[torch.Tensor]:
    runtime.batched_attention = form
    return runtime.forward_batch(segments)


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_decode_equals_per_session_decode(models, family) -> None:
    """Sessions of different lengths (Mistral's window of 24 crossed by one) decode greedily,
    then verify a window of 3 each. The padded pass gives each session the logits of the
    per-session pass (same matmuls; the kernels differ in rounding only), within float32 noise
    of its solo pass (a matmul over 5 rows sums in another order than over 1), and the solo
    run's greedy tokens."""
    runtime = StageRuntime(models[family], 0, 3, dtype="float32", max_context=128)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 300, (n,), generator=gen) for n in (3, 29, 11, 17, 1)]
    forms = ("solo", "per-session", "padded")
    kvs = {form: [runtime.new_session() for _ in prompts] for form in forms}
    for form in forms:
        nxt = [runtime.forward(kv, 0, token_ids=p)[-1].argmax() for kv, p in zip(kvs[form], prompts, strict=True)]
    tokens = {form: list(nxt) for form in forms}
    positions = [len(p) for p in prompts]

    def step(form: str, inputs: list[torch.Tensor], logits: str) -> list[torch.Tensor]:
        if form == "solo":
            return [runtime.forward(kv, pos, token_ids=x, logits=logits)
                    for kv, pos, x in zip(kvs[form], positions, inputs, strict=True)]
        return _pass(runtime, form, [Segment(kv, pos, x, logits)
                                     for kv, pos, x in zip(kvs[form], positions, inputs, strict=True)])

    for _ in range(6):
        out = {form: step(form, [t[None] for t in tokens[form]], "last") for form in forms}
        for solo, per_session, padded in zip(out["solo"], out["per-session"], out["padded"], strict=True):
            _close(padded, per_session, 1e-5)
            _close(padded, solo, 1e-4)
        tokens = {form: [lg[-1].argmax() for lg in out[form]] for form in forms}
        assert tokens["padded"] == tokens["solo"] == tokens["per-session"]
        positions = [pos + 1 for pos in positions]
    window = [torch.randint(0, 300, (3,), generator=gen) for _ in prompts]
    out = {form: step(form, window, "all") for form in forms}
    for solo, per_session, padded in zip(out["solo"], out["per-session"], out["padded"], strict=True):
        _close(padded, per_session, 1e-5)
        _close(padded, solo, 1e-4)
    assert [kv.length for kv in kvs["padded"]] == [kv.length for kv in kvs["solo"]]


def test_padded_pass_on_a_middle_stage_equals_per_session(models) -> None:
    """A stage after the first (hidden states in and out) takes the padded form alike."""
    runtime = StageRuntime(models["qwen2"], 1, 2, dtype="float32", max_context=64)
    gen = torch.Generator().manual_seed(7)
    lengths = [4, 9, 2, 13]
    states = {}
    for form in ("per-session", "padded"):
        kvs = [runtime.new_session() for _ in lengths]
        for kv, n in zip(kvs, lengths, strict=True):
            runtime.forward(kv, 0, hidden=torch.randn(n, runtime.hidden_size, generator=gen.manual_seed(n)))
        step = [torch.randn(1, runtime.hidden_size, generator=gen.manual_seed(100 + n)) for n in lengths]
        states[form] = _pass(runtime, form, [Segment(kv, n, x) for kv, n, x in zip(kvs, lengths, step, strict=True)])
    for want, have in zip(states["per-session"], states["padded"], strict=True):
        _close(have, want, 1e-5)


@pytest.mark.parametrize("window", [None, 4])
def test_padded_mask_is_the_per_session_mask(window) -> None:
    """Row i of the padded mask is session i's own mask (positions.attention_mask), padded with False."""
    starts, count = [0, 6, 2], 3
    mask = padded_mask(starts, count, window, torch.device("cpu"))
    assert mask.shape == (3, 1, count, max(starts) + count)
    for i, start in enumerate(starts):
        own = attention_mask(start, count, window, torch.device("cpu"))
        if own is None:  # sdpa's causal mode from position 0
            own = torch.ones(count, count, dtype=torch.bool).tril()[None, None]
        width = start + count
        assert torch.equal(mask[i, :, :, :width], own[0])
        assert not mask[i, :, :, width:].any()


def test_padded_pass_of_a_bfloat16_model_equals_per_session(models) -> None:
    """bf16 weights, float32 cache (CPU): the padded form converts the new rows into the cache's
    dtype as the per-session writes do, and the sessions decode the same tokens either way."""
    runtime = StageRuntime(models["llama"], 0, 3, dtype="bfloat16", max_context=64)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (n,), generator=gen) for n in (2, 7, 4, 5)]
    tokens, logits = {}, {}
    for form in ("per-session", "padded"):
        kvs = [runtime.new_session() for _ in prompts]
        nxt = [runtime.forward(kv, 0, token_ids=p)[-1].argmax() for kv, p in zip(kvs, prompts, strict=True)]
        positions = [len(p) for p in prompts]
        tokens[form], logits[form] = [], []
        for _ in range(4):
            out = _pass(runtime, form, [Segment(kv, pos, t[None]) for kv, pos, t in zip(kvs, positions, nxt,
                                                                                       strict=True)])
            nxt = [lg[-1].argmax() for lg in out]
            tokens[form].append([int(t) for t in nxt])
            logits[form].append(torch.stack(out))
            positions = [pos + 1 for pos in positions]
    assert tokens["padded"] == tokens["per-session"]
    for have, want in zip(logits["padded"], logits["per-session"], strict=True):
        _close(have, want, 1e-2)  # bf16 activations round between the forms' float32 attention outputs
