"""The routing policy, as pure functions and one in-memory index (no I/O).

A request's *routing key* is the text a replica's prefix cache would see first: the chat messages
(tools first, as chat templates render them), a completion's prompt, a response's instructions and
input, serialized canonically so that the same conversation always gives the same text and a
longer conversation extends it. The key is cut into fixed-size blocks of characters, each hashed
together with the hash of the blocks before it (a chained hash: block i's hash stands for the whole
prefix 0..i), as the SGLang router's approximate tree and llm-d's prefix indexes do.

The PrefixIndex remembers, per block hash, the replica that was last sent that prefix: an
approximation of what each replica's prefix cache holds, local to this router, bounded (least
recently used blocks dropped first) and forgetful (a block expires after a TTL, as a replica's
cache would have evicted it by then).

`choose` orders the replicas to try: the one with the longest prefix match among those that are not
far busier than the least loaded one, then the rest by load. Far busier (SGLang's cache-aware
policy's balance thresholds): load > min_load + balance_abs AND load > min_load * balance_rel, where
load = the router's own requests in flight to it + the requests its /metrics says are waiting.
"""

from __future__ import annotations

import hashlib
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


def retryable(status: int) -> bool:
    """Whether an answer with this status is retried on the next replica (before the first byte)."""
    return status in RETRY_STATUSES


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def routing_key(path: str, body: bytes | Mapping[str, Any]) -> str | None:
    """The text a request's prompt starts with, for prefix affinity; None for a request without a
    prompt (GET /v1/models) or with a body that is not a JSON object."""
    if path not in GENERATION_PATHS:
        return None
    if isinstance(body, bytes | bytearray):
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return None
    else:
        data = body
    if not isinstance(data, Mapping):
        return None
    if path == "/v1/chat/completions":
        messages = data.get("messages")
        if not isinstance(messages, list):
            return None
        head = _canonical(data["tools"]) + "\n" if data.get("tools") else ""
        # One message after another: a conversation's next turn extends the previous key.
        return head + "".join(_canonical({"role": m.get("role"), "content": m.get("content")})
                              if isinstance(m, Mapping) else _canonical(m) for m in messages)
    if path == "/v1/completions":
        prompt = data.get("prompt")
        if prompt is None:
            return None
        return prompt if isinstance(prompt, str) else _canonical(prompt)
    instructions, given = data.get("instructions"), data.get("input")
    if instructions is None and given is None:
        return None
    text = given if isinstance(given, str) or given is None else "".join(
        _canonical(item) for item in given) if isinstance(given, list) else _canonical(given)
    return (instructions or "") + "\n" + (text or "")


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


@dataclass
class _Entry:
    replica: str
    last_used: float


class PrefixIndex:
    """block hash -> (the replica last sent that prefix, when), least recently used first; at
    most `max_entries`, each forgotten `ttl` seconds after its last use. Not thread-safe: the
    router's event loop owns it."""

    def __init__(self, *, ttl: float, max_entries: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl, self.max_entries, self.clock = ttl, max_entries, clock
        self._entries: OrderedDict[int, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self, now: float) -> None:
        entries = self._entries
        while entries:
            first = next(iter(entries.values()))
            if now - first.last_used <= self.ttl:
                break
            entries.popitem(last=False)

    def match(self, blocks: Sequence[int]) -> dict[str, int]:
        """replica -> how many leading blocks of `blocks` it was last sent (its longest prefix)."""
        self._expire(self.clock())
        found: dict[str, int] = {}
        for i, block in enumerate(blocks):
            entry = self._entries.get(block)
            if entry is not None:  # a chained hash: the replica saw blocks 0..i
                found[entry.replica] = i + 1
        return found

    def record(self, blocks: Iterable[int], replica: str) -> None:
        """`replica` was sent the prefix `blocks` now."""
        now = self.clock()
        entries = self._entries
        for block in blocks:
            entry = entries.get(block)
            if entry is None:
                entries[block] = _Entry(replica, now)
            else:
                entry.replica, entry.last_used = replica, now
                entries.move_to_end(block)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)
        self._expire(now)

    def forget(self, replica: str) -> None:
        """Drop every block of a replica that went away (its cache went with it)."""
        for block in [b for b, e in self._entries.items() if e.replica == replica]:
            del self._entries[block]


@dataclass(frozen=True)
class Choice:
    """The replicas to try, in order, and whether the first holds part of the prompt."""

    order: list[str]
    matched_blocks: int  # the first replica's matched blocks (0: no affinity)


def far_busier(load: float, min_load: float, balance_abs: float, balance_rel: float) -> bool:
    return load > min_load + balance_abs and load > min_load * balance_rel


def choose(loads: Mapping[str, float], matches: Mapping[str, int], *, seed: int, balance_abs: float,
           balance_rel: float) -> Choice:
    """The order in which to try the replicas (`loads`: replica -> load): the one with the longest
    prefix match (`matches`) that is not far busier than the least loaded, then every other by load;
    equal loads (and equal matches) ordered by `seed` (stable_rank: the same prompt, the same
    replica). No replica: an empty order."""
    if not loads:
        return Choice([], 0)
    ranks = {name: stable_rank(seed, name) for name in loads}
    by_load = sorted(loads, key=lambda name: (loads[name], ranks[name]))
    min_load = loads[by_load[0]]
    eligible = [name for name, blocks in matches.items() if blocks > 0 and name in loads
                and not far_busier(loads[name], min_load, balance_abs, balance_rel)]
    if not eligible:
        return Choice(by_load, 0)
    best = min(eligible, key=lambda name: (-matches[name], loads[name], ranks[name]))
    return Choice([best, *(name for name in by_load if name != best)], matches[best])


def key_seed(key: str | None) -> int:
    """The tie-break seed of a routing key (0 for a request without one)."""
    if not key:
        return 0
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")
