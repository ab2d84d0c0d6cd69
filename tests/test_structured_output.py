"""Structured output through the speculative split, as a user gets it: `inferencemesh serve` (two
stage processes, the first embedded in the frontend), speculation by the bundled draft model and
by n-grams, and the official openai client.

Every constrained output parses and validates against its schema, greedy and sampled; greedy
output is exactly what the model's own greedy choice under the same grammar gives (transformers'
forward, float32, masked by the same llguidance grammar); structured outputs stream, take n > 1,
and `.parse()` fills a pydantic model.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal

import grammar_reference
import httpx
import jsonschema
import pytest
import torch
from mesh_helpers import serving
from openai import BadRequestError, OpenAI
from pydantic import BaseModel, Field
from transformers import AutoModelForCausalLM, AutoTokenizer

from inferencemesh.bundled import resolve_model
from inferencemesh.frontend.openai.structured_outputs import constraint_from_request

pytestmark = pytest.mark.slow

PROMPT = "# config for the service\nconfig = "
# Strict-mode schemas (every property required, no additional properties), from flat to nested.
# Every value is bounded in length (integers by their range, strings and arrays by their size), so
# that sampling from a small model ends within MAX_TOKENS (a JSON number's fraction has no bound).
SCHEMAS: dict[str, dict[str, Any]] = {
    "enum": {"type": "object", "properties": {"lang": {"enum": ["python", "rust", "go"]}}, "required": ["lang"],
             "additionalProperties": False},
    "bounded numbers": {"type": "object", "properties": {
        "port": {"type": "integer", "minimum": 1, "maximum": 65535}, "workers": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 64},
        "debug": {"type": "boolean"}}, "required": ["port", "workers", "debug"], "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "hosts": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3}},
        "required": ["hosts"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                   "team": {"enum": ["a", "b"]}},
                  "required": ["id", "team"], "additionalProperties": False}},
        "required": ["name", "owner"], "additionalProperties": False},
    "optional via null": {"type": "object", "properties": {
        "timeout": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 600}, {"type": "null"}]},
        "mode": {"type": ["string", "null"], "enum": ["fast", "safe", None]}},
        "required": ["timeout", "mode"], "additionalProperties": False},
    "refs": {"type": "object", "$defs": {"pair": {"type": "object", "properties": {
        "k": {"type": "string", "maxLength": 8}, "v": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["k", "v"],
        "additionalProperties": False}},
        "properties": {"first": {"$ref": "#/$defs/pair"}, "rest": {"type": "array", "items": {"$ref": "#/$defs/pair"},
                                                                     "maxItems": 2}},
        "required": ["first", "rest"], "additionalProperties": False},
}
MAX_TOKENS = 160


def schema_format(name: str) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name.replace(" ", "_"), "strict": True,
                                                   "schema": SCHEMAS[name]}}


@pytest.fixture(scope="module", params=["draft", "ngram"])
def served(request) -> Iterator[tuple[OpenAI, str]]:
    # float32: greedy output is compared with transformers' float32 forward
    with serving("--speculative", request.param, "--dtype", "float32") as (base, _, _):
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        yield client, client.models.list().data[0].id


@pytest.fixture(scope="module")
def reference() -> tuple[Any, Any]:
    model_dir = resolve_model(None)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), \
        AutoTokenizer.from_pretrained(model_dir)


def constrained_greedy(reference: tuple[Any, Any], prompt: str, fields: dict[str, Any]) -> str:
    model, tokenizer = reference
    constraint = constraint_from_request(**fields)
    assert constraint is not None
    return grammar_reference.constrained_greedy(model, tokenizer, tokenizer(prompt).input_ids, constraint, MAX_TOKENS)


@pytest.mark.parametrize("name", SCHEMAS)
def test_strict_schemas_are_followed_greedy_and_sampled_and_greedy_is_the_models_own(served, reference,
                                                                                      name: str) -> None:
    client, model = served
    greedy = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"response_format": schema_format(name)})
    assert greedy.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(greedy.choices[0].text), SCHEMAS[name])
    assert greedy.choices[0].text == constrained_greedy(reference, PROMPT, {"response_format": schema_format(name)})
    sampled = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0, seed=7,
                                        n=2, extra_body={"guided_json": SCHEMAS[name]})
    for choice in sampled.choices:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), SCHEMAS[name])


class Service(BaseModel):
    name: Annotated[str, Field(max_length=12)]
    port: Annotated[int, Field(ge=1, le=65535)]
    protocol: Literal["http", "grpc"]


def test_chat_parse_fills_a_pydantic_model_and_a_streamed_schema_is_the_same_text(served) -> None:
    client, model = served
    messages = [{"role": "user", "content": "Describe the service as JSON."}]
    parsed = client.chat.completions.parse(model=model, messages=messages, response_format=Service,
                                           max_completion_tokens=MAX_TOKENS, temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, Service)
    asked = {"model": model, "messages": messages, "response_format": schema_format("nested"),
             "max_completion_tokens": MAX_TOKENS, "temperature": 0.8, "seed": 3}
    whole = client.chat.completions.create(**asked).choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or ""
                       for chunk in client.chat.completions.create(**asked, stream=True) if chunk.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), SCHEMAS["nested"])


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output_in_each_method(served, method: str) -> None:
    """LangChain's schema methods: a json_schema response_format, and a forced tool call (function
    calling: the grammar of the tool's schema). (Its json_mode is response_format json_object, which
    bounds nothing: the bundled code model writes one long object until max_tokens; json_object
    itself is checked in test_openai_surface.py.)"""
    from langchain_openai import ChatOpenAI

    client, model = served
    chat = ChatOpenAI(model=model, base_url=str(client.base_url), api_key="unused", temperature=0,
                      max_completion_tokens=MAX_TOKENS, max_retries=0)
    service = chat.with_structured_output(Service, method=method, strict=True).invoke("Describe the service as JSON.")
    assert isinstance(service, Service)


def test_choices_regexes_and_grammars_bound_the_output(served) -> None:
    client, model = served
    for seed in range(4):
        choice = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.2, seed=seed,
                                           extra_body={"guided_choice": ["yaml", "toml", "json"]})
        assert choice.choices[0].text in ("yaml", "toml", "json")
        version = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=1.2, seed=seed,
                                            extra_body={"guided_regex": r"v[0-9]\.[0-9]{1,2}"})
        assert version.choices[0].text.startswith("v") and version.choices[0].finish_reason == "stop"


def test_a_constraint_the_engine_cannot_enforce_is_a_400_naming_it(served) -> None:
    client, model = served
    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], response_format={
            "type": "json_schema", "json_schema": {"name": "n", "strict": True, "schema": {
                "type": "object", "properties": {"a": {"type": "string"}}}}})  # strict: "a" must be required
    assert refused.value.body["param"].startswith("response_format.json_schema.schema")


def test_constrained_requests_that_fail_or_vanish_hurt_no_other(served) -> None:
    """While two free-text streams decode, constrained requests are refused (an invalid schema, one
    over the size limit, a grammar llguidance rejects) and a constrained stream's client leaves
    after a few chunks: the free streams' text is what each gets alone, nothing stays running, and
    the constrained request then answers as it did before."""
    client, model = served
    free = {"model": model, "prompt": PROMPT, "max_tokens": 64, "temperature": 0, "extra_body": {"ignore_eos": True}}
    alone = client.completions.create(**free).choices[0].text
    constrained = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                   "extra_body": {"response_format": schema_format("nested")}}
    before = client.completions.create(**constrained).choices[0].text
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 64}
                                             for i in range(1200)}}
    refused_bodies = [{"guided_json": {"type": "objekt"}}, {"guided_json": huge}, {"guided_grammar": "start: ("},
                      {"guided_regex": "(unclosed"}]

    def stream_free() -> str:
        return "".join(c.choices[0].text for c in client.completions.create(**free, stream=True) if c.choices)

    def refused(extra: dict[str, Any]) -> int:
        with pytest.raises(BadRequestError) as err:
            client.completions.create(model=model, prompt=PROMPT, max_tokens=8, extra_body=extra)
        return err.value.status_code

    def vanish() -> int:
        stream = client.completions.create(**constrained, stream=True)
        seen = 0
        for _ in stream:
            seen += 1
            if seen == 3:
                break
        stream.close()  # the client leaves mid-stream
        return seen

    with ThreadPoolExecutor(8) as pool:
        innocents = [pool.submit(stream_free) for _ in range(2)]
        codes = list(pool.map(refused, refused_bodies * 2))
        left = [pool.submit(vanish) for _ in range(2)]
        assert [f.result() for f in innocents] == [alone, alone]
    assert codes == [400] * len(codes) and [f.result() for f in left] == [3, 3]
    base = str(client.base_url).removesuffix("/v1/")
    deadline = time.monotonic() + 30
    while (running := _gauge(httpx.get(f"{base}/metrics").text, "num_requests_running")) and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert running == 0
    assert client.completions.create(**constrained).choices[0].text == before


def _gauge(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.split("{")[0].endswith(name) and not line.startswith("#"))
