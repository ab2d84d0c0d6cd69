"""The generation engine: turns a GenerationRequest into frames through the pipeline.

Prefill goes in chunks; each decode step is one frame through every stage. With a
proposer (speculative decoding) a step carries [last token, d_1..d_k] as a VERIFY frame and
may yield several tokens for the same round trip. Rollback after a rejected proposal is
just the next frame's pos_start: the stages truncate their caches themselves.

n continuations of one prompt (generate_n) prefill it once: the other n - 1 sessions FORK the
first one's cache at every stage, up to the prompt's last token, which each computes itself
with its own seed; from there every choice is a request of its own.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

import grpc

from inferencemesh.config import DEFAULT_RECOVERY_TIMEOUT
from inferencemesh.frontend.admission import Admission, Lease, Slot
from inferencemesh.frontend.engine_api import (
    Choice,
    ContextLengthExceeded,
    EngineError,
    EngineOverloaded,
    GenerationRequest,
    InvalidRequest,
    Step,
    TokenLogprob,
    choice_seed,
    single_choice,
)
from inferencemesh.frontend.metrics import FrontendMetrics
from inferencemesh.frontend.proposers.base import Proposer
from inferencemesh.protocol import params
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol.errors import PipelineError
from inferencemesh.sampling import INT32_MAX, UINT32_MAX, unsafe_field

log = logging.getLogger("inferencemesh.engine")
READY_TRUST_S = 5.0


class PipelineFailed(EngineError):
    status_code = 502
    error_type = "server_error"
    code = "pipeline_error"


@dataclass(frozen=True)
class EngineOptions:
    model_name: str
    max_context: int = 2048
    max_sessions: int = 16  # concurrent requests in flight through the pipeline
    max_waiting: int = 256  # queued beyond that: 429
    prefill_chunk: int = 256  # prompt tokens per frame (bounded message size, interleaving)
    queue_timeout_s: float = 60.0
    recovery_timeout_s: float = DEFAULT_RECOVERY_TIMEOUT  # how long an in-flight request waits for a lost stage
    debug_telemetry: bool = False  # per-window timings in the log (and frame send times on the wire)
    speculative_disable_by_batch_size: int = 0  # no proposals while this many requests run (0: always)
    vocab_size: int | None = None  # the target's: token ids at or beyond it are refused (None: int32's range)


@dataclass(frozen=True)
class _Prompt:
    """One prompt's choices, checked and converted for the wire before admission."""

    request: GenerationRequest  # as checked: its seed drawn (or read) as the wire's 64 bits
    tokens: list[int]
    budget: int  # tokens each choice may generate: max_tokens, within the context
    choices: list[GenerationRequest]  # choice j samples with choice_seed(seed, j)
    samplings: list[pb.Sampling]


class _Connection:
    """A request's current pipeline session and its reusable frame envelope."""

    def __init__(self, pipeline, request_id: str) -> None:
        self.pipeline, self.request_id = pipeline, request_id
        self.open()

    def open(self) -> None:
        self.session = self.pipeline.open()
        self.frame = pb.Frame(session_id=self.session.session_id, request_id=self.request_id)

    async def close(self) -> None:
        await self.session.close()


class PipelineEngine:
    def __init__(self, pipeline, options: EngineOptions, *,
                 proposer_for: Callable[[GenerationRequest], Proposer | None] | None = None,
                 describe: dict | None = None, metrics: FrontendMetrics | None = None) -> None:
        self.pipeline = pipeline
        self.metrics = metrics  # where each step's time goes (proposal vs pipeline)
        self.options = options
        self.model_name = options.model_name
        self.max_context = options.max_context
        self.proposer_for = proposer_for or (lambda request: None)
        self._describe = describe or {}
        self.admission = Admission(options.max_sessions, max_waiting=options.max_waiting,
                                   timeout_s=options.queue_timeout_s)
        self.recoveries = 0  # in-flight requests carried over a lost stage
        self._ready_at = 0.0

    async def is_ready(self) -> bool:
        """Every stage SERVING. A recent yes is trusted for READY_TRUST_S: under heavy load a health
        check can be slow, and a slow answer is not a reason to turn requests away (a stage that
        really is gone fails the request itself, which also clears the trust)."""
        now = time.monotonic()
        if now - self._ready_at < READY_TRUST_S:
            return True
        ready = await self.pipeline.is_ready()
        self._ready_at = now if ready else 0.0
        return ready

    def describe(self) -> dict:
        return dict(self._describe)

    async def close(self) -> None:
        await self.pipeline.close()

    @property
    def free_slots(self) -> int:
        """Pipeline sessions free for new requests (max_sessions when nothing runs)."""
        return self.admission.free

    @property
    def running(self) -> int:
        return self.admission.running

    @property
    def waiting(self) -> int:
        return self.admission.waiting

    def generate(self, request: GenerationRequest) -> AsyncIterator[Step]:
        return single_choice(self, request)

    async def generate_n(self, request: GenerationRequest, n: int) -> list[Choice]:
        """n continuations of the prompt (engine_api.Engine.generate_n). The first choice's
        session prefills it; the others fork that session (FORK at every stage) at the prompt's
        last token, which each computes with its own seed, so that each samples exactly as a
        request alone with its seed would."""
        if n > self.options.max_sessions:
            raise InvalidRequest(f"n is {n}; this server runs at most {self.options.max_sessions} sequences at once",
                                 param="n")
        return await self.generate_batch([request], n)

    async def generate_batch(self, requests: Sequence[GenerationRequest], n: int) -> list[Choice]:
        """Every request's n choices, request i's choice j at i * n + j (engine_api.Engine.generate_batch).

        The batch's sessions are admitted together, in arrival order, once that many are free: it
        never holds some while it waits for more. A batch larger than this server's sessions can
        never run, so it is refused at once (400) rather than left waiting."""
        total = len(requests) * n
        if total > self.options.max_sessions:
            raise InvalidRequest(f"{len(requests)} prompt(s) with n={n} need {total} concurrent sequences; this server "
                                 f"runs at most {self.options.max_sessions} at once: send fewer prompts per request",
                                 param="prompt" if len(requests) > 1 else "n")
        prompts = [self._checked(request, n) for request in requests]  # before admission: a refusal holds no slot
        async with self.admission.lease(total, what=f"{len(requests)} prompt(s) with n={n}") as lease:
            started = await asyncio.gather(*(self._started(prompt, lease) for prompt in prompts),
                                           return_exceptions=True)
            failure = next((s for s in started if isinstance(s, BaseException)), None)
            if failure is not None:  # the prompts that did start give their sessions and slots back
                for choices in started:
                    if not isinstance(choices, BaseException):
                        for choice in choices:
                            await choice.aclose()
                raise failure
            return [choice for choices in started for choice in choices]

    def _checked(self, request: GenerationRequest, n: int) -> _Prompt:
        """The request's n choices, checked and converted for the wire, or InvalidRequest saying why."""
        prompt = list(request.prompt_ids)
        if not prompt:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if len(prompt) >= self.max_context:
            raise ContextLengthExceeded(
                f"the prompt has {len(prompt)} tokens; this model's context is {self.max_context} tokens"
            )
        if n < 1:
            raise InvalidRequest(f"n is {n}; it must be at least 1", param="n")
        ids_below = self.options.vocab_size or INT32_MAX + 1
        bad = next((t for t in prompt if not 0 <= t < ids_below), None)
        if bad is not None:
            raise InvalidRequest(f"prompt token id {bad} is outside [0, {ids_below})", param="prompt")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(request, name)
            if value is not None and not 0 <= value <= UINT32_MAX:
                raise InvalidRequest(f"{name} must be within [0, 2^32), got {value}", param=name)
        # The wire carries the seed as 64 unsigned bits: a negative seed is the same 64 bits read
        # unsigned (the sampler's streams depend on the seed modulo 2^63 anyway). A top_k beyond
        # int32 exceeds any vocabulary: it means no top-k restriction, as INT32_MAX does.
        seed = (request.seed if request.seed is not None else secrets.randbits(63)) % 2**64
        base = replace(request, seed=seed, top_k=min(request.top_k, INT32_MAX))
        choices = [replace(base, seed=choice_seed(seed, j)) for j in range(n)]
        problem = unsafe_field(base.sampling_params(seed), self.options.vocab_size)
        if problem is not None:
            raise InvalidRequest(problem[1], param=problem[0])
        try:
            samplings = [params.to_wire(r.sampling_params(r.seed), r.logprobs) for r in choices]
        except (ValueError, TypeError, OverflowError) as err:  # anything else the wire refuses
            raise InvalidRequest(f"the sampling parameters cannot be sent to the stages: {err}") from err
        budget = min(request.max_tokens, self.max_context - len(prompt))
        return _Prompt(base, prompt, budget, choices, samplings)

    async def _started(self, prompt: _Prompt, lease: Lease) -> list[Choice]:
        """Inside the lease: prefill the prompt once, fork it for the other choices, and hand each
        choice its slot. Anything raised here leaves the slots in the lease, which gives them back."""
        conns: list[_Connection] = []
        proposers: list[Proposer | None] = []
        try:
            conns.append(_Connection(self.pipeline, prompt.request.request_id))
            prediction, prompt_logprobs = await self._admitted_prefill(
                conns[0], prompt.tokens, prompt.samplings[0], prompt.request.prompt_logprobs is not None)
            conns += [_Connection(self.pipeline, f"{prompt.request.request_id}/{j}")
                      for j in range(1, len(prompt.choices))]
            parent = conns[0].session.session_id
            forks = await asyncio.gather(*(self._fork(conn, parent, prompt.tokens, sampling)
                                           for conn, sampling in zip(conns[1:], prompt.samplings[1:], strict=True)),
                                         return_exceptions=True)
            failure = next((f for f in forks if isinstance(f, BaseException)), None)
            if failure is not None:
                raise failure
            for request in prompt.choices:
                proposers.append(self.proposer_for(request))
        except BaseException as err:
            for proposer in proposers:
                if proposer is not None:
                    proposer.close()
            for conn in conns:
                await conn.close()
            if isinstance(err, PipelineError):
                raise self._failed(err) from err
            raise
        # Nothing below raises: every choice owns its session, proposer and slot from here on.
        choices = []
        for j, (conn, request, sampling, proposer) in enumerate(
                zip(conns, prompt.choices, prompt.samplings, proposers, strict=True)):
            steps = self._decode(conn, request, sampling, prompt.tokens, prompt.budget, proposer,
                                 prediction if j == 0 else None, prompt_logprobs)
            slot = lease.hand_over()
            choices.append(Choice(steps, lambda conn=conn, proposer=proposer, slot=slot:
                                  self._release(conn, proposer, slot)))
        return choices

    async def _release(self, conn: _Connection, proposer: Proposer | None, slot: Slot) -> None:
        """A choice is over: its pipeline session, proposer and slot are free, whatever fails on the way."""
        try:
            await conn.close()
        finally:
            try:
                if proposer is not None:
                    proposer.close()
            finally:
                slot.give_back()

    def _failed(self, err: PipelineError) -> PipelineFailed:
        self._ready_at = 0.0
        return PipelineFailed(f"generation failed in the pipeline: {err}")

    async def _decode(self, conn: _Connection, request: GenerationRequest, sampling: pb.Sampling, prompt: list[int],
                      budget: int, proposer: Proposer | None, prediction: pb.Prediction | None,
                      prompt_logprobs: list[TokenLogprob | None] | None) -> AsyncIterator[Step]:
        """Generation in a session that holds the prompt: all of it, with `prediction` (its
        prefill's), or all but its last token (a fork), which the first step computes."""
        try:
            if prediction is None:
                prediction = await self._resilient(conn, sampling, prompt[:-1],
                                                   lambda: self._step(conn, prompt, proposer))
            history = prompt + list(prediction.tokens)
            emitted = 0
            while True:
                count, stopped = _emittable(list(prediction.tokens), request, budget - emitted)
                emitted += count
                if count or prompt_logprobs is not None:
                    yield Step(list(prediction.tokens[:count]), _logprobs(prediction.logprobs[:count], request),
                               prompt_logprobs)
                    prompt_logprobs = None
                if stopped or count < len(prediction.tokens) or emitted >= budget:
                    return
                # Everything but the last token is in the stages' caches; a replacement stage
                # gets exactly that prefix again.
                prediction = await self._resilient(conn, sampling, history[:-1],
                                                   lambda: self._step(conn, history, proposer))
                history.extend(prediction.tokens)
        except PipelineError as err:
            raise self._failed(err) from err

    async def _admitted(self, conn: _Connection, operation: Callable[[], Awaitable]):
        """A session's first operation. A stage at its session limit (another frontend shares it,
        or a release is still on its way) is capacity, not failure: the request waits for room,
        as it would in this frontend's own queue, and is answered 429 only after queue_timeout_s."""
        deadline = time.monotonic() + self.options.queue_timeout_s
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

    async def _admitted_prefill(self, conn: _Connection, prompt: list[int], sampling: pb.Sampling,
                                prompt_logprobs: bool) -> tuple[pb.Prediction, list[TokenLogprob | None] | None]:
        """The first prefill (admitted and resilient)."""
        return await self._admitted(conn, lambda: self._resilient(
            conn, sampling, [], lambda: self._prefill(conn, prompt, sampling, True, prompt_logprobs)))

    async def _fork(self, conn: _Connection, parent: str, prompt: list[int], sampling: pb.Sampling) -> None:
        """conn's session starts as the parent's first len(prompt) - 1 positions at every stage,
        sampling with `sampling`. Without the parent (a stage was lost meanwhile, or the parent
        expired) the child computes those positions itself, as any recovering session does."""

        async def send() -> None:
            frame = conn.frame
            frame.kind, frame.parent_session_id = pb.FORK, parent
            frame.pos_start, frame.token_count = len(prompt) - 1, 0
            frame.sampling.CopyFrom(sampling)
            frame.seq += 1
            try:
                await conn.session.send(frame)
            finally:
                frame.parent_session_id = ""
                frame.ClearField("sampling")

        try:
            await self._admitted(conn, send)
        except PipelineError as err:
            if not err.retryable or self.options.recovery_timeout_s <= 0:
                raise
            log.warning("request %s could not fork its prompt (%s); prefilling it", conn.request_id, err)
            await self._reconnect(conn, sampling, prompt[:-1], time.monotonic() + self.options.recovery_timeout_s,
                                  err)

    async def _resilient(self, conn: _Connection, sampling: pb.Sampling, prefix: list[int], operation):
        """Run one pipeline operation; if a stage was lost, wait for it to come back (up to
        recovery_timeout_s), prefill `prefix` into a new session, and run the operation again."""
        deadline = None
        while True:
            try:
                return await operation()
            except PipelineError as err:
                if not err.retryable or self.options.recovery_timeout_s <= 0:
                    raise
                started = time.monotonic()
                deadline = deadline or started + self.options.recovery_timeout_s
                log.warning("request %s lost its pipeline session (%s); recovering", conn.request_id, err)
                await self._reconnect(conn, sampling, prefix, deadline, err)
                self.recoveries += 1
                log.info("request %s recovered in %.2fs (re-prefilled %d tokens)", conn.request_id,
                         time.monotonic() - started, len(prefix))

    async def _reconnect(self, conn: _Connection, sampling: pb.Sampling, prefix: list[int], deadline: float,
                         cause: PipelineError) -> None:
        await conn.close()
        while time.monotonic() < deadline:
            if await self.pipeline.is_ready():
                conn.open()
                try:
                    if prefix:
                        await self._prefill(conn, prefix, sampling, want_prediction=False)
                    else:  # the session's next frame is its first: it carries the sampling
                        conn.frame.sampling.CopyFrom(sampling)
                    return
                except PipelineError as err:
                    if not err.retryable:
                        raise
                    await conn.close()
            await asyncio.sleep(0.1)
        raise PipelineError(cause.code, f"the pipeline did not recover within {self.options.recovery_timeout_s:.0f}s "
                                        f"after: {cause}")

    async def _prefill(self, conn: _Connection, prompt: list[int], sampling: pb.Sampling, want_prediction: bool = True,
                       prompt_logprobs: bool = False) -> tuple[pb.Prediction | None, list[TokenLogprob | None] | None]:
        """Feed the prompt in chunks; the last chunk's prediction holds the first new token.
        With prompt_logprobs every chunk asks for its tokens' logprobs (a Prediction each)."""
        session, frame = conn.session, conn.frame
        chunk = self.options.prefill_chunk
        frame.kind = pb.PREFILL
        frame.sampling.CopyFrom(sampling)
        frame.prompt_logprobs = prompt_logprobs
        prediction = None
        scored: list[TokenLogprob | None] | None = [None] if prompt_logprobs else None  # position 0: nothing before it
        for start in range(0, len(prompt), chunk):
            piece = prompt[start : start + chunk]
            frame.pos_start = start
            frame.token_count = len(piece)
            frame.token_ids[:] = piece
            frame.want_prediction = want_prediction and (prompt_logprobs or start + chunk >= len(prompt))
            frame.seq += 1
            prediction = await session.send(frame)
            frame.ClearField("sampling")  # stages keep the parameters they saw last
            if scored is not None:
                scored.extend(_converted(prediction.prompt_logprobs))
        frame.want_prediction = frame.prompt_logprobs = False
        return prediction, scored

    def _may_speculate(self) -> bool:
        """Under load the stages already batch every session's decode step: a verify window then
        costs compute the other sessions need, and a rejected draft wastes it (vLLM's
        disable_by_batch_size). The proposer catches up on the skipped tokens when load falls."""
        limit = self.options.speculative_disable_by_batch_size
        return limit <= 0 or self.running < limit

    async def _step(self, conn: _Connection, history: list[int], proposer: Proposer | None) -> pb.Prediction:
        """One round trip: DECODE the last token, or VERIFY it with a proposal behind it."""
        session, frame = conn.session, conn.frame
        # Proposals are computed on the event loop's thread, draft models included: a second
        # computing thread would bring a second OpenMP team, and a draft step is about a millisecond.
        started = time.perf_counter()
        proposal = await proposer.propose_async(history) if proposer is not None and self._may_speculate() else None
        proposed = time.perf_counter()
        frame.pos_start = len(history) - 1
        frame.seq += 1
        if self.options.debug_telemetry:
            frame.sent_ns = time.time_ns()
        if proposal is None or not proposal.tokens:
            frame.kind = pb.DECODE
            frame.token_count = 1
            frame.token_ids[:] = history[-1:]
            frame.draft_probs = b""
            prediction = await session.send(frame)
            frame.ClearField("sampling")
            round_trip = time.perf_counter() - proposed
            if proposer is not None:
                proposer.observe(0, 0, proposed - started, round_trip)
            if self.metrics is not None:
                self.metrics.record_step("decode", None if proposer is None else proposed - started, round_trip)
            return prediction
        room = self.max_context - len(history)
        drafts = proposal.tokens[: max(0, room - 1)]
        frame.kind = pb.VERIFY
        frame.token_count = 1 + len(drafts)
        frame.token_ids[:] = history[-1:] + drafts
        frame.draft_probs = proposal.probs[: len(drafts) * (len(proposal.probs) // max(1, len(proposal.tokens)))]
        prediction = await session.send(frame)
        frame.ClearField("sampling")
        round_trip = time.perf_counter() - proposed
        proposer.observe(len(drafts), prediction.accepted, proposed - started, round_trip)
        if self.metrics is not None:
            self.metrics.record_step("verify", proposed - started, round_trip)
        if self.options.debug_telemetry:
            log.debug("request %s window %d accepted %d: proposed in %.2f ms, verified in %.2f ms", conn.request_id,
                      len(drafts), prediction.accepted, 1000 * (proposed - started), 1000 * round_trip)
        return prediction


def _emittable(tokens: list[int], request: GenerationRequest, room: int) -> tuple[int, bool]:
    """How many of a step's tokens go to the client, and whether a stop token ended generation
    (it goes too when the request asks for it)."""
    for index, token in enumerate(tokens[:room]):
        if token in request.stop_token_ids:
            return index + int(request.emit_stop_token), True
    return min(len(tokens), room), False


def _converted(entries) -> list[TokenLogprob]:
    return [TokenLogprob(e.token, e.logprob, tuple(zip(e.top_tokens, e.top_logprobs, strict=True))) for e in entries]


def _logprobs(entries, request: GenerationRequest) -> list[TokenLogprob] | None:
    return _converted(entries) if request.logprobs is not None else None
