"""The prefix index of the KV block manager (kv_blocks.py): full blocks by the digest of their
tokens and of every token before them.

A block's digest (protocol/kv_events.block_digest, which the router computes too) is blake2b over
its parent's digest, its token ids and a salt (the model, and anything else that changes its KV):
the chain identifies the whole prefix, and a keyed, collision-resistant hash means a prompt cannot
be crafted to match another's blocks. An entry is computed (every stage holds it) or pending (a
frame computing it is in flight), with the future its waiters await: True once computed, False if
that computation failed. What is computed is published as events (kv_events.py): a block stored
when it becomes computed, removed when a computed block leaves, all cleared.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

from inferencemesh.frontend.engine.kv_events import KvEventLog
from inferencemesh.protocol.kv_events import block_digest

__all__ = ["Entry", "PrefixIndex", "block_digest"]


@dataclass
class Entry:
    block: int
    future: asyncio.Future[bool] | None  # None: computed
    parent: bytes = b""  # the digest of the block before it (b"": the first block)


class PrefixIndex:
    """digest -> block, and block -> digest, for computed and pending blocks."""

    def __init__(self, events: KvEventLog | None = None) -> None:
        self._by_digest: dict[bytes, Entry] = {}
        self._by_block: dict[int, bytes] = {}
        self.events = events or KvEventLog()

    def __len__(self) -> int:
        return len(self._by_digest)

    def get(self, digest: bytes) -> Entry | None:
        return self._by_digest.get(digest)

    def known(self, block: int) -> bool:
        return block in self._by_block

    def computed(self, block: int) -> bool:
        digest = self._by_block.get(block)
        return digest is not None and self._by_digest[digest].future is None

    def held(self) -> Iterator[bytes]:
        """The digests of the computed blocks (what the events have said is stored)."""
        return (digest for digest, entry in self._by_digest.items() if entry.future is None)

    def add_pending(self, digest: bytes, block: int, future: asyncio.Future[bool], parent: bytes = b"") -> None:
        self._by_digest[digest] = Entry(block, future, parent)
        self._by_block[block] = digest

    def add_computed(self, digest: bytes, block: int, parent: bytes = b"") -> None:
        self._by_digest[digest] = Entry(block, None, parent)
        self._by_block[block] = digest
        self.events.stored(digest, parent)

    def resolve(self, digest: bytes, block: int, computed: bool) -> None:
        """A pending block's computation ended; no-op if the index forgot it meanwhile."""
        entry = self._by_digest.get(digest)
        if entry is None or entry.block != block or entry.future is None:
            return
        future = entry.future
        if computed:
            entry.future = None
            self.events.stored(digest, entry.parent)
        else:  # never published: it leaves without an event
            del self._by_digest[digest], self._by_block[block]
        if not future.done():
            future.set_result(computed)

    def drop_block(self, block: int) -> None:
        """The block leaves the index (reclaimed, or its computation failed); waiters are told."""
        digest = self._by_block.pop(block, None)
        if digest is None:
            return
        entry = self._by_digest.pop(digest)
        if entry.future is None:
            self.events.removed(digest)
        elif not entry.future.done():
            entry.future.set_result(False)

    def clear(self) -> None:
        """Forget everything: pending computations report failure to their waiters."""
        for entry in self._by_digest.values():
            if entry.future is not None and not entry.future.done():
                entry.future.set_result(False)
        self._by_digest.clear()
        self._by_block.clear()
        self.events.cleared()
