"""Per-stream state held by a stage: its sessions' sampling state, and the KV blocks it wrote.

A stage session holds no KV: its keys and values live in the stage's pool of blocks, where each
frame's block table says (docs/design/kv-blocks.md). It holds its sampling parameters, whether
it wants logprobs and (last stage) the last prompt row's logits, for the logprob of the next
prompt chunk's first token. It exists from its first frame, at any position (its first frame may
read blocks other sessions of its stream wrote), until RELEASE, the end of the stream that opened
it, an idle TTL, or the stage's restart. max_sessions bounds how many exist at once.

The pool serves one stream at a time (a frontend uses one): the stream whose frame first computes
holds it until it ends, and remembers which blocks it wrote. Another stream's frames are refused
(RESOURCE_EXHAUSTED) meanwhile, and a frame that would read a block its stream never wrote is
refused (FAILED_PRECONDITION): how a restarted stage, which holds nothing, is found out. The
stage's worker (worker.py) holds both tables and is the only code that changes them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol.errors import Fault
from inferencemesh.sampling import GREEDY, SamplingParams


class SessionsFull(Exception):
    """The stage holds max_sessions sessions already."""


class Owner:
    """The stream that opened sessions: only it may compute in them, release or overwrite them,
    and they are freed when it ends. A client that learns another stream's session id can do
    nothing with it. `written`: the pool blocks this stream's frames wrote."""

    def __init__(self) -> None:
        self.sessions: set[str] = set()
        self.written: set[int] = set()


@dataclass
class StageSession:
    session_id: str
    owner: Owner | None = None  # the stream that opened it
    sampling: SamplingParams = GREEDY
    logprobs: int | None = None  # None: none; else the top alternatives each token's logprob comes with
    # Last stage: (position after it, logits row) of the last prompt chunk with prompt_logprobs.
    prompt_tail: Any = None
    last_used: float = field(default_factory=time.monotonic)
    # The leading entries of its last block table found written by its stream (checked once, not per frame).
    checked: list[int] = field(default_factory=list)


class SessionTable:
    def __init__(self, max_sessions: int, ttl_seconds: float) -> None:
        self.max_sessions = max_sessions
        self.ttl_seconds = ttl_seconds
        self._sessions: dict[str, StageSession] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> StageSession | None:
        return self._sessions.get(session_id)

    def open(self, session_id: str, owner: Owner | None = None) -> StageSession:
        """The session, created for `owner` if new; SessionsFull when the stage is at capacity."""
        session = self._sessions.get(session_id)
        if session is None:
            if len(self._sessions) >= self.max_sessions:
                raise SessionsFull(f"stage holds its maximum of {self.max_sessions} sessions; retry later")
            session = self._sessions[session_id] = StageSession(session_id, owner)
            if owner is not None:
                owner.sessions.add(session_id)
        session.last_used = time.monotonic()
        return session

    def release(self, session_id: str) -> StageSession | None:
        session = self._sessions.pop(session_id, None)
        if session is not None and session.owner is not None:
            session.owner.sessions.discard(session_id)
        return session

    def expired(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        return [sid for sid, s in self._sessions.items() if now - s.last_used > self.ttl_seconds]


class PoolLedger:
    """Which stream the stage's KV pool serves, and the frame checks that follow from it."""

    def __init__(self, num_blocks: int, block_tokens: int) -> None:
        self.num_blocks, self.block_tokens = num_blocks, block_tokens
        self.holder: Owner | None = None

    @property
    def blocks_used(self) -> int:
        """Blocks the holding stream has written."""
        return len(self.holder.written) if self.holder is not None else 0

    def admit(self, frame: pb.Frame, session: StageSession, owner: Owner) -> list[int]:
        """The frame's block table, once the frame may compute over it: the table covers its
        positions and names blocks of this pool, the pool is free or this stream's, and every
        block it reads (those below pos_start) this stream wrote. The stream then holds the pool."""
        table = list(frame.kv_blocks)
        stop = frame.pos_start + frame.token_count
        needed = -(-stop // self.block_tokens)
        if len(table) < needed:
            raise Fault(grpc.StatusCode.FAILED_PRECONDITION,
                        f"the block table has {len(table)} blocks; positions [0, {stop}) need {needed} of "
                        f"{self.block_tokens} positions")
        read = -(-frame.pos_start // self.block_tokens)
        # The entries of the session's last table found good need no second look (a decode step
        # checks its new block, not the whole context); a rollback checks nothing again.
        known = min(len(session.checked), read)
        if table[:known] != session.checked[:known]:
            known = 0
        outside = max(table[known:], default=-1)
        if outside >= self.num_blocks:
            raise Fault(grpc.StatusCode.INVALID_ARGUMENT,
                        f"block {outside} is outside the stage's KV pool of {self.num_blocks} blocks")
        if self.holder is not None and self.holder is not owner:
            if self.holder.sessions:
                raise Fault(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            "the KV pool is held by another stream with live sessions; retry when they end")
            # The holder is idle (another frontend between requests, or a stream that is ending):
            # the pool changes hands, and the blocks it wrote are no longer its (a frame of it that
            # reads them is refused as unwritten: its frontend forgets its index and computes again).
            self.holder.written.clear()
            self.holder = None
        unwritten = [b for b in table[known:read] if b not in owner.written]
        if unwritten:
            raise Fault(grpc.StatusCode.FAILED_PRECONDITION,
                        f"frame at position {frame.pos_start} reads KV block {unwritten[0]}, which this stream never "
                        "wrote (the stage restarted, or the block was never computed): compute it again")
        session.checked = table[:read]
        self.holder = owner
        return table

    def wrote(self, owner: Owner, table: list[int], start: int, stop: int) -> None:
        """A frame of `owner` computed positions [start, stop) into its table's blocks."""
        size = self.block_tokens
        owner.written.update(table[start // size : -(-stop // size)])

    def end(self, owner: Owner) -> None:
        """`owner`'s stream ended: what it wrote is no one's now, and the pool is free."""
        owner.written.clear()
        if self.holder is owner:
            self.holder = None
