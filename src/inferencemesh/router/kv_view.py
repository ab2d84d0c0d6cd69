"""What each replica's KV cache holds, as its frontend publishes it (GET /kv/events,
protocol/kv_events.py), and the score of a prompt on it: the longest run of the prompt's leading
blocks a replica holds (vLLM's KV events feeding llm-d's KV-cache-aware scorer).

The load poller (replicas.LoadPoller) reads each replica's page every round: the events after the
last sequence number it saw, or a snapshot when the frontend cannot give them (a new reader, a
restarted frontend: another epoch, or events its bounded log dropped). A view is dropped with its
replica. To score, the router tokenizes the prompt as the frontend does and computes the same chain
digests (protocol/kv_events.prompt_digests) with the salt and block size the replica published.

Events lag by up to a poll interval: a conversation's next request may arrive before its replica
said it holds the previous one's blocks. So the blocks of a prompt the router sent a replica count
as held by it (**expected**) until its events say they are stored, or EXPECTED_S later (a request
that failed, or is still computing a long prompt).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from inferencemesh.config import API_KEY_ENV
from inferencemesh.protocol.kv_events import CLEARED, REMOVED, STORED, KvEventPage, prompt_digests

log = logging.getLogger("inferencemesh.router")

EVENTS_PATH = "/kv/events"
# Blocks of a prompt the router hashes (64k tokens of blocks of 16): its work per request is bounded.
MAX_ROUTE_BLOCKS = 4096
EXPECTED_S = 10.0  # how long a block sent to a replica counts as held before its events say so
FETCH_RETRY_S = 30.0  # after a failed fetch of the replicas' tokenizer (none ready, a refusal), the next try
BLOCKS, CHARACTERS = "blocks", "characters"  # the scorers (the metrics' label): KV blocks, or the fallback
# A request's prompt as token ids (path, body -> ids, None if it has none the router can tokenize),
# and what makes one from the replicas' tokenizer source (a model directory or hub id; raises if it
# cannot be loaded here). Given by the router's program: the router imports no tokenizer of its own.
PromptTokens = Callable[[str, bytes], list[int] | None]
PromptTokenizer = Callable[[str], PromptTokens]
# The replicas' tokenizer files fetched from one of them (source -> a local folder holding them: the
# router's tokenizer_files.TokenizerFolders), for a source the router cannot read itself.
FetchTokenizer = Callable[[str], Awaitable[str]]
KvDigests = dict[tuple[bytes, int], list[bytes]]  # (salt, block size) -> a prompt's digests (digests_of)


@dataclass
class ReplicaBlocks:
    """One replica's cache as its events said: the digests of the blocks it holds."""

    epoch: str = ""
    seq: int = 0
    block_tokens: int = 0
    salt: bytes = b""
    tokenizer: str = ""
    blocks: set[bytes] = field(default_factory=set)
    expected: dict[bytes, float] = field(default_factory=dict)  # sent, not yet published: digest -> until

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
        blocks, expected = self.blocks, self.expected
        for kind, digest, _ in page.events:
            if kind == STORED:
                blocks.add(digest)
                expected.pop(digest, None)
            elif kind == REMOVED:
                blocks.discard(digest)
            elif kind == CLEARED:
                blocks.clear()
        now = time.monotonic()
        self.expected = {digest: until for digest, until in expected.items() if until > now and digest not in blocks}
        self.epoch, self.seq = page.epoch, page.seq
        self.block_tokens, self.salt, self.tokenizer = page.block_tokens, page.salt, page.tokenizer

    def leading(self, digests: Sequence[bytes], now: float) -> int:
        """How many of `digests`, from the first, this replica holds or is expected to (a chain:
        none past a miss)."""
        for i, digest in enumerate(digests):
            if digest not in self.blocks and self.expected.get(digest, 0.0) <= now:
                return i
        return len(digests)

    def expect(self, digests: Sequence[bytes], now: float) -> None:
        """A prompt with these blocks was sent to the replica: held, for now."""
        until = now + EXPECTED_S
        for digest in digests:
            if digest not in self.blocks:
                self.expected[digest] = until


class KvViews:
    """Every replica's ReplicaBlocks, by replica name. Not thread-safe: the router's loop owns it."""

    def __init__(self) -> None:
        self.views: dict[str, ReplicaBlocks] = {}
        self.refused = False  # a replica answered 401 (said once in the log)

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
        if response.status_code == 401 and not self.refused:
            self.refused = True
            log.warning("KV events of %s refused (401): the router needs the frontends' API key in %s to score "
                        "by KV blocks", name, API_KEY_ENV)
        response.raise_for_status()
        page = KvEventPage.from_json(response.json())
        if self.views.get(name) is view:  # not forgotten meanwhile
            view.apply(page)

    def params(self) -> list[tuple[bytes, int]]:
        """The distinct (salt, block size) pairs the replicas publish (one, when they serve one model)."""
        return sorted({(v.salt, v.block_tokens) for v in self.views.values() if v.known and v.block_tokens > 0})

    def holding(self) -> bool:
        """Whether any replica holds (or is expected to hold) a block (else no prompt can score)."""
        return any(view.blocks or view.expected for view in self.views.values())

    def expect(self, name: str, digests: Mapping[tuple[bytes, int], Sequence[bytes]]) -> None:
        """A prompt whose digests (digests_of) are these was sent to replica `name`."""
        view = self.views.get(name)
        if view is not None and view.known:
            view.expect(digests.get((view.salt, view.block_tokens), ()), time.monotonic())

    def match(self, digests: Mapping[tuple[bytes, int], Sequence[bytes]]) -> dict[str, int]:
        """replica -> its leading blocks of a prompt whose digests (digests_of) are given (only
        replicas holding one or more)."""
        found: dict[str, int] = {}
        now = time.monotonic()
        for name, view in self.views.items():
            held = view.leading(digests.get((view.salt, view.block_tokens), ()), now)
            if held:
                found[name] = held
        return found


def digests_of(prompt: Sequence[int], params: Sequence[tuple[bytes, int]]) -> KvDigests:
    """The prompt's reusable blocks' digests under each (salt, block size) (KvViews.params): pure,
    for a worker thread."""
    return {(salt, size): prompt_digests(prompt, salt, size, MAX_ROUTE_BLOCKS) for salt, size in params}


class BlockScorer:
    """A prompt's digests for KvViews.match, once the tokenizer the replicas name is loaded (with
    `prompt_tokenizer`, off the event loop, once per source they name); until then, or where it
    cannot be loaded, None: the router scores by characters. A source that is not a folder here
    (`local`: a replica pod's path, a hub id) is loaded from the files `fetch` gets from a replica,
    tried again FETCH_RETRY_S after a failure (a loader's failure on files it has is final)."""

    def __init__(self, views: KvViews, prompt_tokenizer: PromptTokenizer | None, *,
                 fetch: FetchTokenizer | None = None, local: Callable[[str], bool] = os.path.isdir) -> None:
        self.views, self.prompt_tokenizer, self.fetch, self.local = views, prompt_tokenizer, fetch, local
        self.tokens: PromptTokens | None = None
        self.tried = ""  # the source last tried
        self.retry_at = 0.0  # a failed fetch of it: when to try again (0: never)
        self.loading: asyncio.Task | None = None

    @property
    def scorer(self) -> str:
        return BLOCKS if self.tokens is not None else CHARACTERS

    def check(self) -> None:
        """After a poll round: load the tokenizer the replicas name, if it is a new one."""
        source = self.views.tokenizer()
        if self.prompt_tokenizer is None or not source:
            return
        if source == self.tried and not (self.retry_at and time.monotonic() >= self.retry_at):
            return
        if self.loading is not None and not self.loading.done():
            return
        self.tried, self.retry_at = source, 0.0
        self.loading = asyncio.create_task(self._load(self.prompt_tokenizer, source))

    async def _load(self, loader: PromptTokenizer, source: str) -> None:
        fetched = self.fetch is not None and not self.local(source)
        try:
            folder = source
            if self.fetch is not None and fetched:
                self.retry_at = time.monotonic() + FETCH_RETRY_S  # until the files are here
                folder = await self.fetch(source)
                self.retry_at = 0.0
            self.tokens = await asyncio.to_thread(loader, folder)
        except Exception as err:  # noqa: BLE001 - whatever the loader or the fetch raises: the fallback holds
            self.tokens = None
            log.warning("routing by characters: the replicas' tokenizer %s cannot be loaded here%s (%s)", source,
                        ", nor fetched from a replica" if fetched else "", err)
            return
        log.info("routing by KV blocks: prompts tokenized with %s%s, as the replicas do", source,
                 " (its files fetched from a replica)" if fetched else "")

    async def digests(self, path: str, body: bytes) -> KvDigests | None:
        """The prompt's reusable blocks' digests under each replica's salt and block size; None
        where the router cannot score by blocks (no tokenizer, or a prompt it cannot tokenize)."""
        tokens, params = self.tokens, self.views.params()
        if tokens is None or not params:
            return None

        def compute() -> KvDigests | None:
            ids = tokens(path, body)
            return None if ids is None else digests_of(ids, params)

        return await asyncio.to_thread(compute)  # tokenizing a long prompt takes milliseconds
