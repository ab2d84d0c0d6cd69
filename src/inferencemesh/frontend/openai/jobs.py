"""A request becomes jobs: the body checked against this model and its context, the prompt
tokenized, and the sampling settings turned into the engine's GenerationRequest."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from inferencemesh.frontend.engine.api import Engine, GenerationRequest
from inferencemesh.frontend.engine.constraints import Constraint
from inferencemesh.frontend.engine.grammar import ConstrainedOutput, constrained_output, grammar_tokenizer
from inferencemesh.frontend.engine.metrics import FrontendMetrics
from inferencemesh.frontend.openai.chat.protocol import ChatCompletionRequest
from inferencemesh.frontend.openai.completions.protocol import CompletionRequest
from inferencemesh.frontend.openai.errors import APIError
from inferencemesh.frontend.openai.prompts import chat_ids, text_ids
from inferencemesh.frontend.openai.protocol import wire_seed
from inferencemesh.frontend.openai.structured_outputs import constraint_from_request
from inferencemesh.frontend.openai.tools import ToolCalling, tool_calling_from_request
from inferencemesh.sampling import GREEDY_BELOW

log = logging.getLogger("inferencemesh.frontend")

COMPILED_CONSTRAINTS = 64  # the last constraints compiled (agents send the same schema again and again)
# End-of-turn markers of common chat templates: generation stops on them as on EOS.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")

Body = ChatCompletionRequest | CompletionRequest


@dataclass(frozen=True)
class Job:
    """One prompt of a validated request, ready for the engine. Immutable: what a choice's
    generation finds is its ChoiceState's (choices.py)."""

    kind: str  # "chat" | "completion" | "response": which endpoint's shapes its answer takes
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
    tools: ToolCalling | None = None  # the request's tools: its output is parsed for calls when they may be made
    # the request's settings its answer reports (a Response echoes its request's: responses/protocol.py)
    echoed: Mapping[str, Any] = field(default_factory=dict)


async def engine_ready(engine: Engine) -> bool:
    """Whether the engine takes requests (the engine decides how long a "ready" is trusted)."""
    try:
        return bool(await engine.is_ready())
    except Exception:
        log.exception("engine.is_ready() failed")
        return False


_COMPILES = ThreadPoolExecutor(max_workers=2, thread_name_prefix="constraint-compile")


def _timed_compile(fields: dict[str, Any], tool_fields: dict[str, Any],
                   ) -> tuple[tuple[ToolCalling | None, Constraint | None], float]:
    """The request's tools and output constraint, compiled on a worker thread, and the time it
    took (not the wait for a thread)."""
    started = time.perf_counter()
    constraint = constraint_from_request(**fields)
    tools = tool_calling_from_request(**tool_fields) if tool_fields else None
    if tools is not None:
        constraint = tools.constraint(constraint)
    return (tools, constraint), time.perf_counter() - started


class JobBuilder:
    """Turns request bodies into jobs for one served model and its tokenizer."""

    def __init__(self, engine: Engine, tokenizer: PreTrainedTokenizerBase, model: str,
                 metrics: FrontendMetrics | None = None) -> None:
        self.engine, self.tokenizer, self.model = engine, tokenizer, model
        self.metrics = metrics  # structured output: requests by kind, compile and mask times
        self.vocab_size = len(tokenizer)
        vocab = tokenizer.get_vocab()
        stop_ids = {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
        eos = tokenizer.eos_token_id
        stop_ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.stop_token_ids = frozenset(stop_ids)
        self._compiled: OrderedDict[str, tuple[ToolCalling | None, Constraint | None]] = OrderedDict()

    async def job(self, body: Body, arrival: float, prompt: str | list[int] | None = None) -> Job:
        """The job of a request (of one of its prompts: a completions batch has a job each)."""
        if body.model != self.model:
            raise APIError(404, f"The model `{body.model}` does not exist. This server serves `{self.model}`.",
                           param="model", code="model_not_found")
        refused = body.unsupported()
        if refused is not None:
            raise APIError(400, refused[1], param=refused[0], code="unsupported_parameter")
        if not await engine_ready(self.engine):
            raise APIError(503, "The model is not ready yet.", type="service_unavailable", code="not_ready")

        if isinstance(body, ChatCompletionRequest):
            kind, prefix, max_tokens, param = "chat", "chatcmpl-", body.requested_max_tokens(), "messages"
        else:
            kind, prefix, max_tokens, param = "completion", "cmpl-", body.max_tokens, "prompt"
        tools, constraint, compile_s = await self._output_rules(body)
        prompt_ids, echo_text = await self._prompt(body, prompt, tools)
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
        if body.min_tokens and max_tokens < body.min_tokens:
            raise APIError(400, f"min_tokens ({body.min_tokens}) exceeds max_tokens ({max_tokens}).",
                           param="min_tokens")

        constrained = await self._constrained(body, constraint, compile_s)

        request_id = prefix + uuid.uuid4().hex
        if isinstance(body, ChatCompletionRequest):
            top, prompt_logprobs = body.top_logprobs, None
            logprobs = (top or 0) if body.logprobs else None
        else:
            logprobs, top = body.logprobs, body.logprobs
            prompt_logprobs = logprobs if body.echo else None
        gen = self._generation_request(body, request_id, prompt_ids, max_tokens, logprobs, prompt_logprobs,
                                       constrained)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return Job(kind, request_id, int(time.time()), self.model, prompt_ids, gen, body.stop_strings(),
                   bool(body.stream), include_usage, arrival, echo_text, top_logprobs=top or 0, tools=tools)

    def _generation_request(self, body: Body, request_id: str, prompt_ids: list[int], max_tokens: int,
                            logprobs: int | None, prompt_logprobs: int | None,
                            constrained: ConstrainedOutput | None) -> GenerationRequest:
        top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
        temperature = 1.0 if body.temperature is None else body.temperature
        top_p = 1.0 if body.top_p is None else body.top_p
        if temperature < GREEDY_BELOW or top_p == 0.0:
            # logits / 1e-300 overflow to inf: this close to 0 means greedy; so does top_p 0 (no
            # probability mass: only the most likely token), which the wire would read as "off"
            temperature, top_p = 0.0, 1.0
        return GenerationRequest(
            request_id=request_id, prompt_ids=prompt_ids, max_tokens=max_tokens,
            temperature=temperature, top_p=top_p, top_k=top_k,
            seed=None if body.seed is None else wire_seed(body.seed),
            stop_token_ids=self._stop_token_ids(body),
            emit_stop_token=bool(body.include_stop_str_in_output),
            presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0, logit_bias=self._logit_bias(body),
            min_tokens=body.min_tokens or 0, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            constrained=constrained,
        )

    async def _output_rules(self, body: Body) -> tuple[ToolCalling | None, Constraint | None, float | None]:
        """The request's tools and its output's constraint (response_format, guided_*,
        structured_outputs, and the tool calls' grammar), compiled (structured_outputs.py, tools.py: a
        ConstraintError is a 400 naming the field), and the compile time (None: from the cache).
        (None, None, None): free text."""
        fields = body.constraint_fields()
        tool_fields = body.tool_fields() if isinstance(body, ChatCompletionRequest) else {}
        if all(value is None for value in (*fields.values(), *tool_fields.values())):
            return None, None, None
        # not sorted: two schemas that differ only in their properties' order are different constraints
        key = json.dumps([fields, tool_fields], default=str)
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return (*self._compiled[key], None)
        # off the event loop: a schema's checks take milliseconds, its compile (in the grammar worker's
        # process, constraints.validated_grammar) up to its CPU budget, on threads of its own: grammars
        # queued for the worker must not hold the threads that tokenize everyone's prompts
        compiled, compile_s = await asyncio.get_running_loop().run_in_executor(
            _COMPILES, _timed_compile, fields, tool_fields)
        self._compiled[key] = compiled
        if len(self._compiled) > COMPILED_CONSTRAINTS:
            self._compiled.popitem(last=False)
        return (*compiled, compile_s)

    async def _constrained(self, body: Body, constraint: Constraint | None,
                           compile_s: float | None) -> ConstrainedOutput | None:
        """The output's constraint, ready to start a grammar per choice; None for free text."""
        if constraint is None:
            return None
        # The grammar decides where the output may end: it allows EOS (and end-of-turn) only there.
        for name in ("min_tokens", "ignore_eos"):
            if getattr(body, name):
                raise APIError(400, f"{name} cannot be combined with structured output: the grammar decides where "
                                    "the output ends", param=name)
        tokenizer = await asyncio.to_thread(grammar_tokenizer, self.tokenizer, self.vocab_size,
                                            sorted(self.stop_token_ids))
        # its matcher built (once per constraint) off the event loop, at low priority
        output = await constrained_output(constraint, tokenizer,
                                          self.metrics.mask_timer() if self.metrics is not None else None)
        if self.metrics is not None:
            self.metrics.record_constraint(constraint.kind.value, compile_s)
        return output

    def _stop_token_ids(self, body: Body) -> frozenset[int]:
        """EOS and end-of-turn tokens (unless ignore_eos, as vLLM does), plus the request's own."""
        own = body.stop_token_ids or []
        bad = next((t for t in own if t >= self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"stop_token_ids: {bad} is outside the vocabulary (size {self.vocab_size}).",
                           param="stop_token_ids")
        return (frozenset() if body.ignore_eos else self.stop_token_ids) | frozenset(own)

    def _logit_bias(self, body: Body) -> tuple[tuple[int, float], ...]:
        try:
            return body.logit_bias_pairs(self.vocab_size)
        except ValueError as err:
            raise APIError(400, str(err), param="logit_bias") from err

    async def _prompt(self, body: Body, prompt: str | list[int] | None,
                      tools: ToolCalling | None = None) -> tuple[list[int], str]:
        """The prompt's token ids, and the text to echo (completions with echo=true)."""
        if isinstance(body, ChatCompletionRequest):
            # off the event loop: prompts can be long
            messages, template_tools = body.template_messages(), tools.template_tools() if tools else None
            return await asyncio.to_thread(chat_ids, self.tokenizer, messages, tools=template_tools), ""
        prompt = body.prompts()[0] if prompt is None else prompt
        if isinstance(prompt, str):
            special = body.add_special_tokens is not False
            ids = await asyncio.to_thread(text_ids, self.tokenizer, prompt, add_special_tokens=special)
            return ids, prompt if body.echo else ""
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"Token id {bad} is outside the vocabulary (size {self.vocab_size}).", param="prompt")
        return list(prompt), str(self.tokenizer.decode(prompt)) if body.echo else ""
