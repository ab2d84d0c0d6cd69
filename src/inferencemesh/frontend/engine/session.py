"""One request's pipeline session: the frames it sends, and how it survives trouble.

A session prefills its prompt in chunks (or forks another session's prompt at every stage),
then sends one frame per step: a DECODE of its last token, or a VERIFY of that token with a
proposal behind it, which may decide several tokens in one round trip. Rollback after a
rejected proposal is the next frame's pos_start: the stages truncate their caches themselves.

Recovery is three named steps, each around one operation:
- `waiting_for_room`: a stage at its session limit is capacity, not failure: back off and retry
  the session's first operation, up to queue_timeout_s (admission back-off);
- `replaying_after_stage_loss`: a lost stage is waited for (recovery_timeout_s), the session's
  tokens so far are prefilled into a new session, and the operation runs again;
- `fork_or_prefill`: a fork whose parent is gone (a stage was lost, the parent expired)
  computes the prompt itself, as a recovering session does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc

from inferencemesh.frontend.engine.api import TokenLogprob
from inferencemesh.frontend.engine.errors import EngineOverloaded
from inferencemesh.frontend.engine.metrics import FrontendMetrics
from inferencemesh.frontend.engine.prefix_cache import Match
from inferencemesh.frontend.engine.proposers.base import Proposer
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol.errors import PipelineError
from inferencemesh.token_masks import pack_token_masks

if TYPE_CHECKING:
    from inferencemesh.frontend.engine.grammar import SessionGrammar

log = logging.getLogger("inferencemesh.engine")
T = TypeVar("T")


class PipelineSession(Protocol):
    """What the engine uses of one session in the stages (implemented by scheduler.ScheduledSession)."""

    session_id: str

    async def send(self, frame: pb.Frame) -> pb.Prediction | None:
        """Send one frame (the session copies it); its Prediction when it asks for one."""
        ...

    async def close(self, retain: bool = False) -> bool:
        """RELEASE the session at every stage (retain: keep it as a prefix-cache entry); whether
        every stage acknowledged it."""
        ...


class Pipeline(Protocol):
    """What the engine uses of the stages (implemented by pipeline.HopPipeline and GrpcPipeline)."""

    def open(self) -> PipelineSession: ...

    async def is_ready(self) -> bool: ...

    async def close(self) -> None: ...


class Connection:
    """A request's current pipeline session, and the numbering of the frames sent into it."""

    def __init__(self, pipeline: Pipeline, request_id: str) -> None:
        self.pipeline, self.request_id = pipeline, request_id
        # The tokens decided so far, once generation runs (engine._decode): the session's cache
        # holds all but the last, which is what a prefix-cache entry of it holds. A replay's new
        # session holds the same.
        self.history: list[int] | None = None
        # Structured output: the choice's grammar, advanced by the engine as tokens are decided;
        # every frame that decides tokens carries its masks (token_masks).
        self.grammar: SessionGrammar | None = None
        self.open()

    def open(self) -> None:
        self.session = self.pipeline.open()
        self.seq = 0
        # The sampling parameters the session's next frame carries: stages keep what they saw
        # last, so only a session's first frame (or one after a change) carries them.
        self.sampling: pb.Sampling | None = None

    def frame(self, kind: pb.FrameKind, *, sampling: pb.Sampling | None = None, **fields: Any) -> pb.Frame:
        """The session's next frame, built fresh: once sent, nothing changes it (the scheduler
        holds it until its batch goes out), so no receiver needs a copy."""
        self.seq += 1
        carried, self.sampling = sampling or self.sampling, None
        return pb.Frame(session_id=self.session.session_id, request_id=self.request_id, seq=self.seq, kind=kind,
                        sampling=carried, **fields)

    async def close(self, retain: bool = False) -> bool:
        return await self.session.close(retain)

    async def token_masks(self, drafts: Sequence[int] = ()) -> tuple[bytes, int]:
        """The wire masks of a frame deciding after `drafts` (none: one row), and how many drafts
        the grammar allows: the window ends at the first it forbids. Unconstrained: (b"", all).
        Computed on a mask thread: a grammar's masks never hold up the event loop."""
        grammar = self.grammar
        if grammar is None:
            return b"", len(drafts)
        started = time.perf_counter()
        masks, usable = await grammar.window_masks_async(drafts)
        packed = pack_token_masks(masks, grammar.tokenizer.vocab_size)
        if grammar.mask_timer is not None:
            grammar.mask_timer(time.perf_counter() - started)
        return packed, usable


class SessionFrames:
    """The frames of every session of one engine, and their recovery (see the module's doc)."""

    def __init__(self, pipeline: Pipeline, *, max_context: int, prefill_chunk: int, queue_timeout_s: float,
                 recovery_timeout_s: float, debug_telemetry: bool, metrics: FrontendMetrics | None,
                 may_speculate: Callable[[], bool]) -> None:
        self.pipeline = pipeline
        self.max_context, self.prefill_chunk = max_context, prefill_chunk
        self.queue_timeout_s, self.recovery_timeout_s = queue_timeout_s, recovery_timeout_s
        self.debug_telemetry = debug_telemetry
        self.metrics = metrics  # where each step's time goes (proposal vs pipeline)
        self.may_speculate = may_speculate
        self.recoveries = 0  # in-flight sessions carried over a lost stage

    # ---- what the engine calls -------------------------------------------------------------------

    async def first_prefill(self, conn: Connection, prompt: list[int], sampling: pb.Sampling,
                            prompt_logprobs: bool, reuse: Match | None = None,
                            ) -> tuple[pb.Prediction, list[TokenLogprob | None] | None, int]:
        """The prompt into a new session: it waits for room, and survives a lost stage. With
        `reuse`, the session starts as a FORK of that prefix-cache entry's first reuse.tokens
        positions and computes only the rest; an entry the stages no longer hold costs a full
        prefill. Returns (prediction, prompt logprobs, prompt tokens reused)."""
        reused = 0

        async def prefill() -> tuple[pb.Prediction, list[TokenLogprob | None] | None]:
            nonlocal reused
            reused = await self._forked_from(conn, reuse, sampling) if reuse is not None else 0
            prediction, scored = await self.prefill(conn, prompt, sampling, True, prompt_logprobs, start=reused)
            assert prediction is not None  # a non-empty prompt's last chunk asks for one
            return prediction, scored

        replayable = partial(self.replaying_after_stage_loss, conn, sampling, [], prefill)
        prediction, scored = await self.waiting_for_room(conn, replayable)
        return prediction, scored, reused

    async def _forked_from(self, conn: Connection, entry: Match, sampling: pb.Sampling) -> int:
        """conn's session as a copy of the entry's first entry.tokens positions: how many it
        holds (0: the stages no longer hold the entry, and conn has a fresh session)."""
        try:
            await conn.session.send(conn.frame(pb.FORK, sampling=sampling, parent_session_id=entry.session_id,
                                               pos_start=entry.tokens, token_count=0))
            return entry.tokens
        except PipelineError as err:
            if err.code != grpc.StatusCode.FAILED_PRECONDITION:
                raise  # no room (waiting_for_room's), or a stage lost (replaying_after_stage_loss's)
            log.debug("request %s: prefix-cache entry %s is gone (%s); prefilling in full", conn.request_id,
                      entry.session_id, err)
            await conn.close()
            conn.open()
            return 0

    async def fork(self, conn: Connection, parent: str, prompt: list[int], sampling: pb.Sampling) -> None:
        """conn's session starts as the parent's first len(prompt) - 1 positions at every stage,
        sampling with `sampling`; or computes them itself (fork_or_prefill)."""
        send_fork = partial(self._send_fork, conn, parent, prompt, sampling)
        admitted_fork = partial(self.waiting_for_room, conn, send_fork)
        await self.fork_or_prefill(conn, admitted_fork, sampling, prompt)

    async def step(self, conn: Connection, sampling: pb.Sampling, history: list[int],
                   proposer: Proposer | None) -> pb.Prediction:
        """The next step of a session whose stages hold all of `history` but its last token."""
        return await self.replaying_after_stage_loss(conn, sampling, history[:-1],
                                                     partial(self.send_step, conn, history, proposer))

    # ---- recovery, as named steps -----------------------------------------------------------------

    async def waiting_for_room(self, conn: Connection, operation: Callable[[], Awaitable[T]]) -> T:
        """A session's first operation. A stage at its session limit (another frontend shares it,
        or a release is still on its way) is capacity, not failure: the request waits for room,
        as it would in this frontend's own queue, and is answered 429 only after queue_timeout_s."""
        deadline = time.monotonic() + self.queue_timeout_s
        delay = 0.02
        while True:
            try:
                return await operation()
            except PipelineError as err:
                if err.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                if time.monotonic() + delay > deadline:
                    raise EngineOverloaded(f"the stages have no free session: {err}") from err
                await conn.close()
                await asyncio.sleep(delay)
                delay = min(2 * delay, 0.5)
                conn.open()

    async def replaying_after_stage_loss(self, conn: Connection, sampling: pb.Sampling, prefix: list[int],
                                         operation: Callable[[], Awaitable[T]]) -> T:
        """Run `operation`; if a stage was lost, wait for it to come back (up to
        recovery_timeout_s), prefill `prefix` into a new session, and run it again."""
        deadline = None
        while True:
            try:
                return await operation()
            except PipelineError as err:
                if not err.retryable or self.recovery_timeout_s <= 0:
                    raise
                started = time.monotonic()
                deadline = deadline or started + self.recovery_timeout_s
                log.warning("request %s lost its pipeline session (%s); recovering", conn.request_id, err)
                await self._reconnect(conn, sampling, prefix, deadline, err)
                self.recoveries += 1
                log.info("request %s recovered in %.2fs (re-prefilled %d tokens)", conn.request_id,
                         time.monotonic() - started, len(prefix))

    async def fork_or_prefill(self, conn: Connection, fork: Callable[[], Awaitable[None]], sampling: pb.Sampling,
                              prompt: list[int]) -> None:
        """Fork; without the parent (a stage was lost meanwhile, or the parent expired) the child
        computes the prompt but its last token itself, as any recovering session does."""
        try:
            await fork()
        except PipelineError as err:
            if not err.retryable or self.recovery_timeout_s <= 0:
                raise
            log.warning("request %s could not fork its prompt (%s); prefilling it", conn.request_id, err)
            await self._reconnect(conn, sampling, prompt[:-1], time.monotonic() + self.recovery_timeout_s, err)

    async def _reconnect(self, conn: Connection, sampling: pb.Sampling, prefix: list[int], deadline: float,
                         cause: PipelineError) -> None:
        await conn.close()
        while time.monotonic() < deadline:
            if await self.pipeline.is_ready():
                conn.open()
                try:
                    if prefix:
                        await self.prefill(conn, prefix, sampling, want_prediction=False)
                    else:  # the session's next frame is its first: it carries the sampling
                        conn.sampling = sampling
                    return
                except PipelineError as err:
                    if not err.retryable:
                        raise
                    await conn.close()
            await asyncio.sleep(0.1)
        raise PipelineError(cause.code, f"the pipeline did not recover within {self.recovery_timeout_s:.0f}s "
                                        f"after: {cause}")

    # ---- the frames ------------------------------------------------------------------------------

    async def prefill(self, conn: Connection, prompt: list[int], sampling: pb.Sampling, want_prediction: bool = True,
                      prompt_logprobs: bool = False, start: int = 0,
                      ) -> tuple[pb.Prediction | None, list[TokenLogprob | None] | None]:
        """Feed the prompt from position `start` (the session holds those before) in chunks; the
        last chunk's prediction holds the first new token. With prompt_logprobs (from position 0
        only) every chunk asks for its tokens' logprobs (a Prediction each)."""
        assert not (prompt_logprobs and start), "prompt logprobs are computed, never forked"
        chunk = self.prefill_chunk
        conn.sampling = sampling  # the first chunk carries it
        prediction = None
        scored: list[TokenLogprob | None] | None = [None] if prompt_logprobs else None  # position 0: nothing before it
        for position in range(start, len(prompt), chunk):
            piece = prompt[position : position + chunk]
            last = position + chunk >= len(prompt)
            frame = conn.frame(pb.PREFILL, pos_start=position, token_count=len(piece), token_ids=piece,
                               prompt_logprobs=prompt_logprobs,
                               want_prediction=want_prediction and (prompt_logprobs or last),
                               token_masks=(await conn.token_masks())[0] if want_prediction and last else b"")
            prediction = await conn.session.send(frame)
            if scored is not None:
                assert prediction is not None
                scored.extend(converted(prediction.prompt_logprobs))
        return prediction, scored

    async def _send_fork(self, conn: Connection, parent: str, prompt: list[int], sampling: pb.Sampling) -> None:
        await conn.session.send(conn.frame(pb.FORK, sampling=sampling, parent_session_id=parent,
                                           pos_start=len(prompt) - 1, token_count=0))

    async def send_step(self, conn: Connection, history: list[int], proposer: Proposer | None) -> pb.Prediction:
        """One round trip: DECODE the last token, or VERIFY it with a proposal behind it."""
        # Proposals are computed on the event loop's thread, draft models included: a second
        # computing thread would bring a second OpenMP team, and a draft step is about a millisecond.
        started = time.perf_counter()
        proposal = await proposer.propose_async(history) if proposer is not None and self.may_speculate() else None
        drafts = proposal.tokens[: max(0, self.max_context - len(history) - 1)] if proposal is not None else []
        masks, usable = await conn.token_masks(drafts)  # a draft the grammar forbids ends the window
        drafts = drafts[:usable]
        proposed = time.perf_counter()
        sent_ns = time.time_ns() if self.debug_telemetry else 0  # 0: not stamped
        if proposal is None or not drafts:
            frame = conn.frame(pb.DECODE, pos_start=len(history) - 1, token_count=1, token_ids=history[-1:],
                               sent_ns=sent_ns, token_masks=masks)
            prediction = await self._answer(conn, frame)
            round_trip = time.perf_counter() - proposed
            if proposer is not None:
                proposer.observe(0, 0, proposed - started, round_trip)
            if self.metrics is not None:
                self.metrics.record_step("decode", None if proposer is None else proposed - started, round_trip)
            return prediction
        frame = conn.frame(pb.VERIFY, pos_start=len(history) - 1, token_count=1 + len(drafts),
                           token_ids=history[-1:] + drafts, sent_ns=sent_ns, token_masks=masks,
                           draft_probs=proposal.probs[: len(drafts) * (len(proposal.probs) // len(proposal.tokens))])
        prediction = await self._answer(conn, frame)
        round_trip = time.perf_counter() - proposed
        assert proposer is not None  # it made the proposal
        proposer.observe(len(drafts), prediction.accepted, proposed - started, round_trip)
        if self.metrics is not None:
            self.metrics.record_step("verify", proposed - started, round_trip)
        if self.debug_telemetry:
            log.debug("request %s window %d accepted %d: proposed in %.2f ms, verified in %.2f ms", conn.request_id,
                      len(drafts), prediction.accepted, 1000 * (proposed - started), 1000 * round_trip)
        return prediction


    @staticmethod
    async def _answer(conn: Connection, frame: pb.Frame) -> pb.Prediction:
        """The Prediction of a frame that asks for one (DECODE, VERIFY)."""
        prediction = await conn.session.send(frame)
        assert prediction is not None, "a DECODE or VERIFY frame is always answered"
        return prediction


def converted(entries: Iterable[pb.TokenLogprobs]) -> list[TokenLogprob]:
    """Logprob entries from the wire as TokenLogprobs."""
    return [TokenLogprob(e.token, e.logprob, tuple(zip(e.top_tokens, e.top_logprobs, strict=True))) for e in entries]
