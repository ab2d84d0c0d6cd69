"""The frontend's KV block manager alone (frontend/engine/kv_blocks.py): allocation, sharing by
reference, the prefix index with pending blocks, LRU reclaim, a new stream."""

from __future__ import annotations

import asyncio

import pytest

from inferencemesh.frontend.engine.kv_blocks import BlockManager, BlockTable, KvRoom, PoolExhausted

BT = 4  # positions per block, small for the tests


def manager(blocks: int = 8, **kw) -> BlockManager:
    return BlockManager(blocks, BT, **kw)


def computed(m: BlockManager, tokens: list[int]) -> BlockTable:
    """A table that computed `tokens` (confirmed at every stage)."""
    table = BlockTable()
    m.grow(table, len(tokens))
    m.confirm(table, tokens, len(tokens))
    return table


def test_tables_grow_into_consecutive_blocks_and_new_runs_leave_room_to_grow() -> None:
    m = manager()
    a, b = BlockTable(), BlockTable()
    m.grow(a, 5)
    assert a.blocks == [0, 1]  # the pool's start: nothing before it needs room
    m.grow(b, 1)
    assert b.blocks == [4]  # the largest free run is 2..7: b starts after half the room it does not need
    m.grow(a, 9)
    m.grow(a, 13)
    assert a.blocks == [0, 1, 2, 3]  # a grew consecutively into the room left
    m.grow(a, 17)  # 4 is b's: a new run, in the largest free run (5..7), leaving b room
    assert a.blocks == [0, 1, 2, 3, 6]
    m.grow(b, 5)
    assert b.blocks == [4, 5]
    m.free(b)
    c = BlockTable()
    m.grow(c, 8)  # two blocks: the largest free run, 4..5, exactly
    assert c.blocks == [4, 5]
    assert m.used == 7 and m.usage == 7 / 8


def test_many_tables_growing_in_turn_stay_mostly_consecutive() -> None:
    """Sessions that decode together take blocks in turn: placed runs keep each one's blocks
    consecutive (a view at the stages) far more than taking the lowest free block would."""
    m = manager(256)
    tables = [BlockTable() for _ in range(8)]
    for positions in range(1, 16 * BT + 1):
        for table in tables:
            m.grow(table, positions)
    assert _runs(tables) <= 12, [t.blocks for t in tables]  # 8 would be perfect; first fit gives 8 x 16 = 128


def _runs(tables: list[BlockTable]) -> int:
    return sum(1 + sum(b != a + 1 for a, b in zip(t.blocks, t.blocks[1:], strict=False)) for t in tables)


def test_tables_growing_together_over_a_pool_full_of_cached_blocks_stay_mostly_consecutive() -> None:
    """Once every block is cached (a busy server's steady state), new tables still grow in runs:
    the block after a table's last is taken even when cached, and the least recently used cached
    blocks are reclaimed a batch at a time, so new runs are placed in free room. Taking the LRU
    block one at a time, 8 tables growing in turn interleaved block by block (8 x 12 = 96 runs)."""
    m = manager(256)
    for r in range(16):  # 16 finished requests of 16 blocks: every block cached
        m.free(computed(m, [r + 1] * (16 * BT)))
    assert m.available == 256 and len(m.cached) == 256
    tables = [BlockTable() for _ in range(8)]
    for positions in range(1, 12 * BT + 1):
        for table in tables:
            m.grow(table, positions)
    assert _runs(tables) <= 28, [t.blocks for t in tables]
    assert m.used == 8 * 12 and 8 * 12 <= m.stats.evictions <= 8 * 12 + 256 // 8  # at most a batch ahead


def test_a_table_grows_into_the_cached_block_after_its_last() -> None:
    m = manager(8)
    m.free(computed(m, [5] * (8 * BT)))  # blocks 0..7 cached, 0 the least recently used
    table = BlockTable()
    m.grow(table, BT)
    m.grow(table, 3 * BT)
    assert _runs([table]) == 1 and m.stats.evictions == 3
    assert m.match(BlockTable(), [5] * (8 * BT) + [0]).tokens == 0  # the chain lost its first block


def test_an_identical_prompt_shares_its_full_blocks_by_reference_but_the_last_token() -> None:
    m = manager()
    prompt = list(range(12))  # 3 full blocks: prompt[:-1] covers 2
    first = computed(m, prompt)
    second = BlockTable()
    reuse = m.match(second, prompt)
    assert reuse.tokens == 8 and not reuse.waits and second.blocks == first.blocks[:2]
    assert m.refs[first.blocks[0]] == 2 and m.refs[first.blocks[2]] == 1
    assert (m.stats.queries, m.stats.hits) == (12, 8)
    m.grow(second, 12)
    assert second.blocks[2] != first.blocks[2]


def test_a_chain_that_differs_in_an_early_block_never_matches_later_blocks() -> None:
    m = manager()
    computed(m, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    other = BlockTable()
    assert m.match(other, [1, 2, 3, 0, 5, 6, 7, 8, 9]).tokens == 0  # block 1 equal, its parent not
    salted = BlockManager(8, BT, salt=b"another model")
    computed(salted, [1, 2, 3, 4, 5])
    assert salted.match(BlockTable(), [1, 2, 3, 4, 5]).tokens == 4
    assert m.match(BlockTable(), [1, 2, 3, 4, 5]).tokens == 4
    assert BlockManager(8, BT, salt=b"x").match(BlockTable(), [1, 2, 3, 4, 5]).tokens == 0


def test_freed_blocks_stay_cached_and_are_reclaimed_least_recently_used_first() -> None:
    m = manager(4)
    old, new = computed(m, [1] * 4), computed(m, [2] * 4)
    m.free(old)
    m.free(new)
    assert m.available == 4 and len(m.cached) == 2
    m.match(BlockTable(), [1] * 4 + [0])  # a use: old becomes the most recent
    m.free(BlockTable())
    t = BlockTable()
    m.grow(t, 12)  # the two free blocks, then one reclaim: `new` is the least recently used
    assert m.stats.evictions == 1
    assert m.match(BlockTable(), [2] * 4 + [0]).tokens == 0


def test_pool_exhaustion_raises_and_leaves_the_table_as_it_was() -> None:
    m = manager(3)
    a = BlockTable()
    m.grow(a, 8)
    with pytest.raises(PoolExhausted):
        m.grow(a, 13)
    assert len(a.blocks) == 2 and m.can_hold(12, a) and not m.can_hold(13, a) and not m.can_hold(5)


def test_pending_blocks_are_matched_and_waited_for_then_cached_after_a_cancel() -> None:
    async def go() -> None:
        m = manager()
        prompt = list(range(9))
        owner = BlockTable()
        m.grow(owner, 8)
        pending = m.begin(owner, prompt, 8)  # the chunk's frame goes out
        waiter = BlockTable()
        reuse = m.match(waiter, prompt)
        assert reuse.tokens == 8 and [i for i, _ in reuse.waits] == [0, 1]
        m.free(owner)  # the owner is cancelled: its frame still holds the blocks
        assert m.used == 2
        m.settle(pending, True)
        assert all(await asyncio.gather(*(f for _, f in reuse.waits)))
        m.free(waiter)
        assert len(m.cached) == 2 and m.match(BlockTable(), prompt).tokens == 8

    asyncio.run(go())


def test_a_failed_computation_tells_its_waiters_and_frees_its_blocks() -> None:
    async def go() -> None:
        m = manager()
        owner, waiter = BlockTable(), BlockTable()
        m.grow(owner, 8)
        pending = m.begin(owner, list(range(9)), 8)
        reuse = m.match(waiter, list(range(9)))
        m.free(owner)
        m.settle(pending, False)
        assert [f.result() for _, f in reuse.waits] == [False, False]
        m.truncate(waiter, 0)  # the waiter computes them itself, into blocks of its own
        assert m.available == 8 and m.match(BlockTable(), list(range(9))).tokens == 0

    asyncio.run(go())


def test_a_new_stream_forgets_the_index_and_fails_pending_blocks_but_keeps_live_tables() -> None:
    async def go() -> None:
        m = manager()
        live = computed(m, list(range(8)))
        m.free(computed(m, [7] * 8))
        other = BlockTable()
        m.grow(other, 4)
        pending = m.begin(other, [5] * 4, 4)
        waiter = BlockTable()
        reuse = m.match(waiter, [5] * 5)
        m.forget_all()
        assert reuse.waits[0][1].result() is False
        assert m.match(BlockTable(), list(range(9))).tokens == 0 and not m.cached
        assert live.blocks == [0, 1] and m.refs[0] == 1
        m.settle(pending, True)  # after the new stream: nothing to index
        m.free(waiter)
        m.free(other)
        m.free(live)
        assert m.available == 8 and not m.cached

    asyncio.run(go())


def test_every_block_comes_back_after_everything_is_freed() -> None:
    async def go() -> None:
        m = manager(16)
        tables = []
        for i in range(6):
            t = BlockTable()
            prompt = [1, 2, 3, 4, 5, 6, 7, 8, i, i]
            m.match(t, prompt)
            m.grow(t, len(prompt) + 3)
            m.settle(m.begin(t, prompt, len(prompt)), True)
            tables.append(t)
        n = BlockTable()
        m.share(tables[0], n, 2)
        m.grow(n, 12)
        m.truncate(tables[1], 5)
        for t in tables + [n]:
            m.free(t)
        assert m.available == 16 and sum(m.refs) == 0 and m.used == 0

    asyncio.run(go())


def test_caching_off_shares_nothing_by_hash() -> None:
    m = manager(caching=False)
    computed(m, list(range(9)))
    assert m.match(BlockTable(), list(range(9))).tokens == 0
    t = computed(m, [1] * 8)
    m.free(t)
    assert not m.cached and m.available == 5


class Holder:
    """A session as KvRoom sees it: preempt() gives its blocks back (session.Connection does more)."""

    def __init__(self, room: KvRoom, name: str) -> None:
        self.room, self.name, self.table, self.preempted = room, name, BlockTable(), 0

    def preempt(self) -> None:
        self.preempted += 1
        self.room.release(self)


def test_a_session_that_cannot_grow_preempts_the_most_recently_admitted_never_an_older_one() -> None:
    async def go() -> None:
        room = KvRoom(manager(6))
        old, mid, new = (Holder(room, n) for n in ("old", "mid", "new"))
        for holder in (old, mid, new):
            await room.admit(holder, 8, resuming=False)
            room.grow(holder, 8)
        room.grow(old, 12)  # the newest gives its blocks back
        assert (old.preempted, mid.preempted, new.preempted) == (0, 0, 1) and not new.table.blocks
        room.grow(mid, 12)  # the last free block
        with pytest.raises(PoolExhausted):  # mid is now the most recent: it yields itself
            room.grow(mid, 13)
        assert mid.preempted == 1 and not mid.table.blocks and old.table.blocks
        assert room.manager.stats.preemptions == 2

    asyncio.run(go())


def test_new_sessions_wait_for_blocks_behind_preempted_ones() -> None:
    async def go() -> None:
        room = KvRoom(manager(4))
        running = Holder(room, "running")
        await room.admit(running, 16, resuming=False)
        room.grow(running, 16)
        order: list[str] = []

        async def admitted(holder: Holder, positions: int, resuming: bool) -> None:
            await room.admit(holder, positions, resuming=resuming)
            order.append(holder.name)

        resuming = asyncio.ensure_future(admitted(Holder(room, "preempted"), 8, True))
        arriving = asyncio.ensure_future(admitted(Holder(room, "new"), 4, False))
        await asyncio.sleep(0.05)
        assert room.waiting == 2 and not order
        room.release(running)
        await asyncio.gather(resuming, arriving)
        assert order == ["preempted", "new"] and room.waiting == 0

    asyncio.run(go())


def test_a_smaller_pool_at_the_stages_retires_the_blocks_beyond_it() -> None:
    m = manager(8)
    t = computed(m, list(range(24)))  # blocks 0..5
    m.free(computed(m, [3] * 8))  # 6, 7 cached
    m.shrink(5)
    assert m.available == 0 and not m.cached
    m.free(t)  # block 5 is retired, 0..4 cached
    assert m.available == 5 and m.num_blocks == 5
    u = BlockTable()
    m.grow(u, 20)
    assert sorted(u.blocks) == [0, 1, 2, 3, 4]
