"""The stage's KV pool: a session computed over a block table (kv_pool.BlockTableKV) gives the
logits it gets over a cache of its own (kv.SessionKV), whether its blocks are consecutive (a view
of the pool), scattered (one gather) or, long, in a few runs (a view per run, attended span by
span), alone or batched, and a session that starts over another's full blocks computes what it
would alone."""

from __future__ import annotations

import itertools

import pytest
import torch

from inferencemesh.bundled import DEFAULT_MODEL, bundled_path
from inferencemesh.modeling.attention import KVSpans, split_kv_attention
from inferencemesh.modeling.kv_pool import (
    MAX_SPLIT_RUNS,
    NO_TOKEN,
    SPLIT_MAX_QUERIES,
    SPLIT_MIN_POSITIONS,
    BlockTableKV,
    KVPool,
)
from inferencemesh.modeling.positions import attention_mask
from inferencemesh.modeling.runtime import PositionError, Segment, StageRuntime

B = 16
PROMPT = torch.arange(40, 80)  # 40 tokens: two full blocks and half of a third
TOL = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(scope="module")
def runtime() -> StageRuntime:
    return StageRuntime(bundled_path(DEFAULT_MODEL), 0, 8, dtype="float32", max_context=256)


def alone(runtime: StageRuntime, tokens: torch.Tensor, chunks: list[int]) -> list[torch.Tensor]:
    """Logits of each chunk's last row, the session in a cache of its own."""
    kv, pos, out = runtime.new_session(), 0, []
    for piece in tokens.split(chunks):
        out.append(runtime.forward(kv, pos, token_ids=piece))
        pos += len(piece)
    return out


def over_table(runtime: StageRuntime, pool: KVPool, table: list[int], tokens: torch.Tensor, chunks: list[int],
               start: int = 0) -> list[torch.Tensor]:
    """The same through the pool, each chunk a frame over `table` from position `start`."""
    pos, out = start, []
    for piece in tokens[start:].split(chunks):
        out.append(runtime.forward(BlockTableKV(pool, table, pos, len(piece)), pos, token_ids=piece))
        pos += len(piece)
    return out


@pytest.mark.parametrize("table", [[5, 6, 7, 8], [9, 2, 6, 0]], ids=["consecutive", "scattered"])
def test_a_session_over_a_block_table_computes_what_it_does_alone(runtime, table) -> None:
    pool = runtime.new_pool(12)
    pool.store.fill_(float("nan"))  # whatever the pool held before: nothing of it may be read
    chunks = [13, 20, 7, 1, 1, 1]  # prompt chunks crossing block edges, then decode steps
    tokens = torch.cat([PROMPT, torch.tensor([7, 8, 9])])
    for got, want in zip(over_table(runtime, pool, table, tokens, chunks), alone(runtime, tokens, chunks),
                         strict=True):
        torch.testing.assert_close(got, want, **TOL)


def test_a_batched_pass_over_scattered_and_consecutive_tables_equals_each_alone(runtime) -> None:
    pool = runtime.new_pool(16)
    tables = [[3, 4, 5], [11, 0, 7], [14, 1, 9]]
    prompts = [PROMPT, PROMPT.flip(0), PROMPT + 100]
    for table, prompt in zip(tables, prompts, strict=True):
        runtime.forward(BlockTableKV(pool, table, 0, 40), 0, token_ids=prompt)
    steps = [torch.tensor([1]), torch.tensor([2, 3, 4]), torch.tensor([5])]  # a decode, a verify window, a decode
    segments = [Segment(BlockTableKV(pool, table, 40, len(x)), 40, x, "all")
                for table, x in zip(tables, steps, strict=True)]
    batched = runtime.forward_batch(segments)
    for prompt, x, got in zip(prompts, steps, batched, strict=True):
        kv = runtime.new_session()
        runtime.forward(kv, 0, token_ids=prompt)
        torch.testing.assert_close(got, runtime.forward(kv, 40, token_ids=x, logits="all"), **TOL)


def test_a_session_starting_on_anothers_full_blocks_computes_what_it_does_alone(runtime) -> None:
    """The second session's table starts with the first's two full blocks; it computes only from 32."""
    pool = runtime.new_pool(8)
    over_table(runtime, pool, [0, 1, 2], PROMPT, [40])
    second = torch.cat([PROMPT[:32], torch.tensor([300, 301, 302, 303, 304])])
    got = over_table(runtime, pool, [0, 1, 5], second, [4, 1], start=32)[-1]
    torch.testing.assert_close(got, alone(runtime, second, [37])[0], **TOL)


def test_consecutive_blocks_are_read_in_place_and_scattered_ones_gathered(runtime) -> None:
    pool = runtime.new_pool(8)
    layer = pool.store[0]
    rows = torch.randn(2, layer.shape[1], 20, layer.shape[3])
    view = BlockTableKV(pool, [3, 4], 0, 20)
    view.begin(0, 20)
    keys, values = view.write(rows, 0)
    assert keys.data_ptr() == layer[0, :, 3 * B].data_ptr() and values.data_ptr() == layer[1, :, 3 * B].data_ptr()
    assert keys.shape == (1, layer.shape[1], 20, layer.shape[3])
    gather = BlockTableKV(pool, [6, 1], 0, 20)
    gather.begin(0, 20)
    keys, values = gather.write(rows, 0)
    inside = pool.store.data_ptr() <= keys.data_ptr() < pool.store.data_ptr() + pool.nbytes()
    assert not inside  # a copy: the session's rows gathered from blocks 6 and 1
    torch.testing.assert_close(keys[0], rows[0]) and torch.testing.assert_close(values[0], rows[1])
    torch.testing.assert_close(layer[:, :, 6 * B : 7 * B], rows[:, :, :B])  # written where the table says
    torch.testing.assert_close(layer[:, :, B : B + 4], rows[:, :, B:])


def test_the_pool_keeps_each_slots_token_and_refuses_positions_past_the_table(runtime) -> None:
    pool = runtime.new_pool(4)
    pool.write_tokens([2, 0], 10, list(range(10, 20)), 10)
    pool.write_tokens([2, 0], 0, None, 10)  # a frame without ids
    assert pool.read_tokens([2, 0], 20) == [NO_TOKEN] * 10 + list(range(10, 20))
    assert pool.tokens[2 * B + 10 : 3 * B].tolist() == list(range(10, 16))
    for position in range(B - 2, B + 3):  # decode steps, one token each, across a block's edge
        pool.write_tokens([3, 1], position, [100 + position], 1)
    pool.write_tokens([3, 1], B + 3, None, 1)
    assert pool.read_tokens([3, 1], B + 4)[B - 2:] == [100 + p for p in range(B - 2, B + 3)] + [NO_TOKEN]
    with pytest.raises(PositionError, match="block table"):
        runtime.check_positions(BlockTableKV(pool, [1], 10, 7), 10, 7)
    assert pool.nbytes() == 8 * 2 * 2 * 4 * B * 64 * 4  # layers x K,V x kv heads x slots x head_dim x float32


# ---- a long table in a few runs: read run by run, attended span by span (attention.KVSpans) ----


@pytest.fixture(scope="module")
def long_runtime() -> StageRuntime:
    return StageRuntime(bundled_path(DEFAULT_MODEL), 0, 8, dtype="float32", max_context=1024)


LONG = torch.randint(0, 4096, (600,), generator=torch.Generator().manual_seed(3))
RUNS = list(range(0, 20)) + list(range(50, 60)) + list(range(30, 40))  # 3 runs, 640 positions


def test_a_long_table_in_a_few_runs_is_read_as_spans_not_gathered(long_runtime) -> None:
    pool = long_runtime.new_pool(64)
    layer = pool.store[0]
    kv = BlockTableKV(pool, RUNS, SPLIT_MIN_POSITIONS - 4, 4)  # a verify window ending at 512
    kv.begin(SPLIT_MIN_POSITIONS - 4, 4)
    spans, none = kv.read(layer)
    assert isinstance(spans, KVSpans) and none is None
    assert spans.starts == [0, 20 * B, 30 * B]  # the third run is cut at the frame's end (512)
    assert [k.shape[2] for k in spans.keys] == [20 * B, 10 * B, SPLIT_MIN_POSITIONS - 30 * B]
    assert spans.keys[1].data_ptr() == layer[0, :, 50 * B].data_ptr()  # views of the pool
    short = BlockTableKV(pool, RUNS, 99, 1)  # below the threshold: one gather
    short.begin(99, 1)
    assert isinstance(short.read(layer)[0], torch.Tensor)
    chunk = BlockTableKV(pool, RUNS, 600 - 2 * SPLIT_MAX_QUERIES, 2 * SPLIT_MAX_QUERIES)  # a prefill chunk
    chunk.begin(600 - 2 * SPLIT_MAX_QUERIES, 2 * SPLIT_MAX_QUERIES)
    assert isinstance(chunk.read(layer)[0], torch.Tensor)
    many = list(range(63, 25, -1))  # 38 runs of one block: more than MAX_SPLIT_RUNS, gathered
    assert MAX_SPLIT_RUNS < 38
    scattered = BlockTableKV(pool, many, 599, 1)
    scattered.begin(599, 1)
    assert isinstance(scattered.read(layer)[0], torch.Tensor)


def test_a_session_over_a_long_table_in_runs_computes_what_it_does_alone(long_runtime) -> None:
    pool = long_runtime.new_pool(64)
    pool.store.fill_(float("nan"))
    chunks = [256, 256, 88, 1, 3, 1]  # prefill chunks past the split threshold, decode, a verify window
    tokens = torch.cat([LONG, torch.tensor([7, 8, 9, 10, 11])])
    for got, want in zip(over_table(long_runtime, pool, RUNS, tokens, chunks), alone(long_runtime, tokens, chunks),
                         strict=True):
        torch.testing.assert_close(got, want, **TOL)


def test_a_batched_pass_mixing_spans_views_and_gathers_equals_each_alone(long_runtime) -> None:
    pool = long_runtime.new_pool(128)
    tables = [RUNS, list(range(70, 110)), [120, 121, 64, 66]]  # runs, consecutive, scattered (short)
    prompts = [LONG, LONG.flip(0), LONG[:40]]
    for table, prompt in zip(tables, prompts, strict=True):
        over_table(long_runtime, pool, table, prompt, [len(piece) for piece in prompt.split(256)])
    steps = [torch.tensor([2, 3, 4]), torch.tensor([5]), torch.tensor([6, 7])]
    segments = [Segment(BlockTableKV(pool, table, len(prompt), len(x)), len(prompt), x, "all")
                for table, prompt, x in zip(tables, prompts, steps, strict=True)]
    for prompt, x, got in zip(prompts, steps, long_runtime.forward_batch(segments), strict=True):
        kv = long_runtime.new_session()
        long_runtime.forward(kv, 0, token_ids=prompt)
        torch.testing.assert_close(got, long_runtime.forward(kv, len(prompt), token_ids=x, logits="all"), **TOL)


@pytest.mark.parametrize("window", [None, 200], ids=["causal", "sliding-window"])
def test_split_kv_attention_equals_one_pass_over_the_joined_keys(window) -> None:
    """GQA (6 query heads over 2), a window of 4 queries at the end of 700 positions in 3 spans;
    with a 200-position window the first span is masked for every query (skipped) and the second
    for some rows only."""
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, 700, 64, generator=g), torch.randn(1, 2, 700, 64, generator=g)
    query = torch.randn(1, 6, 4, 64, generator=g)
    mask = attention_mask(696, 4, window, torch.device("cpu"))
    cuts = [0, 300, 498, 700]
    spans = KVSpans([keys[:, :, a:b] for a, b in itertools.pairwise(cuts)],
                    [values[:, :, a:b] for a, b in itertools.pairwise(cuts)], cuts[:-1])
    got = split_kv_attention(query, spans, mask, 0.125)
    want = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=0.125,
                                                            enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
