"""The OpenAI-compatible frontend over a real engine, through a real uvicorn server.

Clients: the official `openai` package, plus raw httpx where the bytes matter (SSE framing,
bad bodies). Every JSON body the server returns is validated against OpenAI's own OpenAPI spec.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from fixture_engine import FixtureModel, TransformersEngine, build_fixture_model, serve
from openai_spec import COMPLETION_STREAM_CHUNK, errors

from inferencemesh.frontend.openai.app import create_app
from inferencemesh.frontend.openai.text.detokenize import IncrementalDetokenizer
from inferencemesh.frontend.openai.text.stop_strings import OutputText, StopStringMatcher

PROMPT = "def fibonacci(n):\n    "


def check(body: object, schema: str) -> None:
    problems = errors(body, schema)
    assert not problems, f"{schema}: {problems}\n{json.dumps(body)[:2000]}"


def check_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    check(body, "ErrorResponse")
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


def sse(http: httpx.Client, path: str, body: dict) -> list:
    """POST and read an SSE stream; returns the decoded `data:` payloads ("[DONE]" kept as a string)."""
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


# --- fixtures: the engine is built in ONE place (fixture_engine.build_fixture_model) ----------


@pytest.fixture(scope="module")
def fm() -> FixtureModel:
    return build_fixture_model()


@pytest.fixture(scope="module")
def url(fm: FixtureModel) -> Iterator[str]:
    with serve(create_app(fm.engine, fm.tokenizer, served_model_name=fm.name)) as base:
        yield base


@pytest.fixture()
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture()
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=120) as c:
        yield c


def sibling_engine(fm: FixtureModel, **kwargs) -> TransformersEngine:
    """Another engine over the same weights, for apps that need a differently configured engine."""
    return TransformersEngine(fm.engine.model, model_name=fm.name, max_context=fm.engine.max_context, **kwargs)


# --- happy paths with the official client ------------------------------------------------------


def test_models_list(client: openai.OpenAI, http: httpx.Client, fm: FixtureModel) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [fm.name]
    body = http.get("/v1/models").json()
    check(body, "ListModelsResponse")
    card = body["data"][0]
    assert card["max_model_len"] == fm.engine.max_context
    assert card["inferencemesh"]["speculative"]["strategy"] == "none"
    one = http.get(f"/v1/models/{fm.name}")
    assert one.json() == card
    check_error(http.get("/v1/models/nope"), 404, "model_not_found")


def test_completion_plain_and_streamed_agree(client: openai.OpenAI, http: httpx.Client, fm: FixtureModel) -> None:
    params = {"model": fm.name, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    raw = client.completions.with_raw_response.create(**params)
    check(json.loads(raw.content), "CreateCompletionResponse")
    done = raw.parse()
    choice = done.choices[0]
    assert done.object == "text_completion" and done.model == fm.name
    n_prompt = len(fm.tokenizer(PROMPT)["input_ids"])
    assert done.usage.prompt_tokens == n_prompt
    assert done.usage.total_tokens == n_prompt + done.usage.completion_tokens
    assert (choice.finish_reason == "length") == (done.usage.completion_tokens == 12)

    # The official client's stream, and the raw chunks validated one by one.
    streamed = "".join(c.choices[0].text for c in client.completions.create(**params, stream=True) if c.choices)
    assert streamed == choice.text
    events = sse(http, "/v1/completions", {**params, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for chunk in chunks:
        check(chunk, COMPLETION_STREAM_CHUNK)
        assert chunk["id"] == chunks[0]["id"]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == done.usage.model_dump(exclude_none=True)
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is not None]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == choice.finish_reason
    for chunk in chunks[:-1]:
        if chunk["choices"][0]["finish_reason"] is None:
            assert chunk["choices"][0]["text"], "no empty intermediate chunks"
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice.text


def test_chat_plain_and_streamed_agree(client: openai.OpenAI, http: httpx.Client, fm: FixtureModel) -> None:
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "Sort a list in place."}]
    params = {"model": fm.name, "messages": messages, "max_completion_tokens": 10, "temperature": 0}
    raw = client.chat.completions.with_raw_response.create(**params)
    check(json.loads(raw.content), "CreateChatCompletionResponse")
    done = raw.parse()
    msg = done.choices[0].message
    assert done.object == "chat.completion" and msg.role == "assistant"
    templated = fm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert done.usage.prompt_tokens == len(fm.tokenizer(templated, add_special_tokens=False)["input_ids"])
    assert done.usage.completion_tokens <= 10

    stream = client.chat.completions.create(**params, stream=True, stream_options={"include_usage": True})
    parts, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        parts.extend(c.delta.content or "" for c in chunk.choices)
    assert "".join(parts) == msg.content
    assert usage is not None and usage.completion_tokens == done.usage.completion_tokens

    events = sse(http, "/v1/chat/completions", {**params, "stream": True})
    chunks = events[:-1]
    for chunk in chunks:
        check(chunk, "CreateChatCompletionStreamResponse")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == done.choices[0].finish_reason
    assert "usage" not in chunks[-1], "usage only when stream_options.include_usage"


def test_max_tokens_gives_length(client: openai.OpenAI, fm: FixtureModel) -> None:
    done = client.completions.create(model=fm.name, prompt=PROMPT, max_tokens=3, temperature=0)
    if done.choices[0].finish_reason == "length":
        assert done.usage.completion_tokens == 3
    else:  # the model chose to end: allowed, but then it must have ended early
        assert done.usage.completion_tokens < 3
    one = client.completions.create(model=fm.name, prompt=PROMPT, max_tokens=1, temperature=0)
    assert one.usage.completion_tokens <= 1


def test_echo_and_token_id_prompts(client: openai.OpenAI, fm: FixtureModel) -> None:
    ids = fm.tokenizer(PROMPT)["input_ids"]
    by_text = client.completions.create(model=fm.name, prompt=PROMPT, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=fm.name, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    echoed = client.completions.create(model=fm.name, prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + by_text.choices[0].text


def test_seed_makes_sampling_reproducible(client: openai.OpenAI, fm: FixtureModel) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=fm.name, prompt=PROMPT, max_tokens=16, temperature=1.0,
                                         top_p=0.95, seed=seed, extra_body={"top_k": 50}).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert len({sample(s) for s in (1, 2, 3, 4)} | {first}) > 1, "different seeds should not all agree"


# --- stop strings ------------------------------------------------------------------------------


def test_stop_string_split_across_tokens_never_leaks(http: httpx.Client, fm: FixtureModel) -> None:
    base = {"model": fm.name, "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stream": True}
    deltas = [c["choices"][0]["text"] for c in sse(http, "/v1/completions", base)[:-1] if c["choices"]]
    full = "".join(deltas)
    # A stop string made of the end of one streamed delta and the start of the next: it straddles tokens.
    stop = None
    for left, right in zip(deltas[3:], deltas[4:], strict=False):
        candidate = left[-2:] + right[:2]
        if left and right and "\ufffd" not in candidate:
            stop = candidate
            break
    assert stop is not None, f"no token boundary to test in {deltas!r}"
    expected = full[: full.find(stop)]

    for stream in (False, True):
        body = {**base, "stream": stream, "stop": [stop, "never-produced-\u2603"]}
        if stream:
            chunks = [c for c in sse(http, "/v1/completions", body)[:-1] if c["choices"]]
            text = "".join(c["choices"][0]["text"] for c in chunks)
            finish = chunks[-1]["choices"][0]["finish_reason"]
        else:
            r = http.post("/v1/completions", json=body)
            check(r.json(), "CreateCompletionResponse")
            text, finish = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
        assert text == expected and stop not in text
        assert finish == "stop"


def test_chat_stop_string(client: openai.OpenAI, fm: FixtureModel) -> None:
    params = {"model": fm.name, "messages": [{"role": "user", "content": "Write a loop."}], "temperature": 0,
              "max_tokens": 30}
    full = client.chat.completions.create(**params).choices[0].message.content
    assert len(full) > 6
    stop = full[4:7]
    cut = client.chat.completions.create(**params, stop=stop)
    assert cut.choices[0].message.content == full[: full.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_detokenizer_handles_split_characters(fm: FixtureModel) -> None:
    text = "naïve café — ✓ 日本語 🚀 done"
    ids = fm.tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(fm.tokenizer, [])
    deltas = [detok.add([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    pieces = [fm.tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "the test needs a character split across byte tokens"


def test_output_text_cuts_stop_string_straddling_tokens(fm: FixtureModel) -> None:
    text = "x = compute(a, b)\n\nreturn x\n"
    ids = fm.tokenizer(text, add_special_tokens=False)["input_ids"]
    stop = ")\n\nret"
    assert not any(stop in fm.tokenizer.decode([i]) for i in ids), "stop must span tokens"
    out = OutputText(fm.tokenizer, [], [stop])
    emitted = ""
    for i in ids:
        emitted += out.add_tokens([i])
        assert stop not in emitted and not emitted.endswith(")\n"), "held back until disproved"
        if out.stopped:
            break
    assert out.stopped and emitted == "x = compute(a, b"
    # Without a match, held-back text comes out at the end.
    out = OutputText(fm.tokenizer, [], ["b)\n\nz"])
    emitted = "".join(out.add_tokens([i]) for i in ids) + out.finish()
    assert emitted == text and not out.stopped


def test_stop_string_matcher() -> None:
    m = StopStringMatcher(["END", "xy"])
    assert m.push("abcE") == ("abc", False)
    assert m.push("N") == ("", False)
    assert m.push("Dtail") == ("", True)
    m = StopStringMatcher(["bcd", "cx"])
    assert m.push("abc") == ("a", False)  # "bc" could start "bcd"
    assert m.push("x") == ("b", True)  # "cx" matched: the held-back "b" is released, "c" is not
    m = StopStringMatcher(["\n\n"])
    assert m.push("a\n") == ("a", False)
    assert m.push("b") == ("\nb", False)
    assert m.flush() == ""


# --- errors, all in OpenAI's format --------------------------------------------------------------


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"model": "M", "prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"model": "M", "prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"model": "M", "prompt": "x", "temperature": 5}, "temperature"),
    ("/v1/completions", {"model": "M", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": "M", "prompt": "x", "top_p": 1.5}, "top_p"),  # top_p 0 is greedy: accepted
    ("/v1/completions", {"model": "M", "prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"model": "M", "prompt": [1, 10**9]}, "prompt"),
    ("/v1/completions", {"model": "M", "prompt": 5}, "prompt"),  # no prompt: a new document (accepted)
    ("/v1/completions", {"prompt": "x"}, "model"),
    ("/v1/completions", {"model": "M", "prompt": "x", "stream_options": {"include_usage": True}},
     "stream_options"),
    ("/v1/chat/completions", {"model": "M", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "wizard", "content": "x"}]}, None),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}], "n": 129}, "n"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "x", "schema": {"type": "objekt"}}}}, "response_format"),
    ("/v1/completions", {"model": "M", "prompt": "x", "guided_regex": "(unclosed"}, "guided_regex"),
    ("/v1/completions", {"model": "M", "prompt": "x", "guided_choice": ["a"], "min_tokens": 2}, "min_tokens"),
    ("/v1/completions", {"model": "M", "prompt": "x", "guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
    ("/v1/completions", {"model": "M", "prompt": "x", "guided_choice": ["a"]}, "guided_choice"),  # the fixture
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f", "description": "\ud800"}}]}, "tools"),
    ("/v1/chat/completions", {"model": "M", "messages": [  # a tool result must say which call it answers
        {"role": "user", "content": "x"}, {"role": "tool", "content": "42"}]}, "messages"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}], "tool_choice": {
        "type": "function", "function": {"name": "g"}}, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
     "tools"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "web_search"}]}, "tools"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, None),
])
def test_bad_bodies_are_400(http: httpx.Client, fm: FixtureModel, path: str, body: dict, param: str | None) -> None:
    body = {**body, "model": fm.name} if "model" in body else body
    # ASCII JSON, as most clients send: a lone surrogate travels as its \ud800 escape
    err = check_error(http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"}),
                      400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] is not None and err["param"].split(".")[0] == param, err


def test_malformed_json_and_wrong_methods(http: httpx.Client) -> None:
    check_error(http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
                400)
    check_error(http.post("/v1/chat/completions", content=b"[1, 2]", headers={"content-type": "application/json"}),
                400)
    check_error(http.get("/v1/completions"), 405)
    check_error(http.get("/v1/nothing-here"), 404)


def test_official_client_sees_typed_errors(client: openai.OpenAI, fm: FixtureModel) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=fm.name, prompt="x", best_of=2)
    assert bad.value.code == "unsupported_parameter"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.code == "model_not_found"


def test_context_length(client: openai.OpenAI, http: httpx.Client, fm: FixtureModel) -> None:
    limit = fm.engine.max_context
    ids = fm.tokenizer(PROMPT)["input_ids"]
    long_ids = (ids * (limit // len(ids) + 2))[: limit + 5]
    err = check_error(http.post("/v1/completions", json={"model": fm.name, "prompt": long_ids}), 400,
                      "context_length_exceeded")
    assert str(limit) in err["message"]
    near = long_ids[: limit - 10]
    check_error(http.post("/v1/completions", json={"model": fm.name, "prompt": near, "max_tokens": 11}), 400,
                "context_length_exceeded")
    # max_tokens not given: generation is capped to what fits.
    fits = client.completions.create(model=fm.name, prompt=long_ids[: limit - 3], temperature=0)
    assert fits.usage.completion_tokens <= 3
    assert fits.usage.prompt_tokens + fits.usage.completion_tokens <= limit
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=fm.name, messages=[{"role": "user", "content": "y " * (limit * 2)}])
    assert exc.value.code == "context_length_exceeded"


def test_not_ready_is_503_but_alive(fm: FixtureModel) -> None:
    engine = sibling_engine(fm)
    engine.ready = False
    with serve(create_app(engine, fm.tokenizer, served_model_name=fm.name)) as base, httpx.Client(base_url=base) as h:
        assert h.get("/health").status_code == 200
        check_error(h.get("/ready"), 503, "not_ready")
        check_error(h.post("/v1/completions", json={"model": fm.name, "prompt": "x", "max_tokens": 2}), 503)
        engine.ready = True
        assert h.get("/ready").status_code == 200
        assert h.post("/v1/completions", json={"model": fm.name, "prompt": "x", "max_tokens": 2}).status_code == 200


def test_overloaded_engine_is_429(fm: FixtureModel) -> None:
    engine = sibling_engine(fm, max_sessions=0)
    with serve(create_app(engine, fm.tokenizer, served_model_name=fm.name)) as base:
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError) as exc:
            c.completions.create(model=fm.name, prompt="x", max_tokens=2, stream=True)
        assert exc.value.status_code == 429 and exc.value.code == "overloaded"
        assert int(exc.value.response.headers["retry-after"]) >= 1
        check(exc.value.response.json(), "ErrorResponse")


def test_api_key(fm: FixtureModel) -> None:
    app = create_app(fm.engine, fm.tokenizer, served_model_name=fm.name, api_key="s3cret")
    with serve(app) as base, httpx.Client(base_url=base) as h:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            err = check_error(h.get("/v1/models", headers=headers), 401, "invalid_api_key")
            assert "s3cret" not in err["message"]
        body = {"model": fm.name, "prompt": "x", "max_tokens": 2}
        check_error(h.post("/v1/completions", json=body), 401)
        for path in ("/health", "/ready", "/metrics"):
            assert h.get(path).status_code == 200, path
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=base + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(**body).usage.prompt_tokens >= 1


def test_body_size_limit(fm: FixtureModel) -> None:
    app = create_app(fm.engine, fm.tokenizer, served_model_name=fm.name, max_body_bytes=4096)
    with serve(app) as base, httpx.Client(base_url=base) as h:
        big = {"model": fm.name, "prompt": "x" * 5000, "max_tokens": 1}
        check_error(h.post("/v1/completions", json=big), 413, "request_too_large")  # by Content-Length

        payload = json.dumps(big).encode()

        def chunked() -> Iterator[bytes]:  # no Content-Length: the received bytes are counted
            for i in range(0, len(payload), 1000):
                yield payload[i:i + 1000]

        r = h.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
        assert "content-length" not in r.request.headers
        check_error(r, 413, "request_too_large")
        small = {"model": fm.name, "prompt": "x" * 100, "max_tokens": 1}
        assert h.post("/v1/completions", json=small).status_code == 200
        ok_chunked = json.dumps(small).encode()
        assert h.post("/v1/completions", content=iter([ok_chunked[:50], ok_chunked[50:]]),
                      headers={"content-type": "application/json"}).status_code == 200


# --- concurrency and cancellation ----------------------------------------------------------------


def test_concurrent_requests_interleave_and_stay_correct(client: openai.OpenAI, url: str, fm: FixtureModel) -> None:
    prompts = [f"def task_{i}(x):\n    return x" + " +" * i for i in range(6)]
    expected = [client.completions.create(model=fm.name, prompt=p, max_tokens=24, temperature=0).choices[0].text
                for p in prompts]
    fm.engine.peak_sessions = 0

    async def one(c: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await c.completions.create(model=fm.name, prompt=prompt, max_tokens=24, temperature=0, stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def all_at_once() -> list[str]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    assert asyncio.run(all_at_once()) == expected
    assert fm.engine.peak_sessions >= 2, "requests did not overlap in the engine"
    assert fm.engine.open_sessions == 0


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_client_disconnect_releases_the_engine_session(fm: FixtureModel) -> None:
    engine = sibling_engine(fm, step_delay_s=0.05)  # 200 tokens would take > 10 s
    with serve(create_app(engine, fm.tokenizer, served_model_name=fm.name)) as base, \
            httpx.Client(base_url=base, timeout=30) as h:
        body = {"model": fm.name, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True}
        with h.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = json.loads(next(line for line in lines if line)[len("data: "):])
            assert wait_for(lambda: engine.open_sessions == 1)
        # The response is closed after one chunk: the engine iterator must be closed promptly.
        assert wait_for(lambda: engine.open_sessions == 0), "stream session leaked"
        assert engine.released[first["id"]] < 50

        # Non-streamed: the client gives up (timeout) and the server cancels the generation.
        with pytest.raises(httpx.ReadTimeout):
            h.post("/v1/completions", json={**body, "stream": False}, timeout=0.5)
        assert wait_for(lambda: engine.open_sessions == 0), "non-stream session leaked"
        assert len(engine.released) == 2 and max(engine.released.values()) < 50


def test_tiny_temperature_is_greedy(client: openai.OpenAI, fm: FixtureModel) -> None:
    # Found by the fuzzer: logits / 1e-300 overflow; such temperatures mean greedy.
    greedy = client.completions.create(model=fm.name, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    tiny = client.completions.create(model=fm.name, prompt=PROMPT, max_tokens=8, temperature=1e-300)
    assert tiny.choices[0].text == greedy


def test_oversized_requests_do_not_disturb_a_running_stream(fm: FixtureModel) -> None:
    engine = sibling_engine(fm, step_delay_s=0.01)
    app = create_app(engine, fm.tokenizer, served_model_name=fm.name, max_body_bytes=64 * 1024)
    body = {"model": fm.name, "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
    with serve(app) as base, httpx.Client(base_url=base, timeout=60) as h:
        expected = h.post("/v1/completions", json=body).json()["choices"][0]["text"]
        with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            parts = [json.loads(next(line for line in lines if line)[6:])["choices"][0]["text"]]
            with httpx.Client(base_url=base, timeout=60) as other:
                check_error(other.post("/v1/completions", json={**body, "prompt": "y" * 70_000}), 413)
                check_error(other.post("/v1/completions", json={**body, "prompt": "y " * 5000}), 400,
                            "context_length_exceeded")
            for line in lines:
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    parts += [c["text"] for c in chunk["choices"]]
        assert "".join(parts) == expected
        assert engine.open_sessions == 0


def test_engine_failure_mid_generation(fm: FixtureModel) -> None:
    engine = sibling_engine(fm, fail_after_tokens=3)
    with serve(create_app(engine, fm.tokenizer, served_model_name=fm.name)) as base, \
            httpx.Client(base_url=base, timeout=60) as h:
        body = {"model": fm.name, "prompt": PROMPT, "max_tokens": 20, "temperature": 0}
        err = check_error(h.post("/v1/completions", json=body), 500)
        assert err["type"] == "server_error" and "stage 1 was lost" in err["message"]
        # Streamed: the headers are already sent, so the error arrives in-band, then [DONE].
        events = sse(h, "/v1/completions", {**body, "stream": True})
        assert events[-1] == "[DONE]"
        check(events[-2], "ErrorResponse")
        assert "stage 1 was lost" in events[-2]["error"]["message"]
        for chunk in events[:-2]:
            check(chunk, COMPLETION_STREAM_CHUNK)
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIError, match="stage 1 was lost"):
            for _ in client.completions.create(**body, stream=True):
                pass
        assert engine.open_sessions == 0
