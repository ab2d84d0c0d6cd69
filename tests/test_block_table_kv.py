"""The stage's KV pool: a session computed over a block table (kv_pool.BlockTableKV) gives the
logits it gets over a cache of its own (kv.SessionKV), whether its blocks are consecutive (a view
of the pool) or scattered (one gather), alone or batched, and a session that starts over another's
full blocks computes what it would alone."""

from __future__ import annotations

import pytest
import torch

from inferencemesh.bundled import DEFAULT_MODEL, bundled_path
from inferencemesh.modeling.kv_pool import NO_TOKEN, BlockTableKV, KVPool
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
    with pytest.raises(PositionError, match="block table"):
        runtime.check_positions(BlockTableKV(pool, [1], 10, 7), 10, 7)
    assert pool.nbytes() == 8 * 2 * 2 * 4 * B * 64 * 4  # layers x K,V x kv heads x slots x head_dim x float32
