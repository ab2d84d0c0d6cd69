"""The frontend's index of the prefix-cache entries its stages hold.

A finished request's session stays at every stage as an entry (RELEASE with `retain`), holding
the KV of its tokens: the prompt and every generated token but the last, which no frame fed. A
new request whose prompt starts with an entry's tokens FORKs a new session from the entry at the
longest common prefix, then prefills only the rest. At least one prompt token is always computed,
so that the last stage has logits to sample from.

The index is advisory: a stage may have evicted the entry (room for a live session, its idle TTL,
a restart, a replay that broke the stream). The FORK then fails, and the request prefills in full:
a wrong index costs speed, never an answer. It is bounded by `capacity` token positions, the room
the stages' entries have at most (modeling.kv.prefix_cache_room with no live session: every session
slot and --prefix-cache-tokens), least recently used dropped first, as the stages drop theirs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# Fewer common tokens than this are computed rather than forked: a FORK is a round trip of its own.
MIN_REUSE_TOKENS = 16
# Common prefixes are compared in slices of this many tokens (list equality runs in C), then token
# by token within the first slice that differs.
_SLICE = 64


@dataclass(frozen=True)
class Match:
    session_id: str  # the entry to FORK from
    tokens: int  # how many of the prompt's first tokens it holds: the FORK's pos_start


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token sequences."""
    limit = min(len(a), len(b))
    done = 0
    while done + _SLICE <= limit and a[done:done + _SLICE] == b[done:done + _SLICE]:
        done += _SLICE
    while done < limit and a[done] == b[done]:
        done += 1
    return done


class PrefixEntries:
    """The entries the stages hold, by session id, each with its tokens (see the module's doc)."""

    def __init__(self, capacity: int, min_reuse: int = MIN_REUSE_TOKENS) -> None:
        self.capacity = capacity  # token positions
        self.min_reuse = min_reuse
        self._entries: OrderedDict[str, list[int]] = OrderedDict()  # session id -> its tokens, oldest first
        self._held = 0  # token positions of every entry

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, prompt: Sequence[int]) -> Match | None:
        """The entry sharing the longest prefix with `prompt` (at most all but its last token),
        or None below min_reuse. A match counts as a use."""
        best, best_length = None, 0
        for session_id, tokens in self._entries.items():
            length = common_prefix(tokens, prompt)
            if length > best_length:
                best, best_length = session_id, length
        best_length = min(best_length, len(prompt) - 1)
        if best is None or best_length < self.min_reuse:
            return None
        self._entries.move_to_end(best)
        return Match(best, best_length)

    def add(self, session_id: str, tokens: list[int]) -> None:
        """A session the stages now hold as an entry, with the tokens its cache holds. An entry
        whose tokens are a prefix of these (the same conversation's earlier turn) is dropped from
        the index: every match it could give, this one gives as long."""
        for older in [sid for sid, held in self._entries.items()
                      if len(held) <= len(tokens) and common_prefix(held, tokens) == len(held)]:
            self.drop(older)
        self.drop(session_id)
        self._entries[session_id] = tokens
        self._held += len(tokens)
        while self._held > self.capacity:
            self._held -= len(self._entries.popitem(last=False)[1])

    def worth_keeping(self, tokens: Sequence[int]) -> bool:
        """Whether a session holding `tokens` is worth an entry: a FORK could reuse it."""
        return len(tokens) >= self.min_reuse

    def drop(self, session_id: str) -> None:
        """The stages no longer hold this entry."""
        tokens = self._entries.pop(session_id, None)
        if tokens is not None:
            self._held -= len(tokens)
