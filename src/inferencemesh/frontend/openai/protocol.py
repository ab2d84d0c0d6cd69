"""Pydantic models of the OpenAI request bodies we accept.

Strict types, as OpenAI's own API is ("temperature": "1" is a 400, not a coercion). Every
field of OpenAI's request schemas and every vLLM extra we know is either honoured or refused by
`unsupported()` with the parameter's name: a client never gets an answer to a question it did
not ask. Fields nobody has defined yet are ignored, so newer clients keep working.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from inferencemesh.frontend.openai.tools import closed_objects
from inferencemesh.protocol.transport import MAX_LOGIT_BIAS_ENTRIES
from inferencemesh.sampling import MIN_REPETITION_PENALTY

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # OpenAI's seed range (format int64)
INT32_MAX = 2**31 - 1  # top_k is an int32 on the stage wire
UINT64_SPAN = 2**64  # the wire's seed is a uint64: a negative seed is taken modulo this (wire_seed)
# repetition_penalty divides (or multiplies) logits: below this floor a logit overflows to inf
# on its way through float32 and float64 sampling, so the floor keeps every kernel finite.
REPETITION_PENALTY_MIN = MIN_REPETITION_PENALTY  # sampling's floor, which every stage applies
MAX_LOGPROBS = 20
_TOKEN_ID = re.compile(r"[0-9]{1,10}")  # ASCII digits only: str.isdigit() also accepts "²", which int() refuses


# --- the field types: every range check of a request happens here, at the HTTP boundary ---------
# Each check raises a pydantic error, so FastAPI's handler answers a 400 naming the field.


def _integral(value: Any) -> Any:
    """JSON Schema's integer, as OpenAI's schema means it: 4.0 is the integer 4."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _finite(value: Any) -> Any:
    """NaN and infinities arrive as JSON's NaN / Infinity (Python's json reads them): refused
    before any range check, whose message ("less than or equal to 2") would mislead."""
    if isinstance(value, float) and not math.isfinite(value):
        raise PydanticCustomError("finite_number", "must be a finite number")
    return value


def _encodable(value: str) -> str:
    """Text must be UTF-8: a lone surrogate (the JSON escape \\ud800, or the bytes ED A0 80, which
    Python's json decodes the same way) cannot be tokenized or written back in a response."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise PydanticCustomError("unicode_text", "must be valid Unicode text (it holds a lone surrogate)") from None
    return value


Int = Annotated[int, BeforeValidator(_integral)]
Float = Annotated[float, BeforeValidator(_finite)]
Text = Annotated[str, AfterValidator(_encodable)]


def wire_seed(seed: int) -> int:
    """A request's seed (OpenAI: any int64) as the wire's uint64: two's complement, so every
    seed maps to one fixed wire seed and distinct seeds stay distinct."""
    return seed % UINT64_SPAN

# Known fields we do not implement (OpenAI's and vLLM's): refused whenever sent with a value.
REFUSED: dict[str, str] = {
    # OpenAI chat
    "audio": "audio output is not supported",
    "functions": "function calling is not supported", "function_call": "function calling is not supported",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "this model does not reason", "verbosity": "verbosity is not supported",
    "web_search_options": "web search is not supported", "moderation": "moderation is not supported",
    # vLLM: structured output's engine options (the engine is llguidance, JSON whitespace flexible),
    # beam search, other samplers and prompt options
    "guided_decoding_backend": "the structured-output engine is llguidance; it cannot be chosen per request",
    "guided_whitespace_pattern": "guided_whitespace_pattern is not supported",
    "use_beam_search": "beam search is not supported", "length_penalty": "beam search is not supported",
    "min_p": "min_p is not supported", "bad_words": "bad_words is not supported",
    "allowed_token_ids": "allowed_token_ids is not supported",
    "logits_processors": "logits_processors are not supported",
    "prompt_logprobs": "prompt_logprobs is not supported; use echo with logprobs (completions)",
    "truncate_prompt_tokens": "truncate_prompt_tokens is not supported",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported",
    "chat_template": "a request's own chat_template is not supported",
    "chat_template_kwargs": "chat_template_kwargs is not supported", "documents": "documents are not supported",
    "continue_final_message": "continue_final_message is not supported",
    "mm_processor_kwargs": "multimodal input is not supported", "priority": "request priorities are not supported",
    "kv_transfer_params": "KV transfer is not supported", "vllm_xargs": "vllm_xargs is not supported",
    "cache_salt": "prefix caching is not supported", "return_token_ids": "return_token_ids is not supported",
}
# Known fields whose only behaviour here is one fixed value: accepted when they ask for it.
FIXED: dict[str, object] = {
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "add_generation_prompt": True,
    "store": False, "modalities": ["text"],
    "add_special_tokens": False,  # chat (the template places them); completions declare the field
}
# Known fields that only label a request (they change nothing about the answer): accepted.
# Known fields that only label a request (user, metadata, service_tier, ...) change nothing about
# the answer: extra="allow" accepts them as it accepts fields nobody has defined yet.


class _Body(BaseModel):
    # extra="allow": known fields we refuse arrive in model_extra, where unsupported() sees them.
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Body):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted; we never add obfuscation padding


class _SamplingRequest(_Body):
    """Fields common to /v1/completions and /v1/chat/completions. None means "the default"."""

    model: Text
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[Int, Field(ge=0)] | None = None
    temperature: Annotated[Float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Float, Field(ge=0.0, le=1.0)] | None = None  # 0: greedy (OpenAI's schema allows it)
    top_k: Annotated[Int, Field(ge=-1, le=INT32_MAX)] | None = None  # extension (vLLM's): 0 or -1 = off
    seed: Annotated[Int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None  # sent as wire_seed(seed)
    stop: Text | Annotated[list[Text], Field(max_length=16)] | None = None
    n: Annotated[Int, Field(ge=1, le=128)] | None = None  # choices per prompt (the engine may allow fewer)
    presence_penalty: Annotated[Float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[Float, Field(ge=-2.0, le=2.0)] | None = None
    # keys: token ids, checked against the vocabulary by logit_bias_pairs (the vocabulary is the app's)
    logit_bias: Annotated[dict[str, Annotated[Float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    user: Text | None = None
    # vLLM's extra sampling parameters
    repetition_penalty: Annotated[Float, Field(ge=REPETITION_PENALTY_MIN, le=2.0)] | None = None
    min_tokens: Annotated[Int, Field(ge=0)] | None = None
    ignore_eos: bool | None = None
    # ids: checked against the vocabulary where the request is prepared (the vocabulary is the app's)
    stop_token_ids: Annotated[list[Annotated[Int, Field(ge=0)]], Field(max_length=64)] | None = None
    include_stop_str_in_output: bool | None = None
    # Structured output (constraints.py reads them; a malformed one is its 400, naming the field):
    # OpenAI's response_format, and vLLM's guided_* and structured_outputs, on both endpoints as vLLM has them.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    structured_outputs: dict[str, Any] | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]  # an empty stop string would end every request at once

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first requested feature we cannot honour, else None."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        for name, value in (self.model_extra or {}).items():
            if value is None:
                continue
            if name in REFUSED:
                return name, REFUSED[name]
            if name in FIXED and value != FIXED[name]:
                return name, f"{name} must be {json.dumps(FIXED[name])} here"
        return None

    def constraint_fields(self) -> dict[str, Any]:
        """The structured-output fields, as constraints.constraint_from_request takes them, a JSON
        schema's objects closed unless it says otherwise (closed_schema)."""
        response_format, structured = self.response_format, self.structured_outputs
        spec = response_format.get("json_schema") if isinstance(response_format, dict) else None
        if isinstance(spec, dict) and "schema" in spec and spec.get("strict") is not True:  # strict: checked as sent
            closed = {**spec, "schema": closed_schema(spec["schema"])}
            response_format = {**(response_format or {}), "json_schema": closed}
        if isinstance(structured, dict) and structured.get("json") is not None:
            structured = {**structured, "json": closed_schema(structured["json"])}
        return {"response_format": response_format, "guided_json": closed_schema(self.guided_json),
                "guided_regex": self.guided_regex, "guided_choice": self.guided_choice,
                "guided_grammar": self.guided_grammar, "structured_outputs": structured}

    def logit_bias_pairs(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias); ValueError naming a key that is not a token id."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not _TOKEN_ID.fullmatch(key) or int(key) >= vocab_size:
                raise ValueError(f"logit_bias key {key!r} is not a token id in [0, {vocab_size})")
            pairs.append((int(key), float(bias)))
        return tuple(sorted(pairs))


def closed_schema(schema: Any) -> Any:
    """A JSON schema constraint with every object that lists its properties closed
    (additionalProperties false) unless it says otherwise, as tool arguments are: vLLM's default
    engine (xgrammar) never writes a property a schema does not list either, and a small model
    left free to add some rambles on until max_tokens. Every output still matches the schema as
    given. Strict schemas are closed already; a schema that is none is left for constraints.py
    to refuse."""
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except (ValueError, RecursionError):
            return schema
        return closed_schema(parsed) if isinstance(parsed, dict) else schema
    if not isinstance(schema, dict):
        return schema
    try:
        return closed_objects(schema)
    except (RecursionError, TypeError, ValueError):
        return schema


class CompletionRequest(_SamplingRequest):
    # A string, token ids, or a batch of either: one response, n choices per prompt.
    # null or absent: OpenAI generates "as if from the beginning of a new document" (the BOS token alone)
    prompt: Text | Annotated[list[Text], Field(min_length=1, max_length=64)] | list[Int] | \
        Annotated[list[list[Int]], Field(min_length=1, max_length=64)] | None = None
    echo: bool | None = None
    suffix: Text | None = None
    best_of: Annotated[Int, Field(ge=1)] | None = None
    logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None  # OpenAI: up to 5; vLLM: 20
    add_special_tokens: bool | None = None  # vLLM: add BOS etc. to a text prompt (default true)

    def unsupported(self) -> tuple[str, str] | None:
        if self.best_of not in (None, 1):
            return "best_of", "best_of > 1 is not supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.max_tokens == 0 and not (self.echo and self.logprobs is not None):
            return "max_tokens", "max_tokens 0 scores the prompt: it needs echo and logprobs"
        return super().unsupported()

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts (text or token ids): a batch runs them concurrently."""
        p = "" if self.prompt is None else self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return list(p)  # type: ignore[arg-type]  # a list of prompts: strings or id lists
        return [p]  # type: ignore[list-item]  # one prompt: a string or a list of ids


class TextContentPart(_Body):
    type: Literal["text"]
    text: Text


class FunctionCall(_Body):
    name: Text
    arguments: Text  # JSON text, as the model wrote it


class MessageToolCall(_Body):
    """A tool call an assistant turn made (what a client sends back with the tool's result)."""

    id: Text
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # null only for an assistant turn (OpenAI's schema: one that carried tool calls): it reads as ""
    content: Text | Annotated[list[TextContentPart], Field(min_length=1)] | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn's calls
    tool_call_id: Text | None = None  # a tool turn: the call it answers

    @model_validator(mode="after")
    def _content_needed(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise PydanticCustomError("missing", "content is required unless the role is assistant")
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("tool_calls_role", "only an assistant message carries tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise PydanticCustomError("missing", "a tool message needs the tool_call_id it answers")
        return self

    def template_message(self) -> dict[str, Any]:
        """The message as chat templates take it: "developer" is OpenAI's newer name for "system"
        (templates only know the latter); a call's arguments as an object when they are JSON
        (templates render them with tojson, as transformers and vLLM pass them), else as given."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": self.text()}
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)}}
                for call in self.tool_calls]
        return message

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[Int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = None  # vLLM: only false
    # Function calling (tools.py checks them: a bad one is its 400, naming the field)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        if self.max_tokens == 0 or self.max_completion_tokens == 0:
            return "max_tokens", "max_tokens must be at least 1"
        if self.echo:
            return "echo", "echo is not supported for chat"
        return super().unsupported()

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens replaces the deprecated max_tokens; it wins when both are set.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat templates take it."""
        return [m.template_message() for m in self.messages]

    def tool_fields(self) -> dict[str, Any]:
        """The function-calling fields, as tools.tool_calling_from_request takes them."""
        return {"tools": self.tools, "tool_choice": self.tool_choice, "parallel_tool_calls": self.parallel_tool_calls}


def _arguments(text: str) -> Any:
    """A history's call arguments as the template renders them: parsed when they are JSON (templates
    write them with tojson), else the string as given. OpenAI accepts any string there, and a
    client sends back what the model wrote, a call cut short by the length limit included."""
    try:
        arguments = json.loads(text)
        json.dumps(arguments, ensure_ascii=False).encode("utf-8")  # an escaped lone surrogate cannot be rendered
    except (ValueError, RecursionError):  # UnicodeEncodeError included
        return text
    return arguments
