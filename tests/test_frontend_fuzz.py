"""Property-based fuzzing of the HTTP API, schemathesis-style, with hypothesis.

Request bodies are generated from the frontend's own OpenAPI document (/openapi.json, what
schemathesis would read): schema-valid bodies, the same bodies with one field broken, and
arbitrary JSON or bytes. Whatever arrives, the server must answer without a 5xx, every error
in OpenAI's format, every success valid against OpenAI's spec, and no engine session left open.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from fixture_engine import FixtureModel, TransformersEngine, build_fixture_model, serve
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai_spec import COMPLETION_STREAM_CHUNK, errors

from inferencemesh.frontend.openai.app import create_app

pytestmark = pytest.mark.slow

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)


def from_schema(schema: dict[str, Any], components: dict[str, Any]) -> st.SearchStrategy:
    """A hypothesis strategy for the JSON Schema subset FastAPI/pydantic emit."""
    if "$ref" in schema:
        return st.deferred(lambda: from_schema(components[schema["$ref"].rsplit("/", 1)[-1]], components))
    if "anyOf" in schema or "oneOf" in schema:
        return st.one_of([from_schema(s, components) for s in schema.get("anyOf", schema.get("oneOf"))])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        if not props:
            return st.dictionaries(st.text(max_size=8), JSON, max_size=3)
        required = set(schema.get("required", []))
        return st.fixed_dictionaries(
            {k: from_schema(v, components) for k, v in props.items() if k in required},
            optional={k: from_schema(v, components) for k, v in props.items() if k not in required})
    if kind == "array":
        low = schema.get("minItems", 0)
        return st.lists(from_schema(schema.get("items", {}), components), min_size=low,
                        max_size=schema.get("maxItems", low + 3))
    if kind == "string":
        return st.text(max_size=40)
    if kind == "integer":
        return st.integers(min_value=_bound(schema, "minimum"), max_value=_bound(schema, "maximum"))
    if kind == "number":
        return st.floats(min_value=schema.get("minimum"), max_value=schema.get("maximum"), allow_nan=False,
                         allow_infinity=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return JSON


def _bound(schema: dict[str, Any], key: str) -> int | None:
    return None if key not in schema else int(schema[key])


def broken(valid: st.SearchStrategy) -> st.SearchStrategy:
    """A valid body with one field removed, replaced by arbitrary JSON, or an extra field added."""
    def mutate(draw_body: dict, how: int, key_pick: int, junk: Any, extra: str) -> dict:
        body = dict(draw_body)
        keys = sorted(body)
        if how == 0 and keys:
            body.pop(keys[key_pick % len(keys)])
        elif how == 1 and keys:
            body[keys[key_pick % len(keys)]] = junk
        else:
            body[extra] = junk
        return body

    return st.builds(mutate, valid, st.integers(0, 2), st.integers(0, 1000), JSON, st.text(max_size=10))


@pytest.fixture(scope="module")
def target() -> Iterator[tuple[str, FixtureModel, TransformersEngine, dict]]:
    fm = build_fixture_model()
    # A short context keeps every generation short, so many examples fit in a few minutes.
    engine = TransformersEngine(fm.engine.model, model_name=fm.name, max_context=48)
    app = create_app(engine, fm.tokenizer, served_model_name=fm.name, max_body_bytes=64 * 1024)
    with serve(app) as url:
        yield url, fm, engine, httpx.get(url + "/openapi.json").json()


# Fields whose schema-valid values we serve (others, like n > 1 or tools, are refused with a 400).
SERVED_FIELDS = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                 "top_k", "seed", "stop", "stream", "stream_options", "echo"}


def plausible(body: dict, model: str, stream: bool, max_tokens: int | None) -> dict:
    """Narrow a schema-valid body to what a real client sends, so that most of them reach the engine."""
    body = {k: v for k, v in body.items() if k in SERVED_FIELDS}
    body.update(model=model, stream=stream, max_tokens=max_tokens)
    if not stream:
        body.pop("stream_options", None)
    return body


def bodies(openapi: dict, path: str, model: str) -> st.SearchStrategy:
    components = openapi["components"]["schemas"]
    ref = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    valid = from_schema(ref, components).map(dict)
    served = st.builds(plausible, valid, st.just(model), st.booleans(), st.none() | st.integers(1, 16))
    raw = st.one_of(JSON.map(lambda v: json.dumps(v).encode()), st.binary(max_size=64))
    return st.one_of(valid, served, served, broken(served), raw)


def check_response(r: httpx.Response, path: str) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code != 200:
        assert r.status_code in (400, 404, 413), (r.status_code, r.text[:500])
        assert not errors(r.json(), "ErrorResponse"), r.text[:500]
        return
    chat = path.endswith("chat/completions")
    if r.headers["content-type"].startswith("text/event-stream"):
        blocks = r.text.split("\n\n")
        assert blocks[-2:] == ["data: [DONE]", ""], r.text[-200:]
        for block in blocks[:-2]:
            chunk = json.loads(block.removeprefix("data: "))
            schema = "CreateChatCompletionStreamResponse" if chat else COMPLETION_STREAM_CHUNK
            assert "error" not in chunk and not errors(chunk, schema), block
        return
    body = r.json()
    assert not errors(body, "CreateChatCompletionResponse" if chat else "CreateCompletionResponse"), body
    usage = body["usage"]
    # a batch of prompts sums its requests' usage: each fits the 48-token context
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] <= 48 * len(body["choices"])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fuzzed_bodies_never_5xx(target, path: str) -> None:
    url, fm, engine, openapi = target

    @settings(max_examples=80, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(bodies(openapi, path, fm.name))
    def run(body: dict | bytes) -> None:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        with httpx.Client(base_url=url, timeout=60) as http:
            r = http.post(path, content=content, headers={"content-type": "application/json"})
        check_response(r, path)

    run()
    assert engine.open_sessions == 0


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(model_id=st.text(min_size=1, max_size=30),
       header=st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=30))
def test_fuzzed_model_lookups_and_headers(target, model_id: str, header: str) -> None:
    url, fm, _, _ = target
    with httpx.Client(base_url=url, timeout=30) as http:
        r = http.get("/v1/models/" + quote(model_id, safe=""), headers={"Authorization": header})
    assert r.status_code in (200, 404), r.text
    assert r.status_code == 404 or model_id == fm.name
    assert not errors(r.json(), "Model" if r.status_code == 200 else "ErrorResponse")
