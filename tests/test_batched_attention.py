"""Batched attention over block tables: a pass whose sessions' keys and values live in scattered
blocks of the stage's pool (modeling/kv_pool.py) computes what each session's own pass over a
cache of its own computes (float32, tight tolerance), and greedy decoding picks the same tokens,
in every family (sliding windows, softcaps, sinks included), on a middle stage and in bfloat16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import FAMILIES, write_tiny_model

from inferencemesh.modeling.kv_pool import BlockTableKV, KVPool
from inferencemesh.modeling.runtime import Segment, StageRuntime

BLOCKS_EACH = 8  # 128 positions: max_context


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("batched-attention")
    return {f: write_tiny_model(root / f, f, num_layers=3, shards=1) for f in FAMILIES}


def _close(have: torch.Tensor, want: torch.Tensor, tolerance: float) -> None:
    """Equal within `tolerance` of the tensor's scale (float32 rounding, amplified by the layers)."""
    torch.testing.assert_close(have, want, rtol=tolerance, atol=tolerance * float(want.abs().max()))


def scattered_tables(sessions: int, seed: int) -> tuple[int, list[list[int]]]:
    """(pool blocks, a table per session): every session's blocks drawn at random from one pool."""
    blocks = torch.randperm(sessions * BLOCKS_EACH + 7, generator=torch.Generator().manual_seed(seed)).tolist()
    return len(blocks), [blocks[i * BLOCKS_EACH : (i + 1) * BLOCKS_EACH] for i in range(sessions)]


class Sessions:
    """The same sessions twice: over caches of their own (solo, one pass each) and over block tables
    in one pool (batched, one pass for all)."""

    def __init__(self, runtime: StageRuntime, count: int, seed: int) -> None:
        self.runtime = runtime
        self.solo = [runtime.new_session() for _ in range(count)]
        blocks, self.tables = scattered_tables(count, seed)
        self.pool: KVPool = runtime.new_pool(blocks)
        self.pool.store.fill_(float("nan"))  # nothing unwritten may be read

    def feed(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"token_ids": x} if self.runtime.is_first else {"hidden": x}

    def prefill(self, prompts: list[torch.Tensor]) -> None:
        for kv, table, prompt in zip(self.solo, self.tables, prompts, strict=True):
            self.runtime.forward(kv, 0, **self.feed(prompt))
            self.runtime.forward(BlockTableKV(self.pool, table, 0, len(prompt)), 0, **self.feed(prompt))

    def step(self, positions: list[int], inputs: list[torch.Tensor], logits: str = "last"
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        rt = self.runtime
        solo = [rt.forward(kv, pos, logits=logits, **self.feed(x))
                for kv, pos, x in zip(self.solo, positions, inputs, strict=True)]
        batched = rt.forward_batch([Segment(BlockTableKV(self.pool, table, pos, len(x)), pos, x, logits)
                                    for table, pos, x in zip(self.tables, positions, inputs, strict=True)])
        return solo, batched


@pytest.mark.parametrize("family", FAMILIES)
def test_a_batched_pass_over_scattered_blocks_equals_each_session_alone(models, family) -> None:
    """Sessions of different lengths (Mistral's window of 24 crossed by one) decode greedily,
    then verify a window of 3 each, batched over scattered blocks: each gets the logits of its solo
    pass within float32 noise (a matmul over 5 rows sums in another order than over 1), and the
    same greedy tokens."""
    runtime = StageRuntime(models[family], 0, 3, dtype="float32", max_context=128)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 300, (n,), generator=gen) for n in (3, 29, 11, 17, 1)]
    sessions = Sessions(runtime, len(prompts), seed=1)
    sessions.prefill(prompts)
    positions = [len(p) for p in prompts]
    tokens = [runtime.forward(runtime.new_session(), 0, token_ids=p)[-1].argmax() for p in prompts]
    for _ in range(6):
        solo, batched = sessions.step(positions, [t[None] for t in tokens])
        for have, want in zip(batched, solo, strict=True):
            _close(have, want, 1e-4)
        tokens = [lg[-1].argmax() for lg in solo]
        assert [lg[-1].argmax() for lg in batched] == tokens
        positions = [pos + 1 for pos in positions]
    window = [torch.randint(0, 300, (3,), generator=gen) for _ in prompts]
    solo, batched = sessions.step(positions, window, "all")
    for have, want in zip(batched, solo, strict=True):
        _close(have, want, 1e-4)


def test_a_batched_pass_on_a_middle_stage_over_scattered_blocks_equals_each_alone(models) -> None:
    runtime = StageRuntime(models["qwen2"], 1, 2, dtype="float32", max_context=128)
    gen = torch.Generator().manual_seed(7)
    lengths = [4, 9, 2, 13]
    sessions = Sessions(runtime, len(lengths), seed=2)
    sessions.prefill([torch.randn(n, runtime.hidden_size, generator=gen) for n in lengths])
    solo, batched = sessions.step(lengths, [torch.randn(1, runtime.hidden_size, generator=gen) for _ in lengths])
    for have, want in zip(batched, solo, strict=True):
        _close(have, want, 1e-5)


def test_a_bfloat16_models_batched_pass_writes_its_float32_pool_as_a_lone_pass_does(models) -> None:
    """bf16 weights, float32 cache (CPU): the pass converts the new rows into the pool's dtype as
    a session's own cache does, and the sessions decode the same tokens either way."""
    runtime = StageRuntime(models["llama"], 0, 3, dtype="bfloat16", max_context=128)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (n,), generator=gen) for n in (2, 7, 4, 5)]
    sessions = Sessions(runtime, len(prompts), seed=3)
    assert sessions.pool.dtype == torch.float32
    sessions.prefill(prompts)
    positions = [len(p) for p in prompts]
    tokens = [runtime.forward(runtime.new_session(), 0, token_ids=p)[-1].argmax() for p in prompts]
    for _ in range(4):
        solo, batched = sessions.step(positions, [t[None] for t in tokens])
        tokens = [lg[-1].argmax() for lg in solo]
        assert [lg[-1].argmax() for lg in batched] == tokens
        for have, want in zip(batched, solo, strict=True):
            _close(have, want, 1e-2)  # bf16 activations round between a packed pass and a lone one
        positions = [pos + 1 for pos in positions]
