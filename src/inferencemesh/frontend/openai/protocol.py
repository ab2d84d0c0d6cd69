"""What every OpenAI request body we accept shares: the field types, the strict base model, the
refused and fixed fields, and the sampling request /v1/completions and /v1/chat/completions share
(chat/protocol.py and completions/protocol.py hold each endpoint's own).

Strict types, as OpenAI's own API is ("temperature": "1" is a 400, not a coercion). Every
field of OpenAI's request schemas and every vLLM extra we know is either honoured or refused by
`unsupported()` with the parameter's name: a client never gets an answer to a question it did
not ask. Fields nobody has defined yet are ignored, so newer clients keep working.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
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
# Known fields that only label a request (user, metadata, service_tier, ...) change nothing about
# the answer: extra="allow" accepts them as it accepts fields nobody has defined yet.


class RequestBody(BaseModel):
    # extra="allow": known fields we refuse arrive in model_extra, where unsupported() sees them;
    # fields nobody has defined yet are ignored, so newer clients keep working.
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptionsParam(RequestBody):
    """stream_options, as chat, completions and Responses take it."""

    include_usage: bool | None = None  # chat and completions: a last chunk with the usage
    include_obfuscation: bool | None = None  # accepted; events never carry obfuscation padding


class SamplingRequest(RequestBody):
    """Fields common to /v1/completions and /v1/chat/completions. None means "the default"."""

    model: Text
    stream: bool | None = None
    stream_options: StreamOptionsParam | None = None
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
    # Structured output (structured_outputs.py reads them; a malformed one is its 400, naming the field):
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
        """The structured-output fields, as structured_outputs.constraint_from_request takes them, a JSON
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
