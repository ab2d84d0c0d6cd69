"""The generation engine: turns GenerationRequests into sessions in the pipeline, each choice's
steps held to its stop rule (stopping.py: when a choice ends, and why).

A request is checked and converted for the wire, then admitted (admission.py: its slots
are held by one context manager), then, once the KV pool can hold it (kv_blocks.py), its prompt
is prefilled once, from the first position its cached prefix blocks do not cover: the other
n - 1 choices share the prompt's full blocks by reference and compute the rest, the last token
with their own seed; from there every choice is a request of its own. The frames a session
sends, and its recovery (preemption included), are session.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Generic, TypeVar

from inferencemesh.config import DEFAULT_MAX_SESSIONS, DEFAULT_RECOVERY_TIMEOUT, kv_pool_tokens
from inferencemesh.frontend.engine.admission import Admission, Lease, Slot
from inferencemesh.frontend.engine.api import (
    ChoiceStream,
    GenerationRequest,
    Step,
    TokenLogprob,
    choice_seed,
    single_choice,
)
from inferencemesh.frontend.engine.errors import ContextLengthExceeded, InvalidRequest, PipelineFailed
from inferencemesh.frontend.engine.kv_blocks import BlockManager, KvRoom
from inferencemesh.frontend.engine.metrics import FrontendMetrics
from inferencemesh.frontend.engine.proposers.base import Proposer
from inferencemesh.frontend.engine.session import Connection, Pipeline, SessionFrames, converted
from inferencemesh.frontend.engine.stopping import ChoiceStopping, StopRule
from inferencemesh.protocol import params
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol.errors import PipelineError
from inferencemesh.protocol.transport import KV_BLOCK_TOKENS, PREFILL_CHUNK_TOKENS
from inferencemesh.sampling import INT32_MAX, UINT32_MAX, unsafe_field

log = logging.getLogger("inferencemesh.engine")
READY_TRUST_S = 5.0
PipelineT = TypeVar("PipelineT", bound=Pipeline)


@dataclass(frozen=True)
class EngineOptions:
    model_name: str
    max_context: int = 2048
    max_sessions: int = DEFAULT_MAX_SESSIONS  # concurrent requests in flight (a scheduling limit)
    max_waiting: int = 256  # queued beyond that: 429
    prefill_chunk: int = PREFILL_CHUNK_TOKENS  # prompt tokens per frame (bounded message size, interleaving)
    queue_timeout_s: float = 60.0
    recovery_timeout_s: float = DEFAULT_RECOVERY_TIMEOUT  # how long an in-flight request waits for a lost stage
    debug_telemetry: bool = False  # per-window timings in the log (and frame send times on the wire)
    speculative_disable_by_batch_size: int = 0  # no proposals while this many requests run (0: always)
    vocab_size: int | None = None  # the target's: token ids at or beyond it are refused (None: int32's range)
    prefix_cache: bool = True  # computed full blocks are reused by later prompts (kv_blocks.py)
    # The stages' KV pool in blocks: config.kv_pool_tokens(...) // KV_BLOCK_TOKENS (None: its default)
    kv_blocks: int | None = None

    @property
    def pool_blocks(self) -> int:
        return self.kv_blocks or kv_pool_tokens(0, self.max_context) // KV_BLOCK_TOKENS

    @property
    def token_room(self) -> int:
        """The most positions one choice may hold: the context, or the whole pool if smaller."""
        return min(self.max_context, self.pool_blocks * KV_BLOCK_TOKENS)


@dataclass(frozen=True)
class _Prompt:
    """One prompt's choices, checked and converted for the wire before admission."""

    request: GenerationRequest  # as checked: its seed drawn (or read) as the wire's 64 bits
    tokens: list[int]
    stop_rule: StopRule  # when each choice ends: every choice has the same
    choices: list[GenerationRequest]  # choice j samples with choice_seed(seed, j)
    samplings: list[pb.Sampling]
    reproducible: bool = False  # greedy or seeded: same frame shapes every run (Proposer.reproducible)


class PipelineEngine(Generic[PipelineT]):
    """api.Engine over a Pipeline (typed as the caller's own, e.g. GrpcPipeline)."""

    def __init__(self, pipeline: PipelineT, options: EngineOptions, *,
                 proposer_for: Callable[[GenerationRequest], Proposer | None] | None = None,
                 describe: dict | None = None, metrics: FrontendMetrics | None = None) -> None:
        self.pipeline = pipeline
        self.options = options
        self.metrics = metrics
        self.model_name = options.model_name
        self.max_context = options.max_context
        self.proposer_for = proposer_for or (lambda request: None)
        self._describe = describe or {}
        self.admission = Admission(options.max_sessions, max_waiting=options.max_waiting,
                                   timeout_s=options.queue_timeout_s)
        self.room = _pool_room(pipeline, options)
        self.blocks = self.room.manager
        if metrics is not None:
            metrics.watch_kv_usage(lambda: self.blocks.usage)
        self.frames = SessionFrames(pipeline, self.room, max_context=options.token_room,
                                    prefill_chunk=options.prefill_chunk,
                                    queue_timeout_s=options.queue_timeout_s,
                                    recovery_timeout_s=options.recovery_timeout_s,
                                    debug_telemetry=options.debug_telemetry, metrics=metrics,
                                    may_speculate=self._may_speculate)
        self._ready_at = 0.0
        self._pool_checked = False  # the stages' StageInfo.kv_blocks read (the smallest pool is used)

    @property
    def recoveries(self) -> int:
        """In-flight sessions carried over a lost stage."""
        return self.frames.recoveries

    async def is_ready(self) -> bool:
        """Every stage SERVING. A recent yes is trusted for READY_TRUST_S: under heavy load a health
        check can be slow, and a slow answer is not a reason to turn requests away (a stage that
        really is gone fails the request itself, which also clears the trust)."""
        now = time.monotonic()
        if now - self._ready_at < READY_TRUST_S:
            return True
        ready = await self.pipeline.is_ready()
        self._ready_at = now if ready else 0.0
        infos = getattr(self.pipeline, "infos", None)
        if ready and infos is not None and not self._pool_checked:  # the stages' pools, once
            with contextlib.suppress(Exception):  # an Info that fails is asked again next time
                self.blocks.shrink(min(info.kv_blocks for info in await infos()))
                self._pool_checked = True
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
        """Requests waiting for a slot, and sessions waiting for KV blocks (preempted ones too)."""
        return self.admission.waiting + self.room.waiting

    def generate(self, request: GenerationRequest) -> AsyncIterator[Step]:
        return single_choice(self, request)

    async def generate_n(self, request: GenerationRequest, n: int) -> list[ChoiceStream]:
        """n continuations of the prompt (api.Engine.generate_n). The first choice's
        session prefills it; the others share its full blocks and compute the rest, the prompt's
        last token with their own seed, so that each samples exactly as a request alone with its
        seed would."""
        if n > self.options.max_sessions:
            raise InvalidRequest(f"n is {n}; this server runs at most {self.options.max_sessions} sequences at once",
                                 param="n")
        return await self.generate_batch([request], n)

    async def generate_batch(self, requests: Sequence[GenerationRequest], n: int) -> list[ChoiceStream]:
        """Every request's n choices, request i's choice j at i * n + j (api.Engine.generate_batch).

        The batch's sessions are admitted together, in arrival order, once that many are free: it
        never holds some while it waits for more. A batch larger than this server's sessions can
        never run, so it is refused at once (400) rather than left waiting."""
        total = len(requests) * n
        if total > self.options.max_sessions:
            raise InvalidRequest(f"{len(requests)} prompt(s) with n={n} need {total} concurrent sequences; this server "
                                 f"runs at most {self.options.max_sessions} at once: send fewer prompts per request",
                                 param="prompt" if len(requests) > 1 else "n")
        # checked before admission: a refusal holds no slot
        room = min(self.options.token_room, self.blocks.num_blocks * self.blocks.block_tokens)
        prompts = [_checked(request, n, self.options, room) for request in requests]
        async with self.admission.lease(total, what=f"{len(requests)} prompt(s) with n={n}") as lease:
            starts = [asyncio.ensure_future(self._started(prompt, lease)) for prompt in prompts]
            try:
                started = await asyncio.gather(*starts, return_exceptions=True)
            except BaseException:
                # Cancelled, perhaps in the loop iteration the choices got their slots: nothing
                # else holds them. Shielded: a second cancel must not cut this short.
                await asyncio.shield(_close_started(starts))
                raise
            failure = next((s for s in started if isinstance(s, BaseException)), None)
            if failure is not None:  # the prompts that did start give their sessions and slots back
                await _close_started(starts)
                raise failure
            return [choice for choices in started if not isinstance(choices, BaseException) for choice in choices]

    async def _started(self, prompt: _Prompt, lease: Lease) -> list[ChoiceStream]:
        """Inside the lease: prefill the prompt once (from its cached prefix), share its blocks
        with the other choices, and hand each choice its slot. Anything raised here leaves the
        slots in the lease, which gives them back."""
        conns: list[Connection] = []
        proposers: list[Proposer | None] = []
        try:
            conns.append(self._connection(prompt.request.request_id, prompt.choices[0]))
            wants_prompt_logprobs = prompt.request.prompt_logprobs is not None  # computed, never reused
            reuse = self.options.prefix_cache and not wants_prompt_logprobs
            prediction, prompt_logprobs, reused = await self.frames.first_prefill(
                conns[0], prompt.tokens, prompt.samplings[0], wants_prompt_logprobs, reuse)
            if reuse and self.metrics is not None:
                self.metrics.record_prefix_cache(len(prompt.tokens), reused)
            conns += [self._connection(f"{prompt.request.request_id}/{j}", prompt.choices[j])
                      for j in range(1, len(prompt.choices))]
            shares = await asyncio.gather(*(self.frames.share_prompt(conn, conns[0], prompt.tokens, sampling)
                                            for conn, sampling in zip(conns[1:], prompt.samplings[1:], strict=True)),
                                          return_exceptions=True)
            failure = next((f for f in shares if isinstance(f, BaseException)), None)
            if failure is not None:
                raise failure
            for conn, request in zip(conns, prompt.choices, strict=True):
                proposers.append(self.proposer_for(request))
                if proposers[-1] is not None:
                    proposers[-1].grammar = conn.grammar  # its proposals follow the choice's grammar
                    if prompt.reproducible:
                        proposers[-1].reproducible()
        except BaseException as err:
            for proposer in proposers:
                if proposer is not None:
                    proposer.close()
            for conn in conns:
                await conn.close()
            self._record_pool()
            if isinstance(err, PipelineError):
                raise self._failed(err) from err
            raise
        self._record_pool()
        # Nothing below raises: every choice owns its session, proposer and slot from here on.
        choices = []
        for j, (conn, request, sampling, proposer) in enumerate(
                zip(conns, prompt.choices, prompt.samplings, proposers, strict=True)):
            steps = self._decode(conn, request, sampling, prompt.tokens, prompt.stop_rule, proposer,
                                 prediction if j == 0 else None, prompt_logprobs, reused if j == 0 else 0)
            slot = lease.hand_over()
            choices.append(ChoiceStream(steps, partial(self._release, conn, proposer, slot)))
        return choices

    def _connection(self, request_id: str, choice: GenerationRequest) -> Connection:
        """A choice's connection, with its own grammar when the request constrains its output."""
        conn = Connection(self.pipeline, request_id, self.room)
        conn.table.indexed = self.options.prefix_cache  # the pool may be another engine's too (_pool_room)
        conn.grammar = choice.constrained.start() if choice.constrained is not None else None
        return conn

    def _record_pool(self) -> None:
        if self.metrics is not None:
            stats = self.blocks.stats
            self.metrics.record_kv_pool(stats.preemptions, stats.evictions)

    async def _release(self, conn: Connection, proposer: Proposer | None, slot: Slot) -> None:
        """A choice is over: its pipeline session, blocks (cached by hash where computed),
        proposer and slot are free, whatever fails on the way."""
        try:
            await conn.close()
        finally:
            try:
                self._record_pool()
                if proposer is not None:
                    proposer.close()
            finally:
                slot.give_back()

    def _failed(self, err: PipelineError) -> PipelineFailed:
        self._ready_at = 0.0
        self._pool_checked = False  # a stage may have restarted with another pool
        return PipelineFailed(f"generation failed in the pipeline: {err}")

    def _may_speculate(self) -> bool:
        """Under load the stages already batch every session's decode step: a verify window then
        costs compute the other sessions need, and a rejected draft wastes it (vLLM's
        disable_by_batch_size). The proposer catches up on the skipped tokens when load falls."""
        limit = self.options.speculative_disable_by_batch_size
        return limit <= 0 or self.running < limit

    async def _decode(self, conn: Connection, request: GenerationRequest, sampling: pb.Sampling, prompt: list[int],
                      stop_rule: StopRule, proposer: Proposer | None, prediction: pb.Prediction | None,
                      prompt_logprobs: list[TokenLogprob | None] | None, cached: int = 0) -> AsyncIterator[Step]:
        """Generation in a session that holds the prompt: all of it, with `prediction` (its
        prefill's), or all but its last token (choices 2..n), which the first step computes.

        Each step's tokens pass through the choice's ChoiceStopping (stopping.py), which says how
        many are yielded and, on the last Step, why the choice ended. Its first Step carries
        `cached`, the prompt tokens its prefill took from the prefix cache (usage's cached_tokens)."""
        try:
            if prediction is None:
                prediction = await self.frames.step(conn, sampling, prompt, proposer)
            history = prompt + list(prediction.tokens)
            stopping = ChoiceStopping(stop_rule)
            while True:
                if conn.grammar is not None:  # the grammar advances by decided tokens only
                    await conn.grammar.commit_async(stopping.decided(prediction.tokens))
                cut = stopping.cut(prediction.tokens)
                if cut.count or prompt_logprobs is not None or cut.finish_reason is not None:
                    yield Step(list(prediction.tokens[:cut.count]), _logprobs(prediction.logprobs[:cut.count], request),
                               prompt_logprobs, finish_reason=cut.finish_reason, cached_tokens=cached)
                    prompt_logprobs, cached = None, 0
                if cut.finish_reason is not None:
                    return
                # Everything but the last token is in the stages' caches; a replacement stage
                # gets exactly that prefix again.
                prediction = await self.frames.step(conn, sampling, history, proposer)
                history.extend(prediction.tokens)
        except PipelineError as err:
            raise self._failed(err) from err


def _pool_room(pipeline: Pipeline, options: EngineOptions) -> KvRoom:
    """The pipeline's KV room. The stages' pools belong to the pipeline's stream, so every engine
    over one pipeline (a benchmark runs several) must give out the same blocks: the first engine
    makes the room, sized and salted (by the model) by its options, and the pipeline keeps it."""
    room: KvRoom | None = getattr(pipeline, "kv_room", None)
    if room is None:
        # Every engine decides for its own sessions whether they match and publish blocks (their
        # tables' `indexed`): the room's index is there for those that do.
        room = KvRoom(BlockManager(options.pool_blocks, salt=options.model_name.encode()))
        listeners = getattr(pipeline, "new_stream_listeners", None)  # a new stream: every pool is empty
        if listeners is not None:
            listeners.append(room.manager.forget_all)
        with contextlib.suppress(AttributeError):  # a pipeline that cannot keep it (a test's) has one engine
            pipeline.kv_room = room  # type: ignore[attr-defined]
    return room


def _checked(request: GenerationRequest, n: int, options: EngineOptions, room: int) -> _Prompt:
    """The request's n choices, checked and converted for the wire (for a model of
    options.max_context tokens and options.vocab_size, and a KV pool of `room` positions), or
    InvalidRequest saying why."""
    prompt = list(request.prompt_ids)
    if not prompt:
        raise InvalidRequest("the prompt is empty", param="prompt")
    if len(prompt) >= options.max_context:
        raise ContextLengthExceeded(
            f"the prompt has {len(prompt)} tokens; this model's context is {options.max_context} tokens"
        )
    if len(prompt) >= room:  # the prompt and one token decided after it
        raise InvalidRequest(f"the prompt has {len(prompt)} tokens; this server's KV pool holds "
                             f"{room} positions in all", param="prompt")
    if n < 1:
        raise InvalidRequest(f"n is {n}; it must be at least 1", param="n")
    if request.max_tokens < 0:
        raise InvalidRequest(f"max_tokens is {request.max_tokens}; it must be at least 0", param="max_tokens")
    ids_below = options.vocab_size or INT32_MAX + 1
    bad = next((t for t in prompt if not 0 <= t < ids_below), None)
    if bad is not None:
        raise InvalidRequest(f"prompt token id {bad} is outside [0, {ids_below})", param="prompt")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(request, name)
        if value is not None and not 0 <= value <= UINT32_MAX:
            raise InvalidRequest(f"{name} must be within [0, 2^32), got {value}", param=name)
    # The wire carries the seed as 64 unsigned bits: a negative seed is the same 64 bits read
    # unsigned (the sampler's streams depend on the seed modulo 2^63 anyway). A top_k beyond
    # int32 exceeds any vocabulary: it means no top-k restriction, as INT32_MAX does; so does a
    # negative one (vLLM's -1), as 0 does on the wire.
    seed = (request.seed if request.seed is not None else secrets.randbits(63)) % 2**64
    base = replace(request, seed=seed, top_k=min(max(request.top_k, 0), INT32_MAX))
    choices = [replace(base, seed=choice_seed(seed, j)) for j in range(n)]
    problem = unsafe_field(base.sampling_params(seed), options.vocab_size)
    if problem is not None:
        raise InvalidRequest(problem[1], param=problem[0])
    try:
        samplings = [params.to_wire(r.sampling_params(seed if r.seed is None else r.seed), r.logprobs)
                     for r in choices]
    except (ValueError, TypeError, OverflowError) as err:  # anything else the wire refuses
        raise InvalidRequest(f"the sampling parameters cannot be sent to the stages: {err}") from err
    return _Prompt(base, prompt, StopRule.of(base, room), choices, samplings,
                   reproducible=request.seed is not None or base.sampling_params(seed).greedy)


async def _close_started(starts: Sequence[asyncio.Future[list[ChoiceStream]]]) -> None:
    """The prompts' starts ended (those still running cancelled: they free their own sessions and
    slots), and the choices of those that did start closed (theirs freed)."""
    for start in starts:
        start.cancel()
    for started in await asyncio.gather(*starts, return_exceptions=True):
        if not isinstance(started, BaseException):
            for choice in started:
                await choice.aclose()


def _logprobs(entries: Iterable[pb.TokenLogprobs], request: GenerationRequest) -> list[TokenLogprob] | None:
    return converted(entries) if request.logprobs is not None else None
