"""The frontend's lean draft forward computes what transformers computes, for every family."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import FAMILIES, write_tiny_model
from transformers import AutoModelForCausalLM

from inferencemesh.frontend.engine.proposers.base import Window
from inferencemesh.frontend.engine.proposers.draft_model import DraftModel
from inferencemesh.speculation import WindowPolicy

SEQUENCE = 70  # crosses Mistral's sliding window (24) and a cache growth step when max_context is small


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft")
    return {f: write_tiny_model(root / f, f, num_layers=3, shards=2) for f in FAMILIES}


@pytest.fixture(scope="module")
def ids() -> list[int]:
    return torch.randint(0, 300, (SEQUENCE,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.mark.parametrize("form", ["auto", "graphs"])
@pytest.mark.parametrize("family", FAMILIES)
def test_draft_logits_match_transformers(models, ids, family, form) -> None:
    """Prefill, single steps, a multi-token feed at an offset and a rollback: all equal the
    unsplit transformers model's logits at those positions (float32). form "graphs": the GPU's
    form (block tables over a pool, the steps through the stage runtime's fixed-shape step where
    its layers are lean), here uncaptured."""
    reference = AutoModelForCausalLM.from_pretrained(models[family], dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    draft = DraftModel(str(models[family]), device="cpu", max_context=128, form=form)
    assert (draft.form == "graphs") == (form == "graphs")
    cache = draft.new_cache()

    def check(pos: int, count: int) -> None:
        logits = draft.forward(cache, pos, ids[pos : pos + count])
        assert logits.shape == (draft.vocab_size,) and logits.dtype == torch.float32
        torch.testing.assert_close(logits, expected[pos + count - 1], rtol=1e-4, atol=5e-4)

    check(0, 20)
    for pos in range(20, 40):
        check(pos, 1)
    check(40, 5)  # a catch-up of several accepted tokens
    check(30, 15)  # rolled back 15 positions and fed again over what it held
    for pos in range(45, SEQUENCE):
        check(pos, 1)  # past Mistral's window and past the first cache capacity
    assert cache.length == SEQUENCE


def test_draft_refuses_positions_it_cannot_hold(models) -> None:
    draft = DraftModel(str(models["llama"]), device="cpu", max_context=16)
    cache = draft.new_cache()
    draft.forward(cache, 0, [1, 2, 3])
    with pytest.raises(ValueError, match="positions"):
        draft.forward(cache, 5, [4])  # a gap after the 3 cached positions
    with pytest.raises(ValueError, match="max_context"):
        draft.forward(cache, 3, list(range(14)))
    cache.release()
    assert cache.length == 0 and cache.k is None


def test_window_counts_proposing_in_the_cost() -> None:
    """A window grows only while proposing plus verifying beats plain decoding per token."""
    cheap = Window(WindowPolicy(initial=4, minimum=1, maximum=8))
    cheap.observe(4, 4, propose_s=0.002, round_trip_s=0.010)  # 5 tokens for 12 ms vs 10 ms for one
    assert cheap.k == 5 and cheap.paying
    costly = Window(WindowPolicy(initial=4, minimum=1, maximum=8))
    costly.observe(4, 4, propose_s=0.060, round_trip_s=0.010)  # the proposal itself is slow
    assert costly.k == 3 and not costly.paying
    plain = Window(WindowPolicy(initial=4, minimum=1, maximum=8))
    plain.observe_plain(0.004)  # a measured DECODE round trip is the baseline when there is one
    plain.observe(4, 1, propose_s=0.001, round_trip_s=0.010)
    assert plain.k == 3 and not plain.paying


def test_concurrent_proposals_share_forward_passes(models) -> None:
    """Requests that ask in the same turn of the event loop are drafted together, one forward
    pass per step for all of them, and each gets the proposal it would get alone."""
    import asyncio

    from inferencemesh.frontend.engine.proposers.draft import DraftBatcher, DraftProposer
    from inferencemesh.sampling import SamplingParams

    draft = DraftModel(str(models["qwen3"]), device="cpu", max_context=128)
    histories = [[(5 * i + 3 * j) % 300 for j in range(6 + 4 * i)] for i in range(3)]
    policy = WindowPolicy(adaptive=False, initial=4, minimum=4, maximum=4)
    greedy = SamplingParams(0.0, 1.0, 0, 0)
    alone = [DraftProposer(draft, policy, greedy).propose(h).tokens for h in histories]

    passes: list[int] = []
    packed = draft.forward_packed

    def counting(feeds):
        passes.append(len(feeds))
        return packed(feeds)

    draft.forward_packed = counting
    batcher = DraftBatcher()
    proposers = [DraftProposer(draft, policy, greedy, batcher=batcher) for _ in histories]

    async def go():
        return await asyncio.gather(*(p.propose_async(h) for p, h in zip(proposers, histories, strict=True)))

    together = [p.tokens for p in asyncio.run(go())]
    assert together == alone
    assert passes == [3, 3, 3, 3]  # catch-up, then three more draft steps, all three requests each time


def test_the_gpu_forms_pool_lends_blocks_while_they_last(models) -> None:
    from inferencemesh.frontend.engine.proposers.draft_model import DRAFT_KV_CONTEXTS, _PoolCache, _StageCache

    draft = DraftModel(str(models["llama"]), device="cpu", max_context=64, form="graphs")
    caches = [draft.new_cache() for _ in range(DRAFT_KV_CONTEXTS + 1)]
    assert all(isinstance(c, _PoolCache) for c in caches[:-1]) and isinstance(caches[-1], _StageCache)
    feeds = [(c, 0, [1 + i, 2, 3]) for i, c in enumerate(caches)]  # pooled and not, in one pass
    together = draft.forward_packed(feeds)
    for cache, (_, _, tokens), got in zip(caches, feeds, together, strict=True):
        assert cache.length == 3
        alone = draft.forward(cache, 0, tokens)
        torch.testing.assert_close(got, alone, rtol=1e-4, atol=1e-4)  # packed against alone: summation order
    caches[0].release()
    assert isinstance(draft.new_cache(), _PoolCache)
