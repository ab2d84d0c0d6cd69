"""What each replica's KV cache holds, as its frontend publishes it (GET /kv/events,
protocol/kv_events.py), and the score of a prompt on it: the longest run of the prompt's leading
blocks a replica holds (vLLM's KV events feeding llm-d's KV-cache-aware scorer).

The load poller (replicas.LoadPoller) reads each replica's page every round: the events after the
last sequence number it saw, or a snapshot when the frontend cannot give them (a new reader, a
restarted frontend: another epoch, or events its bounded log dropped). A view is dropped with its
replica. To score, the router tokenizes the prompt as the frontend does and computes the same chain
digests (protocol/kv_events.prompt_digests) with the salt and block size the replica published.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from inferencemesh.protocol.kv_events import CLEARED, REMOVED, STORED, KvEventPage, prompt_digests

log = logging.getLogger("inferencemesh.router")

EVENTS_PATH = "/kv/events"
# Blocks of a prompt the router hashes (64k tokens of blocks of 16): its work per request is bounded.
MAX_ROUTE_BLOCKS = 4096


@dataclass
class ReplicaBlocks:
    """One replica's cache as its events said: the digests of the blocks it holds."""

    epoch: str = ""
    seq: int = 0
    block_tokens: int = 0
    salt: bytes = b""
    tokenizer: str = ""
    blocks: set[bytes] = field(default_factory=set)

    @property
    def known(self) -> bool:
        """Whether a page was read (before that it holds nothing the router knows of)."""
        return bool(self.epoch)

    def apply(self, page: KvEventPage) -> None:
        """A page read from the replica: a snapshot (or another epoch) replaces what was known."""
        if page.snapshot or page.epoch != self.epoch:
            if self.epoch and page.epoch != self.epoch:
                log.info("KV events: a new epoch (the frontend restarted): its view starts again")
            self.blocks = set(page.blocks)
        blocks = self.blocks
        for kind, digest, _ in page.events:
            if kind == STORED:
                blocks.add(digest)
            elif kind == REMOVED:
                blocks.discard(digest)
            elif kind == CLEARED:
                blocks.clear()
        self.epoch, self.seq = page.epoch, page.seq
        self.block_tokens, self.salt, self.tokenizer = page.block_tokens, page.salt, page.tokenizer

    def leading(self, digests: Sequence[bytes]) -> int:
        """How many of `digests`, from the first, this replica holds (a chain: none past a miss)."""
        for i, digest in enumerate(digests):
            if digest not in self.blocks:
                return i
        return len(digests)


class KvViews:
    """Every replica's ReplicaBlocks, by replica name. Not thread-safe: the router's loop owns it."""

    def __init__(self) -> None:
        self.views: dict[str, ReplicaBlocks] = {}

    def forget(self, name: str) -> None:
        self.views.pop(name, None)

    def held(self, name: str) -> int:
        view = self.views.get(name)
        return len(view.blocks) if view is not None else 0

    def tokenizer(self) -> str:
        """The tokenizer the replicas tokenize with, as the first known view says ("" if none)."""
        return next((v.tokenizer for v in self.views.values() if v.known and v.tokenizer), "")

    async def poll(self, client: httpx.AsyncClient, name: str, url: str) -> None:
        """Read the replica's page after what the router knows, and apply it (raises on failure:
        httpx's errors, or ValueError for a body that is not a page)."""
        view = self.views.setdefault(name, ReplicaBlocks())
        params: dict[str, Any] = {"after": view.seq, "epoch": view.epoch} if view.known else {}
        response = await client.get(url + EVENTS_PATH, params=params)
        response.raise_for_status()
        page = KvEventPage.from_json(response.json())
        if self.views.get(name) is view:  # not forgotten meanwhile
            view.apply(page)

    def params(self) -> list[tuple[bytes, int]]:
        """The distinct (salt, block size) pairs the replicas publish (one, when they serve one model)."""
        return sorted({(v.salt, v.block_tokens) for v in self.views.values() if v.known and v.block_tokens > 0})

    def holding(self) -> bool:
        """Whether any replica holds a block (else no prompt can score)."""
        return any(view.blocks for view in self.views.values())

    def match(self, digests: Mapping[tuple[bytes, int], Sequence[bytes]]) -> dict[str, int]:
        """replica -> its leading blocks of a prompt whose digests (digests_of) are given (only
        replicas holding one or more)."""
        found: dict[str, int] = {}
        for name, view in self.views.items():
            held = view.leading(digests.get((view.salt, view.block_tokens), ()))
            if held:
                found[name] = held
        return found


def digests_of(prompt: Sequence[int], params: Sequence[tuple[bytes, int]]) -> dict[tuple[bytes, int], list[bytes]]:
    """The prompt's reusable blocks' digests under each (salt, block size) (KvViews.params): pure,
    for a worker thread."""
    return {(salt, size): prompt_digests(prompt, salt, size, MAX_ROUTE_BLOCKS) for salt, size in params}
