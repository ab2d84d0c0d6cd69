"""The prefix index of the KV block manager (kv_blocks.py): full blocks by the digest of their
tokens and of every token before them.

A block's digest is blake2b over its parent's digest, its token ids and a salt (the model, and
anything else that changes its KV): the chain identifies the whole prefix, and a keyed,
collision-resistant hash means a prompt cannot be crafted to match another's blocks. An entry is
computed (every stage holds it) or pending (a frame computing it is in flight), with the future
its waiters await: True once computed, False if that computation failed.
"""

from __future__ import annotations

import asyncio
import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass


def block_digest(parent: bytes, tokens: Sequence[int], salt: bytes) -> bytes:
    """The chain digest of a full block of `tokens` after the block whose digest is `parent`."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    h.update(salt)
    return h.digest()


@dataclass
class Entry:
    block: int
    future: asyncio.Future[bool] | None  # None: computed


class PrefixIndex:
    """digest -> block, and block -> digest, for computed and pending blocks."""

    def __init__(self) -> None:
        self._by_digest: dict[bytes, Entry] = {}
        self._by_block: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self._by_digest)

    def get(self, digest: bytes) -> Entry | None:
        return self._by_digest.get(digest)

    def known(self, block: int) -> bool:
        return block in self._by_block

    def computed(self, block: int) -> bool:
        digest = self._by_block.get(block)
        return digest is not None and self._by_digest[digest].future is None

    def add_pending(self, digest: bytes, block: int, future: asyncio.Future[bool]) -> None:
        self._by_digest[digest] = Entry(block, future)
        self._by_block[block] = digest

    def add_computed(self, digest: bytes, block: int) -> None:
        self._by_digest[digest] = Entry(block, None)
        self._by_block[block] = digest

    def resolve(self, digest: bytes, block: int, computed: bool) -> None:
        """A pending block's computation ended; no-op if the index forgot it meanwhile."""
        entry = self._by_digest.get(digest)
        if entry is None or entry.block != block or entry.future is None:
            return
        future, entry.future = entry.future, None
        if not computed:
            self.drop_block(block)
        if not future.done():
            future.set_result(computed)

    def drop_block(self, block: int) -> None:
        """The block leaves the index (reclaimed, or its computation failed); waiters are told."""
        digest = self._by_block.pop(block, None)
        if digest is None:
            return
        entry = self._by_digest.pop(digest)
        if entry.future is not None and not entry.future.done():
            entry.future.set_result(False)

    def clear(self) -> None:
        """Forget everything: pending computations report failure to their waiters."""
        for entry in self._by_digest.values():
            if entry.future is not None and not entry.future.done():
                entry.future.set_result(False)
        self._by_digest.clear()
        self._by_block.clear()
