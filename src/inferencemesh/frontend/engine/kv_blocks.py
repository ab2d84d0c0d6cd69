"""The frontend's KV block manager: the one bookkeeping of every stage's KV pool
(docs/design/kv-blocks.md).

Every stage holds the same pool of `num_blocks` blocks of `block_tokens` positions for its own
layers; frames carry each session's block table, and the stages write and read where it says.
Here: which blocks each session's table holds, reference counts, the prefix index of computed
full blocks (kv_index.py: a chain of blake2b digests), and the least recently used cached blocks
that are reclaimed when no free block is left.

A block a frame is computing is **pending** in the index: a request whose prompt needs it takes a
reference and waits for it (`Reuse.waits`), rather than computing it again. The frame holds a
reference of its own until its answer settles it (`settle`), so a request cancelled meanwhile
still leaves the block cached once every stage has computed it.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from inferencemesh.frontend.engine.kv_index import PrefixIndex, block_digest
from inferencemesh.protocol.kv_events import KvEventPage, reusable_blocks
from inferencemesh.protocol.transport import KV_BLOCK_TOKENS

# When no block is free, this share of the pool's cached blocks (the least recently used) is
# reclaimed at once: free room for new runs, at the cost of caching a little less.
RECLAIM_SHARE = 8


class PoolExhausted(Exception):
    """No free or reclaimable block is left for a table to grow: the engine preempts a session."""


@dataclass
class BlockTable:
    """One session's blocks: entry i holds positions [i * block_tokens, (i + 1) * block_tokens)."""

    blocks: list[int] = field(default_factory=list)
    # The chain digests of the leading full blocks whose tokens are known to the index (pending
    # or computed, in this table or matched from another): the parent of the next one is the last.
    digests: list[bytes] = field(default_factory=list)
    # Whether its computed blocks enter the prefix index: an engine with the prefix cache off shares
    # a pipeline's pool (a benchmark's engines do) without publishing what it computes.
    indexed: bool = True


@dataclass
class Pending:
    """Full blocks one frame is computing, registered in the index until its answer settles them."""

    entries: list[tuple[bytes, int]]  # (digest, block), each holding a reference of its own
    settled: bool = False


@dataclass
class Reuse:
    """A prompt's cached prefix, taken by reference: `tokens` positions, whose blocks pending a
    computation each come with the future that says whether it succeeded (in block order)."""

    tokens: int
    waits: list[tuple[int, asyncio.Future[bool]]]  # (block index in the table, its computation)


@dataclass
class BlockStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, found cached
    evictions: int = 0  # cached blocks reclaimed for another use
    preemptions: int = 0  # sessions preempted for room (counted by the engine)


class FreeRuns:
    """The pool's free blocks as a byte map, to place a table's new run of blocks where it has room
    to grow consecutively. Concurrent sessions that took blocks in turn (first fit) would interleave
    theirs, and every session's KV would then be gathered at every stage, every layer, every step.
    So a new run goes into the largest free run, after half of the room it does not need: the
    table before it keeps room to grow too (at the pool's start, nothing precedes it)."""

    _FREE = re.compile(rb"\x01+")

    def __init__(self, num_blocks: int) -> None:
        self._map = bytearray(b"\x01" * num_blocks)

    def take(self, block: int) -> None:
        self._map[block] = 0

    def give(self, block: int) -> None:
        if block < len(self._map):
            self._map[block] = 1

    def retire_from(self, num_blocks: int) -> None:
        del self._map[num_blocks:]

    def place(self, count: int) -> int | None:
        """Where a new run of `count` blocks starts, or None when no block is free."""
        start, length = 0, 0
        for run in self._FREE.finditer(self._map):  # in C: a scan of the pool's bytes
            if run.end() - run.start() > length:
                start, length = run.start(), run.end() - run.start()
        if not length:
            return None
        return start if start == 0 or count >= length else start + (length - count) // 2


class BlockManager:
    """The blocks of one pool, for every stage at once (see the module's doc)."""

    def __init__(self, num_blocks: int, block_tokens: int = KV_BLOCK_TOKENS, *, caching: bool = True,
                 salt: bytes = b"") -> None:
        if num_blocks < 1 or block_tokens < 1:
            raise ValueError(f"a pool needs blocks: {num_blocks} blocks of {block_tokens} positions")
        self.num_blocks, self.block_tokens = num_blocks, block_tokens
        self.caching = caching
        self.salt = salt
        self.refs = [0] * num_blocks
        self._free = set(range(num_blocks))
        self._runs = FreeRuns(num_blocks)  # where a new run of blocks starts (FreeRuns.place)
        self.cached: OrderedDict[int, None] = OrderedDict()  # refcount 0, hashed: oldest use first
        self.index = PrefixIndex()
        self.stats = BlockStats()

    # ---- capacity ---------------------------------------------------------------------------------

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_tokens)

    @property
    def available(self) -> int:
        """Blocks a table could still take: free ones and cached ones nobody references."""
        return len(self._free) + len(self.cached)

    @property
    def used(self) -> int:
        """Blocks referenced by a table or a computation in flight."""
        return self.num_blocks - self.available

    @property
    def usage(self) -> float:
        return self.used / self.num_blocks

    def can_hold(self, positions: int, table: BlockTable | None = None) -> bool:
        """Whether `table` (None: a new one) could grow to `positions` now."""
        held = len(table.blocks) if table is not None else 0
        return self.blocks_for(positions) - held <= self.available

    def shrink(self, num_blocks: int) -> None:
        """The stages' pools hold only `num_blocks` (StageInfo.kv_blocks, the smallest): blocks from
        there on are never handed out again (one in use is retired when freed)."""
        if not 0 < num_blocks < self.num_blocks:
            return
        self.num_blocks = num_blocks
        for block in [b for b in self.cached if b >= num_blocks]:
            del self.cached[block]
            self.index.drop_block(block)
        self._free = {b for b in self._free if b < num_blocks}
        self._runs.retire_from(num_blocks)

    # ---- allocation -------------------------------------------------------------------------------

    def grow(self, table: BlockTable, positions: int) -> None:
        """Blocks for positions [0, positions), or PoolExhausted (the table is left as it was)."""
        need = self.blocks_for(positions) - len(table.blocks)
        if need <= 0:
            return
        if need > self.available:
            raise PoolExhausted(f"{need} more block(s) needed, {self.available} free or reclaimable")
        for left in range(need, 0, -1):
            block = self._take(table.blocks[-1] + 1 if table.blocks else None, left)
            self.refs[block] = 1
            table.blocks.append(block)

    def _take(self, after: int | None, count: int) -> int:
        """A block for a table that wants `count` more. `after` (the block after its last) when it
        is free, or cached and unreferenced: consecutive blocks are a view at the stages, worth
        more than keeping that one cached block (it is reclaimed early, out of LRU order). Else the
        start of a new run placed to leave room (FreeRuns.place); when no block is free, the least
        recently used cached blocks are reclaimed first, a batch at a time, so that there is free
        room to place runs in (reclaimed one by one, sessions growing together would take them in
        turn and interleave: every table then gathered at every stage, layer and step)."""
        if after is not None and after in self.cached:
            self._reclaim(after)
            self._free.add(after)
        elif after is None or after not in self._free:
            if not self._free:
                for _ in range(min(len(self.cached), max(count, self.num_blocks // RECLAIM_SHARE))):
                    block = next(iter(self.cached))
                    self._reclaim(block)
                    self._free.add(block)
                    self._runs.give(block)
            after = self._runs.place(count)
        assert after is not None, "a table grows only while blocks are available"
        self._free.discard(after)
        self._runs.take(after)
        return after

    def _reclaim(self, block: int) -> None:
        """A cached block nobody references is forgotten by the index, to be used again."""
        del self.cached[block]
        self.index.drop_block(block)
        self.stats.evictions += 1

    def share(self, source: BlockTable, table: BlockTable, count: int) -> None:
        """`table` starts with `source`'s first `count` blocks, by reference (n > 1's choices)."""
        assert not table.blocks, "a table shares another's blocks only as its start"
        for block in source.blocks[:count]:
            self._ref(block)
            table.blocks.append(block)
        table.digests = list(source.digests[:count])

    def free(self, table: BlockTable) -> None:
        """The table lets go of its blocks: one nobody references goes back to the pool, or, full
        and computed, to the cached blocks (kept by hash until reclaimed)."""
        for block in table.blocks:
            self._unref(block)
        table.blocks, table.digests = [], []

    def truncate(self, table: BlockTable, positions: int) -> None:
        """Keep the blocks of positions [0, positions) only."""
        keep = self.blocks_for(positions)
        for block in table.blocks[keep:]:
            self._unref(block)
        del table.blocks[keep:]
        del table.digests[positions // self.block_tokens:]

    def _ref(self, block: int) -> None:
        if self.refs[block] == 0:
            self.cached.pop(block, None)
        self.refs[block] += 1

    def _unref(self, block: int) -> None:
        self.refs[block] -= 1
        assert self.refs[block] >= 0, f"block {block} freed more often than taken"
        if self.refs[block]:
            return
        if block >= self.num_blocks:  # beyond a shrunk pool
            self.index.drop_block(block)
        elif self.index.computed(block):
            self.cached[block] = None
        else:
            self.index.drop_block(block)  # a pending block nobody computes any more
            self._free.add(block)
            self._runs.give(block)

    # ---- the prefix index -------------------------------------------------------------------------

    def _chain(self, table: BlockTable, tokens: Sequence[int], upto_block: int) -> None:
        """Extend the table's digests over its full blocks below upto_block."""
        bt = self.block_tokens
        for i in range(len(table.digests), upto_block):
            parent = table.digests[-1] if table.digests else b""
            table.digests.append(block_digest(parent, tokens[i * bt:(i + 1) * bt], self.salt))

    def match(self, table: BlockTable, prompt: Sequence[int]) -> Reuse:
        """The cached blocks of prompt[:-1]'s longest prefix of full blocks, appended to an empty
        `table` by reference (the last prompt token is always computed: the last stage samples
        from it). Blocks still being computed come with their futures, which the caller awaits."""
        assert not table.blocks, "a prompt is matched into a new table"
        self.stats.queries += len(prompt)
        if not self.caching:
            return Reuse(0, [])
        waits = []
        self._chain(table, prompt, reusable_blocks(len(prompt), self.block_tokens))
        for i, digest in enumerate(table.digests):
            entry = self.index.get(digest)
            if entry is None:
                break
            self._ref(entry.block)
            table.blocks.append(entry.block)
            if entry.future is not None:
                waits.append((i, entry.future))
        del table.digests[len(table.blocks):]
        tokens = len(table.blocks) * self.block_tokens
        self.stats.hits += tokens
        return Reuse(tokens, waits)

    def begin(self, table: BlockTable, tokens: Sequence[int], upto: int) -> Pending:
        """A frame computing positions below `upto` of `tokens` goes out: its full blocks that the
        index lacks become pending there, each with a reference for the frame (settle ends them)."""
        entries: list[tuple[bytes, int]] = []
        if not self.caching or not table.indexed:
            return Pending(entries)
        start = len(table.digests)
        self._chain(table, tokens, upto // self.block_tokens)
        for i in range(start, len(table.digests)):
            digest, block = table.digests[i], table.blocks[i]
            if self.index.get(digest) is None and not self.index.known(block):
                self.index.add_pending(digest, block, asyncio.get_running_loop().create_future(),
                                       table.digests[i - 1] if i else b"")
                self._ref(block)
                entries.append((digest, block))
        return Pending(entries)

    def settle(self, pending: Pending, computed: bool) -> None:
        """The frame's answer came (computed: every stage holds its blocks) or it failed: its pending
        blocks become computed, or leave the index and their waiters compute them themselves."""
        if pending.settled:
            return
        pending.settled = True
        for digest, block in pending.entries:
            self.index.resolve(digest, block, computed)
            self._unref(block)

    def confirm(self, table: BlockTable, tokens: Sequence[int], upto: int) -> None:
        """Positions below `upto` of `tokens` are computed at every stage (a decode step's answer):
        the full blocks among them enter the index."""
        if not self.caching or not table.indexed:
            return
        start = len(table.digests)
        self._chain(table, tokens, min(upto // self.block_tokens, len(table.blocks)))
        for i in range(start, len(table.digests)):
            if self.index.get(table.digests[i]) is None and not self.index.known(table.blocks[i]):
                self.index.add_computed(table.digests[i], table.blocks[i], table.digests[i - 1] if i else b"")

    def event_page(self, after: int | None, epoch: str | None, tokenizer: str = "") -> KvEventPage:
        """What the index published after `after` (or a snapshot of it: KvEventLog.page)."""
        return self.index.events.page(after, epoch, self.index.held, block_tokens=self.block_tokens,
                                      salt=self.salt, tokenizer=tokenizer)

    def forget_all(self) -> None:
        """A new stream: every stage's pool is empty for it. The index is emptied (pending
        computations fail), cached blocks become free; live tables keep their blocks but no chain."""
        self.index.clear()
        for block in list(self.cached):
            self._free.add(block)
            self._runs.give(block)
        self.cached.clear()


class Holder(Protocol):
    """A session holding a table (session.Connection): preempt() gives its blocks back at once."""

    table: BlockTable

    def preempt(self) -> None: ...


class KvRoom:
    """Running out of blocks is scheduling: the sessions holding blocks in admission order, new
    ones admitted only while the pool can hold their prompt and no preempted session waits, and a
    session that cannot grow preempts the most recently admitted one (vLLM's recompute
    preemption: the preempted session recomputes its tokens once blocks are free again)."""

    def __init__(self, manager: BlockManager) -> None:
        self.manager = manager
        self.running: dict[Holder, None] = {}  # admission order: the last is preempted first
        self.held_back = 0  # preempted (or replaying) sessions waiting for blocks
        self.arriving = 0  # new sessions waiting for blocks
        self._changed = asyncio.Event()

    @property
    def waiting(self) -> int:
        return self.held_back + self.arriving

    def notify(self) -> None:
        """Blocks may have come back: the waiters look again."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def admit(self, holder: Holder, positions: int, *, resuming: bool) -> None:
        """Wait until the pool can hold `positions` for the holder (a new one waits while a resuming
        one does), then count it as running. Cancel it (a timeout) to give up."""
        counter = "held_back" if resuming else "arriving"
        setattr(self, counter, getattr(self, counter) + 1)
        try:
            while not ((resuming or not self.held_back) and self.manager.can_hold(positions, holder.table)):
                changed = self._changed
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.2):  # a safety net: blocks also come back by settle
                        await changed.wait()
        finally:
            setattr(self, counter, getattr(self, counter) - 1)
        self.running[holder] = None

    def grow(self, holder: Holder, positions: int) -> None:
        """The holder's table covers `positions`; else the most recently admitted session with
        blocks is preempted, again until it does. That is never an older one: when the holder is
        the most recent, it is preempted itself (PoolExhausted) and waits its turn, so the oldest
        session always progresses (vLLM's policy)."""
        while True:
            try:
                self.manager.grow(holder.table, positions)
                return
            except PoolExhausted:
                victim = next((h for h in reversed(self.running) if h.table.blocks), holder)
                self.manager.stats.preemptions += 1
                victim.preempt()
                if victim is holder:
                    raise

    def release(self, holder: Holder) -> None:
        """The holder's blocks go back (cached by hash where computed); it no longer runs."""
        self.running.pop(holder, None)
        self.manager.free(holder.table)
        self.notify()
