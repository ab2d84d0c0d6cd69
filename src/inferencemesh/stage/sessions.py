"""Per-session state held by a stage: its KV cache, sampling parameters and (last stage) the
session's tokens, which the penalties look at.

A session exists from its first frame until RELEASE, the end of the stream that opened it, an
idle TTL, or the stage's restart. A FORK frame makes a new session a copy of another's first
positions (fork_refusal, fork). A RELEASE with `retain` keeps the session as a prefix-cache
entry: it computes nothing more and its stream may FORK from it.

Room. The planner reserves KV for max_sessions live sessions at max_context each, plus
cache_tokens positions for the prefix cache alone (--prefix-cache-tokens). Entries use those,
and the slots live sessions leave free: the KV the entries hold (its allocated positions) stays
within cache_tokens + (max_sessions - live sessions) x max_context, least recently used evicted
first whenever a new live session or a new entry would pass it. So the whole table stays within
the planned reserve, and a live session never waits for the cache nor is refused for it.
The stage's worker (worker.py) holds the table and is the only code that changes a session.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from inferencemesh.modeling.kv import prefix_cache_room
from inferencemesh.protocol import params
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol.errors import Fault
from inferencemesh.sampling import GREEDY, SamplingParams


class SessionsFull(Exception):
    """The stage holds max_sessions live sessions already (prefix-cache entries do not count)."""


class Owner:
    """The stream that opened sessions: only it may compute in them, fork them, release or
    overwrite them, and they are freed when it ends. A client that learns another stream's
    session id can do nothing with it."""

    def __init__(self) -> None:
        self.sessions: set[str] = set()


@dataclass
class StageSession:
    session_id: str
    owner: Owner | None = None  # the stream that opened it
    kv: Any = None  # SessionKV of the runtime, created on the first frame
    sampling: SamplingParams = GREEDY
    logprobs: int | None = None  # None: none; else the top alternatives each token's logprob comes with
    # Last stage: the session's token ids by position (frames carry them), truncated with the
    # cache when pos_start rolls back; and the last prompt row's logits, for the logprob of the
    # next prompt chunk's first token.
    tokens: list[int] = field(default_factory=list)
    prompt_tail: Any = None
    last_used: float = field(default_factory=time.monotonic)
    retained: bool = False  # a prefix-cache entry (RELEASE with retain): forked from, never computed in

    @property
    def cached_tokens(self) -> int:
        return self.kv.length if self.kv is not None else 0

    @property
    def held_positions(self) -> int:
        """The positions its KV buffer holds room for (what it costs in memory)."""
        return self.kv.capacity if self.kv is not None else 0


class SessionTable:
    def __init__(self, max_sessions: int, ttl_seconds: float, *, max_context: int, cache_tokens: int = 0,
                 on_evict: Callable[[], None] | None = None) -> None:
        self.max_sessions = max_sessions
        self.ttl_seconds = ttl_seconds
        self.max_context = max_context
        self.cache_tokens = cache_tokens
        self._sessions: dict[str, StageSession] = {}
        self._live = 0  # sessions that are not prefix-cache entries
        self.on_evict = on_evict  # told of each prefix-cache entry dropped to make room (the metric)

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> StageSession | None:
        return self._sessions.get(session_id)

    def open(self, session_id: str, owner: Owner | None = None, keep: StageSession | None = None) -> StageSession:
        """The session, created for `owner` if new; SessionsFull when the stage is at capacity.
        `keep`: an entry about to be forked into it, not evicted for its room (fit_cache evicts it
        after the copy if it must: for that copy's length the entries may hold one beyond their room)."""
        session = self._sessions.get(session_id)
        if session is None:
            if self._live >= self.max_sessions:
                raise SessionsFull(f"stage holds its maximum of {self.max_sessions} sessions; retry later")
            session = self._sessions[session_id] = StageSession(session_id, owner)
            self._live += 1
            if owner is not None:
                owner.sessions.add(session_id)
            self.fit_cache(keep)  # one slot fewer for the entries
        session.last_used = time.monotonic()
        return session

    def retain(self, session: StageSession) -> None:
        """Keep `session` as a prefix-cache entry (see the module's doc). The slot it frees is room
        enough for it (a session holds at most max_context positions): older entries go first."""
        if session.retained:
            return
        session.retained = True
        self._live -= 1
        session.prompt_tail = None
        session.last_used = time.monotonic()
        self.fit_cache()

    def cache_room(self) -> int:
        """Positions the prefix-cache entries may hold now."""
        return prefix_cache_room(max_sessions=self.max_sessions, max_context=self.max_context,
                                 cache_tokens=self.cache_tokens, live_sessions=self._live)

    def fit_cache(self, keep: StageSession | None = None) -> None:
        """Evict entries, least recently used first, until what they hold fits cache_room (`keep`
        counts but stays)."""
        entries = sorted((s for s in self._sessions.values() if s.retained), key=lambda s: s.last_used)
        held = sum(s.held_positions for s in entries)
        entries = [s for s in entries if s is not keep]
        room = self.cache_room()
        for entry in entries:
            if held <= room:
                return
            held -= entry.held_positions
            self.release(entry.session_id)
            if self.on_evict is not None:
                self.on_evict()

    def release(self, session_id: str) -> StageSession | None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            if not session.retained:
                self._live -= 1
            if session.owner is not None:
                session.owner.sessions.discard(session_id)
            if session.kv is not None:
                session.kv.release()
                session.kv = None
        return session

    def expired(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        return [sid for sid, s in self._sessions.items() if now - s.last_used > self.ttl_seconds]

    def totals(self) -> tuple[int, int, int, int]:
        """(live sessions, prefix-cache entries, cached token positions, KV bytes)."""
        sessions = list(self._sessions.values())
        return (
            self._live,
            len(sessions) - self._live,
            sum(s.cached_tokens for s in sessions),
            sum(s.kv.nbytes() for s in sessions if s.kv is not None),
        )


def fork_refusal(frame: pb.Frame, parent: StageSession | None, target: StageSession | None) -> Fault | None:
    """Why this FORK frame cannot make `target` (the session named by the frame, None if new) a
    copy of `parent` (the one it names, None if unknown), or None when it can."""
    if not frame.parent_session_id:
        return Fault(grpc.StatusCode.INVALID_ARGUMENT, "FORK without parent_session_id")
    if frame.parent_session_id == frame.session_id:
        return Fault(grpc.StatusCode.INVALID_ARGUMENT, f"session {frame.session_id!r} cannot fork itself")
    if parent is None or parent.kv is None:
        return Fault(grpc.StatusCode.FAILED_PRECONDITION,
                     f"FORK of unknown parent session {frame.parent_session_id!r} (expired, released or the stage "
                     "restarted): prefill the new session itself")
    if frame.pos_start > parent.kv.length:
        return Fault(grpc.StatusCode.FAILED_PRECONDITION,
                     f"FORK at position {frame.pos_start}: parent session {frame.parent_session_id!r} holds only "
                     f"{parent.kv.length} positions")
    if target is not None and target.kv is not None:
        return Fault(grpc.StatusCode.ALREADY_EXISTS,
                     f"FORK onto session {frame.session_id!r}, which exists already ({target.kv.length} positions): "
                     "a fork makes a new session")
    return None


def fork(parent: StageSession, child: StageSession, frame: pb.Frame, new_kv: Callable[[], Any]) -> None:
    """Make `child` hold `parent`'s first frame.pos_start positions: the KV cache and the token
    history the last stage's penalties read; sampling from the frame, else the parent's. Device
    work: runs where the stage computes. A parent released meanwhile is a Fault, not a crash."""
    length = frame.pos_start
    source = parent.kv
    if source is None or length > source.length:
        raise Fault(grpc.StatusCode.FAILED_PRECONDITION,
                    f"parent session {frame.parent_session_id!r} was released or rolled back during FORK")
    if child.kv is None:
        child.kv = new_kv()
    try:
        child.kv.copy_prefix(source, length)
    except ValueError as err:
        raise Fault(grpc.StatusCode.FAILED_PRECONDITION, f"FORK of {frame.parent_session_id!r}: {err}") from err
    child.tokens = parent.tokens[:length]
    child.prompt_tail = None
    if frame.HasField("sampling"):
        child.sampling, child.logprobs = params.from_wire(frame.sampling)
    else:
        child.sampling, child.logprobs = parent.sampling, parent.logprobs
