"""One request's pipeline session: the frames it sends, the KV blocks they name, and how it
survives trouble.

A session prefills its prompt in chunks from the first position its table does not reuse (prefix
blocks matched in the block manager, or, for choices 2..n, the first choice's prompt blocks by
reference), then sends one frame per step: a DECODE of its last token, or a VERIFY of that token
with a proposal behind it, which may decide several tokens in one round trip. Every compute frame
carries the session's block table (kv_blocks.py allocates it as the frame is built); rollback
after a rejected proposal is the next frame's pos_start, whose positions are overwritten.

Recovery is two named steps, each around one operation:
- `waiting_for_room`: a stage at its session limit, or whose pool another stream holds, is
  capacity, not failure: back off and retry the session's first operation, up to queue_timeout_s;
- `replaying_after_stage_loss`: a lost stage (a new stream: the block manager forgets its index),
  a block a stage never wrote, or a preemption (the pool needed this session's blocks): the
  session waits for its turn, its tokens so far are prefilled into a new session, and the
  operation runs again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc

from inferencemesh.frontend.engine.api import TokenLogprob
from inferencemesh.frontend.engine.errors import EngineOverloaded
from inferencemesh.frontend.engine.kv_blocks import BlockTable, KvRoom, Pending, PoolExhausted
from inferencemesh.frontend.engine.metrics import FrontendMetrics
from inferencemesh.frontend.engine.proposers.base import Proposer
from inferencemesh.protocol import codec
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol.errors import PipelineError
from inferencemesh.token_masks import pack_token_masks

if TYPE_CHECKING:
    from inferencemesh.frontend.engine.grammar import SessionGrammar

log = logging.getLogger("inferencemesh.engine")
T = TypeVar("T")
COMPUTE_KINDS = (pb.PREFILL, pb.DECODE, pb.VERIFY)


class Preempted(PipelineError):
    """The pool needed this session's blocks: it recomputes its tokens when blocks are free again."""

    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.ABORTED, "preempted for KV blocks")


class PipelineSession(Protocol):
    """What the engine uses of one session in the stages (implemented by scheduler.ScheduledSession)."""

    session_id: str
    failure: PipelineError | None

    def submit(self, frame: pb.Frame) -> asyncio.Future | None:
        """Send one frame without waiting: the future of its answer, if one comes."""
        ...

    async def wait(self, answer: asyncio.Future) -> pb.Prediction | None:
        """A submitted frame's answer, within the step timeout."""
        ...

    async def send(self, frame: pb.Frame) -> pb.Prediction | None:
        """Send one frame; its Prediction when it asks for one."""
        ...

    def withdraw(self, err: PipelineError) -> None:
        """Frames not sent yet never go; they and every later send fail with `err`."""
        ...

    async def close(self) -> bool:
        """RELEASE the session at every stage; whether every stage acknowledged it."""
        ...


class Pipeline(Protocol):
    """What the engine uses of the stages (implemented by pipeline.HopPipeline and GrpcPipeline)."""

    def open(self) -> PipelineSession: ...

    async def is_ready(self) -> bool: ...

    async def close(self) -> None: ...


class Connection:
    """A request's current pipeline session, its block table, and the numbering of its frames."""

    def __init__(self, pipeline: Pipeline, request_id: str, room: KvRoom) -> None:
        self.pipeline, self.request_id, self.room = pipeline, request_id, room
        self.table = BlockTable()  # the session's KV blocks, for every stage (kv_blocks.py)
        self.positions = 0  # the furthest position a frame of it has computed over: its live KV
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
        holds it until its batch goes out), so no receiver needs a copy. A compute frame names the
        session's blocks for [0, pos_start + token_count), allocated here (preempting the most
        recently admitted session when the pool is full: KvRoom.grow)."""
        if self.session.failure is not None:
            raise self.session.failure  # preempted: nothing more is allocated for it
        if kind in COMPUTE_KINDS:
            end = fields["pos_start"] + fields["token_count"]
            try:
                self.room.grow(self, end)
            except PoolExhausted:  # the most recently admitted: it gave its blocks back, and waits its turn
                raise Preempted() from None
            fields["kv_blocks"] = self.table.blocks[: self.room.manager.blocks_for(end)]
            self.positions = end
        self.seq += 1
        carried, self.sampling = sampling or self.sampling, None
        return pb.Frame(session_id=self.session.session_id, request_id=self.request_id, seq=self.seq, kind=kind,
                        sampling=carried, **fields)

    def preempt(self) -> None:
        """Its unsent frames withdrawn and its blocks given back (KvRoom.grow's victim): its next
        send raises Preempted, and it replays (SessionFrames.replaying_after_stage_loss)."""
        self.session.withdraw(Preempted())
        self.room.release(self)

    async def close(self) -> bool:
        """The session's blocks go back (cached by hash where computed) and it is RELEASEd."""
        self.room.release(self)
        return await self.session.close()

    def settled(self, pending: Pending, answer: asyncio.Future) -> None:
        """A prompt chunk's answer came (or failed): its blocks are computed at every stage, or not."""
        self.room.manager.settle(pending, not answer.cancelled() and answer.exception() is None)
        self.room.notify()

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

    def __init__(self, pipeline: Pipeline, room: KvRoom, *, max_context: int, prefill_chunk: int,
                 queue_timeout_s: float, recovery_timeout_s: float, debug_telemetry: bool,
                 metrics: FrontendMetrics | None, may_speculate: Callable[[], bool]) -> None:
        self.pipeline, self.room = pipeline, room
        self.max_context, self.prefill_chunk = max_context, prefill_chunk  # max_context: the pool's too
        self.queue_timeout_s, self.recovery_timeout_s = queue_timeout_s, recovery_timeout_s
        self.debug_telemetry = debug_telemetry
        self.metrics = metrics  # where each step's time goes (proposal vs pipeline)
        self.may_speculate = may_speculate
        self.recoveries = 0  # in-flight sessions carried over a lost stage

    # ---- what the engine calls -------------------------------------------------------------------

    async def first_prefill(self, conn: Connection, prompt: list[int], sampling: pb.Sampling,
                            prompt_logprobs: bool, reuse: bool,
                            ) -> tuple[pb.Prediction, list[TokenLogprob | None] | None, int]:
        """The prompt into a new session, once the pool can hold it; it waits for the stages' room,
        and survives a lost stage and preemption. With `reuse`, its cached prefix blocks are taken
        by reference (waiting for those still being computed), and only the rest computed.
        Returns (prediction, prompt logprobs, prompt tokens reused)."""
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await self.room.admit(conn, len(prompt) + 1, resuming=False)
        except TimeoutError as err:
            raise EngineOverloaded(f"timed out after {self.queue_timeout_s:.0f}s waiting for KV blocks for "
                                   f"{len(prompt)} prompt tokens") from err
        reused = 0

        async def prefill() -> tuple[pb.Prediction, list[TokenLogprob | None] | None]:
            nonlocal reused
            reused = await self.reused(conn, prompt) if reuse else 0
            prediction, scored = await self.prefill(conn, prompt, sampling, True, prompt_logprobs, start=reused)
            assert prediction is not None  # a non-empty prompt's last chunk asks for one
            return prediction, scored

        replayable = partial(self.replaying_after_stage_loss, conn, sampling, [], prefill, len(prompt) + 1)
        prediction, scored = await self.waiting_for_room(conn, replayable)
        return prediction, scored, reused

    async def reused(self, conn: Connection, tokens: list[int]) -> int:
        """The cached full blocks of tokens[:-1] into conn's empty table, by reference: how many
        positions they cover, once those still being computed are (a failed one, and every block
        after it, conn computes itself)."""
        manager = self.room.manager
        reuse = manager.match(conn.table, tokens)
        for index, computing in reuse.waits:
            computed = False
            with contextlib.suppress(TimeoutError):  # a stalled computation: computed here instead
                async with asyncio.timeout(self.queue_timeout_s):
                    computed = await asyncio.shield(computing)
            if not computed:
                manager.truncate(conn.table, index * manager.block_tokens)
                return index * manager.block_tokens
        return reuse.tokens

    async def share_prompt(self, conn: Connection, first: Connection, prompt: list[int],
                           sampling: pb.Sampling) -> None:
        """Choices 2..n: conn's table starts with the first choice's full prompt blocks (by
        reference), and conn computes the rest of the prompt but its last token, which its first
        step decides with its own sampling."""
        manager = self.room.manager
        shared = min((len(prompt) - 1) // manager.block_tokens, len(first.table.blocks))
        self.room.running[conn] = None
        manager.share(first.table, conn.table, shared)

        async def tail() -> None:
            await self.prefill(conn, prompt[:-1], sampling, want_prediction=False,
                               start=len(conn.table.blocks) * manager.block_tokens)

        replayable = partial(self.replaying_after_stage_loss, conn, sampling, prompt[:-1], tail, len(prompt) + 1)
        await self.waiting_for_room(conn, replayable)  # after a retry, its table is empty: it computes all

    async def step(self, conn: Connection, sampling: pb.Sampling, history: list[int],
                   proposer: Proposer | None) -> pb.Prediction:
        """The next step of a session whose stages hold all of `history` but its last token."""
        return await self.replaying_after_stage_loss(conn, sampling, history[:-1],
                                                     partial(self.send_step, conn, history, proposer),
                                                     len(history) + 1, decoding=True)

    # ---- recovery, as named steps -----------------------------------------------------------------

    async def waiting_for_room(self, conn: Connection, operation: Callable[[], Awaitable[T]]) -> T:
        """A session's first operation. A stage at its session limit, or whose pool another stream
        holds, is capacity, not failure: the request waits for room, as it would in this
        frontend's own queue, and is answered 429 only after queue_timeout_s."""
        deadline = time.monotonic() + self.queue_timeout_s
        delay = 0.02
        while True:
            try:
                return await operation()
            except PipelineError as err:
                if err.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                if time.monotonic() + delay > deadline:
                    raise EngineOverloaded(f"the stages have no room: {err}") from err
                await conn.close()
                await asyncio.sleep(delay)
                delay = min(2 * delay, 0.5)
                conn.room.running[conn] = None
                conn.open()

    async def replaying_after_stage_loss(self, conn: Connection, sampling: pb.Sampling, prefix: list[int],
                                         operation: Callable[[], Awaitable[T]], needs: int,
                                         decoding: bool = False) -> T:
        """Run `operation`; if a stage was lost, a stage lacks a block, or the session was
        preempted, wait for the pipeline (up to recovery_timeout_s) and for `needs` positions of
        blocks, prefill `prefix` into a new session, and run it again. `decoding`: the session has
        produced tokens (a preempted one counts as waiting again meanwhile)."""
        deadline = None
        while True:
            try:
                return await operation()
            except PipelineError as err:
                preempted = isinstance(err, Preempted)
                if not preempted and (not err.retryable or self.recovery_timeout_s <= 0):
                    raise
                started = time.monotonic()
                if err.code == grpc.StatusCode.FAILED_PRECONDITION:  # a stage lacks blocks: it restarted
                    self.room.manager.forget_all()
                if not preempted:
                    deadline = deadline or started + self.recovery_timeout_s
                    log.warning("request %s lost its pipeline session (%s); recovering", conn.request_id, err)
                held_back = self.metrics if preempted and decoding else None  # waiting again meanwhile
                if held_back is not None:
                    held_back.record_held_back(1)
                try:
                    await self._reconnect(conn, sampling, prefix, deadline, err, needs)
                finally:
                    if held_back is not None:
                        held_back.record_held_back(-1)
                if not preempted:
                    self.recoveries += 1
                    log.info("request %s recovered in %.2fs (re-prefilled %d tokens)", conn.request_id,
                             time.monotonic() - started, len(prefix))

    async def _reconnect(self, conn: Connection, sampling: pb.Sampling, prefix: list[int], deadline: float | None,
                         cause: PipelineError, needs: int) -> None:
        """A new session holding `prefix`, in blocks of its own (its old table freed first: blocks
        it shared are never written by two replays). A preempted session has no deadline: it waits
        for blocks, before any new request."""
        await conn.close()
        while deadline is None or time.monotonic() < deadline:
            await self.room.admit(conn, needs, resuming=True)
            # a preempted session waits for blocks as long as it takes, for the pipeline no longer
            deadline = deadline or time.monotonic() + self.recovery_timeout_s
            if await self.pipeline.is_ready():
                conn.open()
                try:
                    start = await self.reused(conn, [*prefix, 0]) if prefix else 0
                    # the first frame (a chunk, or the operation's own) carries the sampling
                    await self.prefill(conn, prefix, sampling, want_prediction=False, start=start)
                    return
                except PipelineError as err:
                    if not (err.retryable or err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                            or isinstance(err, Preempted)):
                        raise
                    await conn.close()
            else:
                self.room.release(conn)
            await asyncio.sleep(0.1)
        raise PipelineError(cause.code, f"the pipeline did not recover within {self.recovery_timeout_s:.0f}s "
                                        f"after: {cause}")

    # ---- the frames ------------------------------------------------------------------------------

    async def prefill(self, conn: Connection, prompt: list[int], sampling: pb.Sampling, want_prediction: bool = True,
                      prompt_logprobs: bool = False, start: int = 0,
                      ) -> tuple[pb.Prediction | None, list[TokenLogprob | None] | None]:
        """Feed the prompt from position `start` (the session's table holds those before) in
        chunks; the last chunk's prediction holds the first new token. Chunks that ask for none go
        out one after another: each one's Ack, when it comes, makes its full blocks computed in
        the index. With prompt_logprobs (from position 0 only) every chunk asks for its tokens'
        logprobs (a Prediction each)."""
        assert not (prompt_logprobs and start), "prompt logprobs are computed, never reused"
        chunk = self.prefill_chunk
        manager = self.room.manager
        conn.sampling = sampling  # the first chunk carries it
        prediction = None
        scored: list[TokenLogprob | None] | None = [None] if prompt_logprobs else None  # position 0: nothing before it
        for position in range(start, len(prompt), chunk):
            piece = prompt[position : position + chunk]
            last = position + chunk >= len(prompt)
            predicts = want_prediction and (prompt_logprobs or last)
            masks = (await conn.token_masks())[0] if want_prediction and last else b""
            frame = conn.frame(pb.PREFILL, pos_start=position, token_count=len(piece), token_ids=piece,
                               prompt_logprobs=prompt_logprobs, want_prediction=predicts, token_masks=masks)
            pending = manager.begin(conn.table, prompt, position + len(piece))
            answer = conn.session.submit(frame)
            if answer is None:  # nothing to wait for (a pipeline that does not acknowledge)
                manager.settle(pending, False)
                continue
            answer.add_done_callback(partial(conn.settled, pending))
            if predicts:
                prediction = await conn.session.wait(answer)
                if scored is not None:
                    assert prediction is not None
                    scored.extend(converted(prediction.prompt_logprobs))
        return prediction, scored

    async def send_step(self, conn: Connection, history: list[int], proposer: Proposer | None) -> pb.Prediction:
        """One round trip: DECODE the last token, or VERIFY it with a proposal behind it."""
        # Proposals are computed on the event loop's thread, draft models included: a second
        # computing thread would bring a second OpenMP team, and a draft step is about a millisecond.
        started = time.perf_counter()
        proposal = await proposer.propose_async(history) if proposer is not None and self.may_speculate() else None
        room = min(self.max_context, self.room.manager.num_blocks * self.room.manager.block_tokens)
        drafts = proposal.tokens[: max(0, room - len(history) - 1)] if proposal is not None else []
        masks, usable = await conn.token_masks(drafts)  # a draft the grammar forbids ends the window
        drafts = drafts[:usable]
        proposed = time.perf_counter()
        sent_ns = time.time_ns() if self.debug_telemetry else 0  # 0: not stamped
        if proposal is None or not drafts:
            frame = conn.frame(pb.DECODE, pos_start=len(history) - 1, token_count=1, token_ids=history[-1:],
                               sent_ns=sent_ns, token_masks=masks)
            prediction = await self._answer(conn, frame, history)
            round_trip = time.perf_counter() - proposed
            if proposer is not None:
                proposer.observe(0, 0, proposed - started, round_trip)
            if self.metrics is not None:
                self.metrics.record_step("decode", None if proposer is None else proposed - started, round_trip)
            return prediction
        frame = conn.frame(pb.VERIFY, pos_start=len(history) - 1, token_count=1 + len(drafts),
                           token_ids=history[-1:] + drafts, sent_ns=sent_ns, token_masks=masks,
                           draft_q=codec.encode_draft_q(proposal.q[: len(drafts)]) if proposal.q else None)
        prediction = await self._answer(conn, frame, history)
        round_trip = time.perf_counter() - proposed
        assert proposer is not None  # it made the proposal
        proposer.observe(len(drafts), prediction.accepted, proposed - started, round_trip)
        if self.metrics is not None:
            self.metrics.record_step("verify", proposed - started, round_trip)
        if self.debug_telemetry:
            log.debug("request %s window %d accepted %d: proposed in %.2f ms, verified in %.2f ms", conn.request_id,
                      len(drafts), prediction.accepted, 1000 * (proposed - started), 1000 * round_trip)
        return prediction

    async def _answer(self, conn: Connection, frame: pb.Frame, history: list[int]) -> pb.Prediction:
        """The Prediction of a frame that asks for one (DECODE, VERIFY). Every decided token but the
        last is in the stages' KV now: the full blocks among them enter the prefix index."""
        prediction = await conn.session.send(frame)
        assert prediction is not None, "a DECODE or VERIFY frame is always answered"
        decided = history + list(prediction.tokens)
        self.room.manager.confirm(conn.table, decided, len(decided) - 1)
        return prediction


def converted(entries: Iterable[pb.TokenLogprobs]) -> list[TokenLogprob]:
    """Logprob entries from the wire as TokenLogprobs."""
    return [TokenLogprob(e.token, e.logprob, tuple(zip(e.top_tokens, e.top_logprobs, strict=True))) for e in entries]
