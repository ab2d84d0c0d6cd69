"""Per-session state held by a stage: its KV cache, sampling parameters and (last stage) the
session's tokens, which the penalties look at.

A session exists from its first frame until RELEASE, the end of the stream that opened it, an
idle TTL, or the stage's restart. A FORK frame makes a new session a copy of another's first
positions (fork_refusal, fork). A RELEASE with `retain` keeps the session as a prefix-cache
entry: it computes nothing more, its stream may FORK from it, and it is evicted, least recently
used first, whenever a new session needs its room: a live session never waits for the cache.
The stage's worker (worker.py) holds the table and is the only code that changes a session.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from inferencemesh.protocol import params
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol.errors import Fault
from inferencemesh.sampling import GREEDY, SamplingParams


class SessionsFull(Exception):
    """The stage holds max_sessions live sessions already."""


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


class SessionTable:
    def __init__(self, max_sessions: int, ttl_seconds: float, on_evict: Callable[[], None] | None = None) -> None:
        self.max_sessions = max_sessions
        self.ttl_seconds = ttl_seconds
        self._sessions: dict[str, StageSession] = {}
        self.on_evict = on_evict  # told of each prefix-cache entry dropped to make room (the metric)

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> StageSession | None:
        return self._sessions.get(session_id)

    def open(self, session_id: str, owner: Owner | None = None) -> StageSession:
        """The session, created for `owner` if new; SessionsFull when the stage is at capacity."""
        session = self._sessions.get(session_id)
        if session is None:
            if len(self._sessions) >= self.max_sessions and not self._evict_one():
                raise SessionsFull(f"stage holds its maximum of {self.max_sessions} sessions; retry later")
            session = self._sessions[session_id] = StageSession(session_id, owner)
            if owner is not None:
                owner.sessions.add(session_id)
        session.last_used = time.monotonic()
        return session

    def retain(self, session: StageSession) -> None:
        """Keep `session` as a prefix-cache entry (see the module's doc)."""
        session.retained = True
        session.prompt_tail = None
        session.last_used = time.monotonic()

    def _evict_one(self) -> bool:
        """Drop the least recently used prefix-cache entry; False when there is none."""
        entries = [s for s in self._sessions.values() if s.retained]
        if not entries:
            return False
        self.release(min(entries, key=lambda s: s.last_used).session_id)
        if self.on_evict is not None:
            self.on_evict()
        return True

    def release(self, session_id: str) -> StageSession | None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
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
        retained = sum(s.retained for s in sessions)
        return (
            len(sessions) - retained,
            retained,
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
