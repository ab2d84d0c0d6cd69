"""The frontend's KV events: what its prefix index holds, as vLLM's KV events publish it (a block
stored, a block removed, everything cleared), for the router to score replicas by the blocks they
hold (protocol/kv_events.py has the page's format; docs/design/kv-blocks.md, "Routing by blocks").

Publishing is an append to a bounded log with a sequence number, on the event loop that changes the
index: no task, no I/O. A reader asks for the events after the last number it saw; one that asks for
a number the log no longer holds (or of another epoch: this frontend restarted) gets a snapshot of
every block held instead.
"""

from __future__ import annotations

import itertools
import secrets
from collections import deque
from collections.abc import Callable, Iterable

from inferencemesh.protocol.kv_events import CLEARED, REMOVED, STORED, KvEventPage

EVENT_LOG_EVENTS = 16384  # a second of 260k prompt tokens computed; a reader polls about every second


class KvEventLog:
    """The last `capacity` events, numbered from 1; `epoch` names this log (a restart makes another)."""

    def __init__(self, capacity: int = EVENT_LOG_EVENTS) -> None:
        self.epoch = secrets.token_hex(8)
        self.seq = 0
        self._events: deque[tuple[int, str, bytes, bytes]] = deque(maxlen=capacity)

    def stored(self, digest: bytes, parent: bytes) -> None:
        """A full block is computed at every stage and in the index."""
        self.seq += 1
        self._events.append((self.seq, STORED, digest, parent))

    def removed(self, digest: bytes) -> None:
        """A computed block left the index (reclaimed for another use, or beyond a shrunk pool)."""
        self.seq += 1
        self._events.append((self.seq, REMOVED, digest, b""))

    def cleared(self) -> None:
        """The index was emptied (a new stream: every stage's pool is empty for it)."""
        self.seq += 1
        self._events.append((self.seq, CLEARED, b"", b""))

    def page(self, after: int | None, epoch: str | None, held: Callable[[], Iterable[bytes]], *,
             block_tokens: int, salt: bytes, tokenizer: str = "") -> KvEventPage:
        """The events after `after` of epoch `epoch`; a snapshot of `held()` when this log cannot
        give them all (another epoch, no number, or one it has dropped or never reached)."""
        base = KvEventPage(self.epoch, self.seq, block_tokens, salt, tokenizer)
        oldest = self._events[0][0] if self._events else self.seq + 1
        if epoch != self.epoch or after is None or not oldest - 1 <= after <= self.seq:
            return KvEventPage(base.epoch, base.seq, block_tokens, salt, tokenizer, snapshot=True,
                               blocks=list(held()))
        start = after - (oldest - 1)  # the events are consecutive numbers
        return KvEventPage(base.epoch, base.seq, block_tokens, salt, tokenizer,
                           events=[(kind, digest, parent)
                                   for _, kind, digest, parent in itertools.islice(self._events, start, None)])
