"""The routing policy, as pure functions and one in-memory index of prefix affinity (no I/O).

A request's *routing key* is the text a replica's prefix cache would see first: the chat messages
(tools first, as chat templates render them), a completion's prompt, a response's instructions and
input, serialized canonically so that the same conversation always gives the same text and a
longer conversation extends it. The key is cut into fixed-size blocks of characters, each hashed
together with the hash of the blocks before it (a chained hash: block i's hash stands for the whole
prefix 0..i), as the SGLang router's approximate tree and llm-d's prefix indexes do.

The PrefixAffinity remembers, per block hash, the replicas that were sent that prefix (each with the
time it last was, as SGLang's tree keeps a set of tenants per node): an approximation of what each
replica's prefix cache holds, local to this router, bounded (least recently used blocks dropped
first) and forgetful (a replica's hold on a block expires after a TTL, as its cache would have
evicted it by then). A prefix every conversation shares (a system prompt, the tools) is held by
every replica that was sent it, and load decides among them.

`choose` orders the replicas to try (a RouteChoice): the one with the longest prefix match among those that are not
far busier than the least loaded one, then the rest by load. Far busier (SGLang's cache-aware
policy's balance thresholds): load > min_load + balance_abs AND load > min_load * balance_rel, where
load = the router's own requests in flight to it + the requests its /metrics says are waiting.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Answers that mean "this replica cannot take it now" and that another replica may well serve:
# overloaded (429), unavailable (503: loading, draining, a lost stage), a bad gateway (502).
# Retried only before the first byte went to the client. Not 504: that request may have run long.
RETRY_STATUSES = frozenset({429, 502, 503})
# The paths whose body carries a prompt, and where their prompt is.
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
# The router's work per request is bounded (it runs on the event loop every request shares): a
# body beyond KEY_MAX_BODY_BYTES is not parsed for a key (a frontend refuses one beyond 1 MiB by
# default anyway), and a key stops at KEY_MAX_CHARS (2,048 blocks, about 64k tokens of shared
# prefix): building and hashing the key of a 4 MB conversation of tiny messages cost about 1 s.
KEY_MAX_BODY_BYTES = 1024 * 1024
KEY_MAX_CHARS = 256 * 1024


def retryable(status: int) -> bool:
    """Whether an answer with this status is retried on the next replica (before the first byte)."""
    return status in RETRY_STATUSES


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _joined(parts: Iterable[str], limit: int) -> str:
    """The parts joined, stopping once `limit` characters are reached (then cut to `limit`)."""
    taken, size = [], 0
    for part in parts:
        taken.append(part)
        size += len(part)
        if size >= limit:
            break
    return "".join(taken)[:limit]


def routing_key(path: str, body: bytes | Mapping[str, Any], max_chars: int = KEY_MAX_CHARS) -> str | None:
    """The text a request's prompt starts with (its first `max_chars` characters), for prefix
    affinity; None for a request without a prompt (GET /v1/models), with a body beyond
    KEY_MAX_BODY_BYTES, or with a body that is not a JSON object (malformed or nested too deep:
    the replica answers it in OpenAI's format)."""
    if path not in GENERATION_PATHS:
        return None
    if isinstance(body, bytes | bytearray):
        if len(body) > KEY_MAX_BODY_BYTES:
            return None
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return None
    else:
        data = body
    if not isinstance(data, Mapping):
        return None
    try:
        return _key_of(path, data, max_chars)
    except RecursionError:  # a deeply nested prompt or message content
        return None


def _key_of(path: str, data: Mapping[str, Any], max_chars: int) -> str | None:
    if path == "/v1/chat/completions":
        messages = data.get("messages")
        if not isinstance(messages, list):
            return None
        head = [_canonical(data["tools"]) + "\n"] if data.get("tools") else []
        # One message after another: a conversation's next turn extends the previous key.
        return _joined(itertools.chain(head, (_canonical({"role": m.get("role"), "content": m.get("content")})
                                              if isinstance(m, Mapping) else _canonical(m) for m in messages)),
                       max_chars)
    if path == "/v1/completions":
        prompt = data.get("prompt")
        if prompt is None:
            return None
        if isinstance(prompt, list):  # a batch of prompts, or token ids: its canonical JSON, bounded
            items = (("," if i else "") + _canonical(item) for i, item in enumerate(prompt))
            return ("[" + _joined(items, max_chars) + "]")[:max_chars]
        return (prompt if isinstance(prompt, str) else _canonical(prompt))[:max_chars]
    instructions, given = data.get("instructions"), data.get("input")
    if instructions is None and given is None:
        return None
    parts: Iterable[str] = ([given] if isinstance(given, str) else [] if given is None else
                            (_canonical(item) for item in given) if isinstance(given, list) else [_canonical(given)])
    return _joined(itertools.chain([str(instructions or ""), "\n"], parts), max_chars)


def block_hashes(key: str | None, block_chars: int) -> list[int]:
    """The chained hashes of `key`'s blocks of `block_chars` characters (the last one may be shorter:
    the same prompt matches in full, a longer one that extends it matches its whole blocks)."""
    if not key:
        return []
    hashes, previous = [], b""
    for start in range(0, len(key), block_chars):
        digest = hashlib.blake2b(previous + key[start:start + block_chars].encode("utf-8", "surrogatepass"),
                                 digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "big"))
        previous = digest
    return hashes


def stable_rank(seed: int, replica: str) -> int:
    """A replica's rank for one key (rendezvous hashing): the same key orders equal replicas the
    same way every time, different keys spread over them."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{replica}".encode(), digest_size=8).digest(), "big")


class PrefixAffinity:
    """block hash -> {replica: when it was last sent that prefix}, least recently used block first;
    at most `max_entries` blocks, a replica's hold on one forgotten `ttl` seconds after its last use.
    Not thread-safe: the router's event loop owns it."""

    def __init__(self, *, ttl: float, max_entries: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl, self.max_entries, self.clock = ttl, max_entries, clock
        self._entries: OrderedDict[int, dict[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self, now: float) -> None:
        """Drop blocks whose every holder expired (blocks are in order of their last use)."""
        entries = self._entries
        while entries:
            block, holders = next(iter(entries.items()))
            if now - max(holders.values()) <= self.ttl:
                break
            del entries[block]

    def match(self, blocks: Sequence[int]) -> dict[str, int]:
        """replica -> how many leading blocks of `blocks` it was sent (its longest prefix)."""
        now = self.clock()
        self._expire(now)
        found: dict[str, int] = {}
        for i, block in enumerate(blocks):
            holders = self._entries.get(block)
            if holders is None:
                break  # a chained hash: no replica holds a longer prefix
            for replica, used in holders.items():
                if now - used <= self.ttl:
                    found[replica] = i + 1
        return found

    def record(self, blocks: Iterable[int], replica: str) -> None:
        """`replica` was sent the prefix `blocks` now."""
        now = self.clock()
        entries = self._entries
        for block in blocks:
            holders = entries.get(block)
            if holders is None:
                entries[block] = {replica: now}
            else:
                holders[replica] = now
                entries.move_to_end(block)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)
        self._expire(now)

    def forget(self, replica: str) -> None:
        """Drop a replica that went away from every block (its cache went with it)."""
        for block in list(self._entries):
            holders = self._entries[block]
            holders.pop(replica, None)
            if not holders:
                del self._entries[block]


@dataclass(frozen=True)
class RouteChoice:
    """The replicas to try, in order, and whether the first holds part of the prompt."""

    order: list[str]
    matched_blocks: int  # the first replica's matched blocks (0: no affinity)


def far_busier(load: float, min_load: float, balance_abs: float, balance_rel: float) -> bool:
    return load > min_load + balance_abs and load > min_load * balance_rel


def choose(loads: Mapping[str, float], matches: Mapping[str, int], *, seed: int, balance_abs: float,
           balance_rel: float) -> RouteChoice:
    """The order in which to try the replicas (`loads`: replica -> load): the one with the longest
    prefix match (`matches`) that is not far busier than the least loaded, then every other by load;
    equal loads (and equal matches) ordered by `seed` (stable_rank: the same prompt, the same
    replica). No replica: an empty order."""
    if not loads:
        return RouteChoice([], 0)
    ranks = {name: stable_rank(seed, name) for name in loads}
    by_load = sorted(loads, key=lambda name: (loads[name], ranks[name]))
    min_load = loads[by_load[0]]
    eligible = [name for name, blocks in matches.items() if blocks > 0 and name in loads
                and not far_busier(loads[name], min_load, balance_abs, balance_rel)]
    if not eligible:
        return RouteChoice(by_load, 0)
    best = min(eligible, key=lambda name: (-matches[name], loads[name], ranks[name]))
    return RouteChoice([best, *(name for name in by_load if name != best)], matches[best])


def key_seed(key: str | None) -> int:
    """The tie-break seed of a routing key (0 for a request without one)."""
    if not key:
        return 0
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")
