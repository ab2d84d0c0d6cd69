"""The OpenAI-compatible HTTP layer: requests in, token ids to the engine, text out.

    create_app(engine, tokenizer, served_model_name=...) -> FastAPI

Routes: GET /v1/models[/{id}], POST /v1/completions, POST /v1/chat/completions (JSON or SSE),
GET /health (liveness), GET /ready (engine ready), GET /metrics (Prometheus), and vLLM's
POST /tokenize, POST /detokenize, GET /version (utility_routes.py).
Every error, including FastAPI's own validation errors, is answered in OpenAI's error JSON.
The engine owns generation; this module owns tokenization, limits, stop strings and metrics.
The caller owns the engine's lifecycle (create_app never closes it).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from transformers import PreTrainedTokenizerBase

from inferencemesh.frontend.detokenize import OutputText
from inferencemesh.frontend.engine_api import Engine, EngineError, GenerationRequest, Step, TokenLogprob
from inferencemesh.frontend.errors import APIError
from inferencemesh.frontend.logprobs import LogprobsFormatter
from inferencemesh.frontend.metrics import FrontendMetrics, RequestTracker
from inferencemesh.frontend.openai_models import ChatCompletionRequest, CompletionRequest, wire_seed
from inferencemesh.frontend.prompts import chat_ids, text_ids
from inferencemesh.frontend.responses import (
    COMMON_ERRORS,
    GENERATION_ERRORS,
    ChatCompletion,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    openapi_document,
    streamed,
)
from inferencemesh.frontend.utility_routes import router as utility_router

log = logging.getLogger("inferencemesh.frontend")

RETRY_AFTER_S = 1  # the Retry-After of a 429: queues drain in about a request's time
BODY_TIMEOUT_S = 30.0  # the longest wait for the next piece of a request body: then 408, connection closed
# While a stream waits on the pipeline (a stalled stage: 40-70 s seen), an SSE comment every few
# seconds keeps proxies with a read timeout (commonly 60 s) from cutting it; clients ignore comments.
SSE_KEEPALIVE_S = 5.0
KEEPALIVE_COMMENT = ": keep-alive\n\n"
GREEDY_BELOW_TEMPERATURE = 1e-5  # vLLM's epsilon
# End-of-turn markers of common chat templates: generation stops on them as on EOS.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


def _from_engine_error(exc: EngineError) -> APIError:
    return APIError(exc.status_code, str(exc) or type(exc).__name__, type=exc.error_type, code=exc.code,
                    param=exc.param)


def _as_api_error(exc: Exception) -> APIError:
    """Any failure during generation, as an OpenAI error (unexpected ones are logged, not described)."""
    if isinstance(exc, EngineError):
        return _from_engine_error(exc)
    log.error("generation failed", exc_info=exc)
    return APIError(500, "Generation failed inside the server.", type="server_error")


# pydantic names the branch of a union in an error's location ("function-after[...]", "list[...]",
# "str"): not a field a client can find in its request.
_UNION_BRANCH = re.compile(r"[\w-]+\[.*\]|str|int|float|bool|list|dict|none")


def invalid_body(errors: Sequence[Any]) -> APIError:
    """FastAPI's validation errors as OpenAI's 400 invalid_request_error (not FastAPI's 422),
    naming the field. A value that fits no branch of a union fails every branch: a branch whose
    type matched ("must be a finite number") says more than the others ("should be a string")."""
    def path(error: Any) -> str:
        return ".".join(str(p) for p in error["loc"][1:] if not (isinstance(p, str) and _UNION_BRANCH.fullmatch(p)))

    ranked = sorted(errors, key=lambda e: str(e["type"]).endswith("_type"))  # stable: type mismatches last
    details = list(dict.fromkeys(f"{path(e) or 'body'}: {e['msg']}" for e in ranked))
    param = path(ranked[0]) if ranked and ranked[0]["type"] != "json_invalid" else None
    return APIError(400, f"Invalid request body: {'; '.join(details[:5])}", param=param or None)


def _log_server_error(err: APIError, request_id: str | None = None) -> None:
    """Every 5xx leaves a line in the log: an operator must be able to see what failed."""
    if err.status >= 500:
        log.warning("answered %d %s%s: %s", err.status, err.code or err.type,
                    f" to {request_id}" if request_id else "", err.message)


# --- request guard: API key and body size, before any parsing ---------------------------------


class _Guard:
    """Pure ASGI middleware: 401 without the API key, 413 for oversized bodies.

    The body is read here, bounded, and replayed to the app: Content-Length can be absent
    (chunked) or wrong, so the bytes actually received are what is counted.
    """

    def __init__(self, app: ASGIApp, *, api_key: str | None, exempt: tuple[str, ...], max_body_bytes: int,
                 body_timeout_s: float, reject: Callable[[APIError], Response]) -> None:
        self.app, self.api_key, self.exempt, self.max_body_bytes = app, api_key, exempt, max_body_bytes
        self.body_timeout_s, self.reject = body_timeout_s, reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["arrival"] = time.perf_counter()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"] not in self.exempt and not self._authorized(headers):
            err = APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")
            response = self.reject(err)
            response.headers["WWW-Authenticate"] = "Bearer"
            return await response(scope, receive, send)
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            return await self._too_large(scope, receive, send)
        chunks, size = [], 0
        while True:
            try:
                async with asyncio.timeout(self.body_timeout_s):  # a body that stops arriving holds a task
                    message = await receive()
            except TimeoutError:
                return await self._refuse(scope, receive, send, APIError(
                    408, f"The request body did not arrive within {self.body_timeout_s:g} s.", code="request_timeout"))
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return await self._too_large(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # afterwards: the real channel, which reports disconnects

        await self.app(scope, replay, send)

    def _authorized(self, headers: dict[str, str]) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        assert self.api_key is not None
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._refuse(scope, receive, send, APIError(
            413, f"Request body exceeds the limit of {self.max_body_bytes} bytes.", code="request_too_large"))

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, err: APIError) -> None:
        response = self.reject(err)
        response.headers["Connection"] = "close"  # the unread rest of the body is not drained
        await response(scope, receive, send)


# --- server-sent events that always release the engine ----------------------------------------


class _EventStream(StreamingResponse):
    """SSE response that watches for the client going away while it waits on the engine, and
    always closes its body iterator (which closes the engine's iterator: the session is freed)."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = self.body_iterator
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client is gone; the finally below cleans up
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            if hasattr(body, "aclose"):
                with anyio.CancelScope(shield=True):
                    await body.aclose()


async def _with_keepalive(source: AsyncIterator[str], interval_s: float) -> AsyncIterator[str]:
    """source's items, with a keep-alive comment whenever none came for interval_s. The pending
    item is awaited across comments (never cancelled, which would lose it), and source is closed."""
    pending: asyncio.Future[str] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield KEEPALIVE_COMMENT
                continue
            item, pending = pending, None
            try:
                yield item.result()
            except StopAsyncIteration:
                return
    finally:
        # Shielded: when the client goes away this runs inside a cancelled scope, which would
        # cancel these awaits too and leave source (and the sessions its choices hold) open.
        with anyio.CancelScope(shield=True):
            if pending is not None:
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
            await source.aclose()


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def _close(iterator: AsyncIterator[list[int]]) -> None:
    """Close the engine iterator even from a cancelled task: this is what releases the session."""
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            try:
                await aclose()
            except Exception:
                log.exception("closing the engine iterator failed")


async def _until_disconnect(request: Request, work: Callable[[], Awaitable[Any]]) -> tuple[bool, Any]:
    """Run work; cancel it if the client disconnects first. Returns (completed, result)."""
    result: Any = None
    error: BaseException | None = None
    completed = False
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            nonlocal result, completed, error
            try:
                result = await work()
                completed = True
            except Exception as exc:  # re-raised below, unwrapped from the task group
                error = exc
            tg.cancel_scope.cancel()

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(run)
        tg.start_soon(watch)
    if error is not None:
        raise error
    return completed, result


# --- one generation ---------------------------------------------------------------------------


@dataclass
class _Job:
    """A validated request, ready for the engine."""

    kind: str  # "chat" | "completion"
    id: str
    created: int
    model: str
    prompt_ids: list[int]
    request: GenerationRequest
    stops: list[str]
    stream: bool
    include_usage: bool
    arrival: float  # time.perf_counter() when the request arrived
    echo_text: str = ""
    top_logprobs: int = 0  # alternatives per token when job.request.logprobs is set
    index: int = 0  # the choice's index in the response (prompt index * n + j)
    # Set as generation goes:
    text_offset: int = 0  # completions logprobs: where the choice's text so far ends
    finish_reason: str = "length"
    completion_tokens: int = 0


@dataclass
class _Piece:
    """One engine step as the client sees it: new text, and the logprobs of its tokens."""

    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob] | None


@dataclass
class _Run:
    """One choice being generated: its own job (index, finish reason, counts), the engine's
    iterator, the first step, and its metrics."""

    job: _Job
    iterator: AsyncIterator[Step]
    first: Step | None
    tracker: RequestTracker
    counts_prompt: bool  # the first choice of its prompt: the prompt's tokens count once


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _runs_usage(runs: list[_Run]) -> dict[str, int]:
    """usage of a response: each prompt once, every choice's completion tokens."""
    return _usage(sum(len(run.job.prompt_ids) for run in runs if run.counts_prompt),
                  sum(run.job.completion_tokens for run in runs))


async def _first_step(iterator: AsyncIterator[Step]) -> Step | None:
    try:
        return await iterator.__anext__()
    except StopAsyncIteration:
        return None


_EXHAUSTED = object()


async def _merged(sources: list[AsyncIterator[str]]) -> AsyncIterator[str]:
    """The items of several iterators as they come, each one's in its own order; the first
    failure is raised and the others stopped (and closed)."""
    if len(sources) == 1:
        try:
            async for item in sources[0]:
                yield item
        finally:
            await sources[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(sources))  # a slow client holds the producers back

    async def pump(source: AsyncIterator[str]) -> None:
        try:
            async for item in source:
                await queue.put((item, None))
            await queue.put((_EXHAUSTED, None))
        except Exception as exc:
            await queue.put((None, exc))

    tasks = [asyncio.ensure_future(pump(source)) for source in sources]
    try:
        remaining = len(tasks)
        while remaining:
            item, failure = await queue.get()
            if failure is not None:
                raise failure
            if item is _EXHAUSTED:
                remaining -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for source in sources:
            await source.aclose()


class _Frontend:
    def __init__(self, engine: Engine, tokenizer: PreTrainedTokenizerBase, model: str,
                 metrics: FrontendMetrics, sse_keepalive_s: float = SSE_KEEPALIVE_S) -> None:
        self.engine, self.tokenizer, self.model, self.metrics = engine, tokenizer, model, metrics
        self.sse_keepalive_s = sse_keepalive_s
        self.created = int(time.time())
        self.vocab_size = len(tokenizer)
        vocab = tokenizer.get_vocab()
        stop_ids = {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
        eos = tokenizer.eos_token_id
        stop_ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.stop_token_ids = frozenset(stop_ids)
        self.logprobs = LogprobsFormatter(tokenizer)

    def _count_error(self, err: APIError, request_id: str | None = None) -> None:
        """Every request answered with an error, once: as a JSON error, or in-band in a stream."""
        self.metrics.request_errors.labels(self.model, str(err.status)).inc()
        _log_server_error(err, request_id)

    def error_response(self, err: APIError) -> JSONResponse:
        self._count_error(err)
        # Overload is temporary: tell clients (the openai client honours it) when to come back.
        headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status == 429 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    # --- validation and tokenization ---

    async def prepare(self, body: ChatCompletionRequest | CompletionRequest, arrival: float,
                      prompt: str | list[int] | None = None) -> _Job:
        """The job of a request (of one of its prompts: a completions batch has a job each)."""
        if body.model != self.model:
            raise APIError(404, f"The model `{body.model}` does not exist. This server serves `{self.model}`.",
                           param="model", code="model_not_found")
        refused = body.unsupported()
        if refused is not None:
            raise APIError(400, refused[1], param=refused[0], code="unsupported_parameter")
        if not await self._ready():
            raise APIError(503, "The model is not ready yet.", type="service_unavailable", code="not_ready")

        if isinstance(body, ChatCompletionRequest):
            kind, prefix, max_tokens, param = "chat", "chatcmpl-", body.requested_max_tokens(), "messages"
        else:
            kind, prefix, max_tokens, param = "completion", "cmpl-", body.max_tokens, "prompt"
        prompt_ids, echo_text = await self._prompt(body, prompt)
        if not prompt_ids:
            if self.tokenizer.bos_token_id is None:
                raise APIError(400, "The prompt is empty.", param=param)
            prompt_ids = [self.tokenizer.bos_token_id]

        limit, n = self.engine.max_context, len(prompt_ids)
        if max_tokens is None:
            max_tokens = limit - n  # not set: as many as fit
        scoring = max_tokens == 0 and body.max_tokens == 0  # asked for (echo + logprobs): the prompt only
        if (max_tokens < 1 and not scoring) or n + max_tokens > limit:
            asked = f"{n} prompt tokens" + (f" + {max_tokens} max_tokens" if n < limit else "")
            raise APIError(400, f"This model's maximum context length is {limit} tokens; the request has {asked}.",
                           param=param, code="context_length_exceeded")

        top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
        temperature = 1.0 if body.temperature is None else body.temperature
        top_p = 1.0 if body.top_p is None else body.top_p
        if temperature < GREEDY_BELOW_TEMPERATURE or top_p == 0.0:
            # logits / 1e-300 overflow to inf: this close to 0 means greedy; so does top_p 0 (no
            # probability mass: only the most likely token), which the wire would read as "off"
            temperature, top_p = 0.0, 1.0
        if body.min_tokens and max_tokens < body.min_tokens:
            raise APIError(400, f"min_tokens ({body.min_tokens}) exceeds max_tokens ({max_tokens}).",
                           param="min_tokens")
        request_id = prefix + uuid.uuid4().hex
        if isinstance(body, ChatCompletionRequest):
            top, prompt_logprobs = body.top_logprobs, None
            logprobs = (top or 0) if body.logprobs else None
        else:
            logprobs, top = body.logprobs, body.logprobs
            prompt_logprobs = logprobs if body.echo else None
        gen = GenerationRequest(
            request_id=request_id, prompt_ids=prompt_ids, max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p, top_k=top_k, seed=None if body.seed is None else wire_seed(body.seed),
            stop_token_ids=self._stop_token_ids(body),
            emit_stop_token=bool(body.include_stop_str_in_output),
            presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0, logit_bias=self._logit_bias(body),
            min_tokens=body.min_tokens or 0, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        )
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _Job(kind, request_id, int(time.time()), self.model, prompt_ids, gen, body.stop_strings(),
                    bool(body.stream), include_usage, arrival, echo_text, top_logprobs=top or 0)

    def _stop_token_ids(self, body: ChatCompletionRequest | CompletionRequest) -> frozenset[int]:
        """EOS and end-of-turn tokens (unless ignore_eos, as vLLM does), plus the request's own."""
        own = body.stop_token_ids or []
        bad = next((t for t in own if t >= self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"stop_token_ids: {bad} is outside the vocabulary (size {self.vocab_size}).",
                           param="stop_token_ids")
        return (frozenset() if body.ignore_eos else self.stop_token_ids) | frozenset(own)

    def _logit_bias(self, body: ChatCompletionRequest | CompletionRequest) -> tuple[tuple[int, float], ...]:
        try:
            return body.logit_bias_pairs(self.vocab_size)
        except ValueError as err:
            raise APIError(400, str(err), param="logit_bias") from err

    async def _ready(self) -> bool:
        # The engine decides how long a "ready" is trusted (one place caches it).
        try:
            return bool(await self.engine.is_ready())
        except Exception:
            log.exception("engine.is_ready() failed")
            return False

    async def _prompt(self, body: ChatCompletionRequest | CompletionRequest,
                      prompt: str | list[int] | None) -> tuple[list[int], str]:
        """The prompt's token ids, and the text to echo (completions with echo=true)."""
        if isinstance(body, ChatCompletionRequest):
            return await asyncio.to_thread(self._chat_ids, body), ""  # off the event loop: prompts can be long
        prompt = body.prompts()[0] if prompt is None else prompt
        if isinstance(prompt, str):
            special = body.add_special_tokens is not False
            return await asyncio.to_thread(self._text_ids, prompt, special), prompt if body.echo else ""
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"Token id {bad} is outside the vocabulary (size {self.vocab_size}).", param="prompt")
        return list(prompt), self.tokenizer.decode(prompt) if body.echo else ""

    def _text_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return text_ids(self.tokenizer, text, add_special_tokens=add_special_tokens)

    def _chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        return chat_ids(self.tokenizer, body.template_messages())

    # --- running the engine ---

    async def start_all(self, jobs: list[_Job], n: int) -> list[_Run]:
        """Every prompt's n choices, admitted together by the engine (it queues the batch until
        that many sessions are free, or refuses it at once), and each choice's first step, so that
        errors at admission (overloaded, not ready, context) still get their HTTP status. Choice j
        of prompt i gets index i * n + j; a prompt's tokens count once, in its choice 0's metrics."""
        slots = [(job, j) for job in jobs for j in range(n)]
        trackers = [self.metrics.track_request(job.arrival, len(job.prompt_ids) if j == 0 else 0) for job, j in slots]
        iterators: list[AsyncIterator[Step]] = []
        try:
            if len(slots) == 1:
                iterators = [self.engine.generate(jobs[0].request)]
            else:
                iterators = list(await self.engine.generate_batch([job.request for job in jobs], n))
            firsts = await asyncio.gather(*(_first_step(it) for it in iterators), return_exceptions=True)
            failure = next((f for f in firsts if isinstance(f, BaseException)), None)
            if failure is not None:
                raise failure
        except BaseException as exc:
            for tracker in trackers:
                tracker.finish("error" if isinstance(exc, EngineError) else "abort")
            for it in iterators:
                await _close(it)
            if isinstance(exc, EngineError):
                raise _from_engine_error(exc) from exc
            raise
        return [_Run(replace(job, index=job.index * n + j), it, first, tracker, j == 0)
                for (job, j), it, first, tracker in zip(slots, iterators, firsts, trackers, strict=True)]

    async def close(self, runs: list[_Run]) -> None:
        """Release every choice's session (a no-op for those done already)."""
        for run in runs:
            await _close(run.iterator)
            run.tracker.finish("abort")  # no-op when already finished

    async def steps(self, job: _Job, iterator: AsyncIterator[Step], first: Step | None,
                    tracker: RequestTracker, text: OutputText) -> AsyncIterator[_Piece]:
        """The pieces of one generation; sets job.finish_reason and job.completion_tokens at the end."""
        budget = job.request.max_tokens
        count = 0
        step = first
        engine_reason: str | None = None
        while step is not None:
            engine_reason = step.finish_reason or engine_reason
            ids = list(step[: budget - count])  # a speculative step may overshoot the budget
            logprobs = step.logprobs[: len(ids)] if step.logprobs is not None else None
            if ids:
                count += len(ids)
                tracker.on_tokens(len(ids))
                delta = text.add_tokens(ids)
                if delta or logprobs:
                    yield _Piece(delta, ids, logprobs)
            if text.stopped or count >= budget:
                break
            try:
                step = await iterator.__anext__()
            except StopAsyncIteration:
                step = None
        if not text.stopped:
            tail = text.finish()
            if tail:
                yield _Piece(tail, [], None)
        job.completion_tokens = count
        # The engine says why a choice ended (a stop token, or its length); a stop string is
        # found here, in the text, and is a "stop" too.
        job.finish_reason = "stop" if text.stopped else engine_reason or "length"

    def _output_text(self, job: _Job) -> OutputText:
        return OutputText(self.tokenizer, job.prompt_ids, job.stops, min_tokens=job.request.min_tokens,
                          include_stop=job.request.emit_stop_token)

    def _choice_logprobs(self, job: _Job, tokens: list[int], entries: list[TokenLogprob | None] | None,
                         ) -> dict[str, Any] | None:
        """The choice's `logprobs` for these tokens (None when the request asked for none)."""
        if entries is None:
            return None
        if job.kind == "chat":
            return {"content": self.logprobs.chat(entries, job.top_logprobs), "refusal": None}
        out, job.text_offset = self.logprobs.completion(tokens, entries, job.top_logprobs, job.text_offset)
        return out

    # --- responses ---

    def _chunk(self, job: _Job, choice: dict[str, Any] | None, usage: dict[str, int] | None = None) -> str:
        obj: dict[str, Any] = {
            "id": job.id, "object": "chat.completion.chunk" if job.kind == "chat" else "text_completion",
            "created": job.created, "model": job.model, "choices": [] if choice is None else [choice],
        }
        if usage is not None:
            obj["usage"] = usage
        return _sse(obj)

    def _delta_choice(self, job: _Job, text: str | None, finish: str | None, role: bool = False,
                      logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if job.kind == "completion":
            return {"index": job.index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        return {"index": job.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def _echo(self, job: _Job, first: Step | None) -> tuple[str, dict[str, Any] | None]:
        """Completions with echo: the prompt's text and, with logprobs, the prompt's logprobs."""
        prompt_logprobs = first.prompt_logprobs if first is not None else None
        if job.request.prompt_logprobs is None or prompt_logprobs is None:
            return job.echo_text, None
        return job.echo_text, self._choice_logprobs(job, job.prompt_ids, prompt_logprobs)

    async def stream(self, runs: list[_Run]) -> AsyncIterator[str]:
        """The SSE body: every choice's chunks as they come (each carries its index), then usage
        (when asked) and [DONE]. A failure is reported in-band: the headers are sent already."""
        first = runs[0].job
        merged = _merged([self._choice_chunks(run) for run in runs])
        try:
            try:
                async for chunk in merged:
                    yield chunk
            except Exception as exc:  # headers are sent: report in-band, as OpenAI does
                err = _as_api_error(exc)
                self._count_error(err, first.id)
                yield _sse(err.body())
                yield "data: [DONE]\n\n"
                return
            if first.include_usage:
                yield self._chunk(first, None, _runs_usage(runs))
            yield "data: [DONE]\n\n"
        finally:
            await merged.aclose()
            await self.close(runs)

    async def _choice_chunks(self, run: _Run) -> AsyncIterator[str]:
        job = run.job
        text = self._output_text(job)
        if job.kind == "chat":
            yield self._chunk(job, self._delta_choice(job, "", None, role=True))
        elif job.echo_text:
            echo, echo_logprobs = self._echo(job, run.first)
            yield self._chunk(job, self._delta_choice(job, echo, None, logprobs=echo_logprobs))
        try:
            async for piece in self.steps(job, run.iterator, run.first, run.tracker, text):
                logprobs = self._choice_logprobs(job, piece.tokens, piece.logprobs)
                yield self._chunk(job, self._delta_choice(job, piece.text, None, logprobs=logprobs))
        except Exception:
            run.tracker.finish("error")
            raise
        yield self._chunk(job, self._delta_choice(job, None if job.kind == "chat" else "", job.finish_reason))
        run.tracker.finish(job.finish_reason)

    async def complete(self, runs: list[_Run]) -> dict[str, Any]:
        """The whole response: the choices generated concurrently; the first failure fails it
        (the others are cancelled; the caller releases their sessions)."""
        tasks = [asyncio.ensure_future(self._choice(run)) for run in runs]
        try:
            choices = list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        job = runs[0].job
        return {"id": job.id, "object": "chat.completion" if job.kind == "chat" else "text_completion",
                "created": job.created, "model": job.model, "choices": choices, "usage": _runs_usage(runs)}

    async def _choice(self, run: _Run) -> dict[str, Any]:
        job, text = run.job, self._output_text(run.job)
        echo, echo_logprobs = self._echo(job, run.first) if job.kind == "completion" else ("", None)
        try:
            pieces = [piece async for piece in self.steps(job, run.iterator, run.first, run.tracker, text)]
        except Exception as exc:
            err = _as_api_error(exc)
            run.tracker.finish("error")
            raise err from exc
        finally:
            await _close(run.iterator)
        finish, out = job.finish_reason, "".join(piece.text for piece in pieces)
        run.tracker.finish(finish)
        tokens = [t for piece in pieces for t in piece.tokens]
        entries = None if job.request.logprobs is None else [e for piece in pieces for e in piece.logprobs or []]
        logprobs = self._choice_logprobs(job, tokens, entries)
        if job.kind == "chat":
            return {"index": job.index, "message": {"role": "assistant", "content": out, "refusal": None},
                    "logprobs": logprobs, "finish_reason": finish}
        if echo_logprobs is not None:  # the prompt's entries first, then the generated tokens'
            logprobs = {key: echo_logprobs[key] + (logprobs or {}).get(key, []) for key in echo_logprobs}
        return {"index": job.index, "text": echo + out, "logprobs": logprobs, "finish_reason": finish}

    async def handle(self, request: Request, body: ChatCompletionRequest | CompletionRequest) -> Response:
        """One response for a request's choices: n per prompt (completions may send several
        prompts), generated concurrently, choice index = prompt index * n + j."""
        arrival = getattr(request.state, "arrival", time.perf_counter())
        prompts = body.prompts() if isinstance(body, CompletionRequest) else [None]
        jobs = [await self.prepare(body, arrival, prompt) for prompt in prompts]
        jobs = [replace(job, id=jobs[0].id, created=jobs[0].created, index=i) for i, job in enumerate(jobs)]
        if jobs[0].stream:
            return await self._start_stream(jobs, body.n or 1)
        runs = await self.start_all(jobs, body.n or 1)
        try:
            completed, result = await _until_disconnect(request, lambda: self.complete(runs))
        finally:
            await self.close(runs)  # also when complete() never started (a cancelled task)
        if not completed:
            return Response(status_code=499)  # nobody is listening any more
        return JSONResponse(result)

    async def _start_stream(self, jobs: list[_Job], n: int) -> Response:
        """A stream's response. A start within the keep-alive interval answers as a non-streamed
        request does (a 429 is a 429); a start that takes longer (a stalled stage) sends the
        headers and keep-alive comments while it waits, and a failure to start goes in-band."""
        starting = asyncio.ensure_future(self.start_all(jobs, n))
        try:
            done, _ = await asyncio.wait({starting}, timeout=self.sse_keepalive_s)
        except BaseException:
            starting.cancel()  # start_all closes whatever it had started
            raise
        body = self.stream(starting.result()) if done else self._late_stream(starting, jobs[0])
        return _EventStream(_with_keepalive(body, self.sse_keepalive_s),
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _late_stream(self, starting: asyncio.Future[list[_Run]], job: _Job) -> AsyncIterator[str]:
        try:
            runs = await starting
        except Exception as exc:  # headers are sent: report in-band, as stream() does
            err = exc if isinstance(exc, APIError) else _as_api_error(exc)
            self._count_error(err, job.id)
            yield _sse(err.body())
            yield "data: [DONE]\n\n"
            return
        finally:
            if not starting.done():  # the client left while the engine was starting
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)
        chunks = self.stream(runs)
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()
            await self.close(runs)  # a stream closed before its first chunk never ran its own finally

    def model_card(self) -> dict[str, Any]:
        try:
            described = self.engine.describe()
        except Exception:
            log.exception("engine.describe() failed")
            described = {}
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "inferencemesh",
                "max_model_len": self.engine.max_context, "inferencemesh": described}


# --- the factory ------------------------------------------------------------------------------


def create_app(engine: Engine, tokenizer: PreTrainedTokenizerBase, *, served_model_name: str,
               api_key: str | None = None, auth_exempt_paths: tuple[str, ...] = ("/health", "/ready", "/metrics"),
               max_body_bytes: int = 1024 * 1024, metrics: FrontendMetrics | None = None,
               body_timeout_s: float = BODY_TIMEOUT_S, sse_keepalive_s: float = SSE_KEEPALIVE_S) -> FastAPI:
    """The frontend's ASGI app. api_key None or "": no authentication."""
    front = _Frontend(engine, tokenizer, served_model_name, metrics or FrontendMetrics(served_model_name),
                      sse_keepalive_s)
    app = FastAPI(title="InferenceMesh", description="OpenAI-compatible endpoint of an InferenceMesh.",
                  docs_url=None, redoc_url=None)
    app.state.frontend = front
    app.state.metrics = front.metrics

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return front.error_response(exc)

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, exc: EngineError) -> JSONResponse:
        return front.error_response(_from_engine_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return front.error_response(invalid_body(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return front.error_response(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return front.error_response(APIError(500, "Internal server error.", type="server_error"))

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get("/health", responses=COMMON_ERRORS)
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", responses={503: {"model": ErrorResponse, "description": "The model is not ready yet"},
                                  **COMMON_ERRORS})
    async def ready() -> Response:
        if await front._ready():
            return JSONResponse({"status": "ready"})
        return front.error_response(APIError(503, "The model is not ready yet.", type="service_unavailable",
                                             code="not_ready"))

    @app.get("/metrics", responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
                                    **COMMON_ERRORS})
    async def metrics_endpoint() -> Response:
        data, content_type = front.metrics.render()
        return Response(data, media_type=content_type)

    @app.get("/v1/models", response_model=None, responses={200: {"model": ModelList}, **COMMON_ERRORS})
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [front.model_card()]}

    @app.get("/v1/models/{model_id:path}", response_model=None,
             responses={200: {"model": ModelCard}, 404: GENERATION_ERRORS[404], **COMMON_ERRORS})
    async def get_model(model_id: str) -> dict[str, Any]:
        if model_id != served_model_name:
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
        return front.model_card()

    @app.post("/v1/completions", responses={**streamed(CompletionResponse), **GENERATION_ERRORS})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await front.handle(request, body)

    @app.post("/v1/chat/completions", responses={**streamed(ChatCompletion), **GENERATION_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await front.handle(request, body)

    app.include_router(utility_router)  # vLLM's /tokenize, /detokenize, /version

    app.add_middleware(_Guard, api_key=api_key or None, exempt=tuple(auth_exempt_paths),
                       max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s, reject=front.error_response)
    return app
