"""The agent surface as the clients people bring use it, and as a hostile one does: through
`inferencemesh serve --model DIR` on a copy of the bundled model whose chat template hides a
render bomb (nested loops, only for one trigger message), float32, one serve for the module.

- Responses: a function tool that does not say `strict` is made strict where it can be, else
  taken non-strict (LangChain's tools never say); never refused for it.
- A call cut by the length limit: its arguments hold only what the model wrote inside the call,
  never the wrapper's markup, whole, streamed and in Responses; a call cut before its arguments
  is never content.
- A history holding such a call (any string as arguments) is accepted and rendered as given.
- usage reports the prefix cache's hits (chat, completions, Responses), as /metrics counts them.
- A non-strict json_schema's objects are closed, as tool arguments are.
- A Response cut by the context window (no max_output_tokens) does not claim max_output_tokens.
- A 4xx is logged with its status, parameter and reason.
- A chat template that loops without bound costs one clear error, never a worker thread.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from hostile import assert_unharmed
from mesh_helpers import serving
from openai import OpenAI
from openai_spec import errors
from transformers import AutoTokenizer

from inferencemesh.bundled import resolve_model
from inferencemesh.frontend.openai.jobs import END_OF_TURN_TOKENS
from inferencemesh.frontend.openai.text.tool_calls import CALL_CLOSE, CALL_OPEN

pytestmark = pytest.mark.slow

MODEL = "imesh-code-target"  # the copy keeps the bundled name: hostile.py's innocent request uses it
MAX_SESSIONS = 4  # mesh_helpers.serving's
BOMB = "render bomb"  # the one message content the template loops on
BOMB_TEMPLATE = ("{%- if messages[0]['content'] == '" + BOMB + "' %}{%- for a in range(100000) %}"
                 "{%- for b in range(100000) %}{%- endfor %}{%- endfor %}{%- endif %}")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


class Served:
    def __init__(self, base: str, lines: list[str], model_dir: Path) -> None:
        self.base, self.lines = base, lines
        self.client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.base}{path}", json={"model": MODEL, **body}, timeout=120)

    def stream(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        with httpx.stream("POST", f"{self.base}{path}", json={"model": MODEL, **body, "stream": True},
                          timeout=120) as response:
            assert response.status_code == 200, response.read()
            return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]

    def counter(self, name: str) -> float:
        text = httpx.get(f"{self.base}/metrics", timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model_dir = tmp_path_factory.mktemp("model") / MODEL
    shutil.copytree(resolve_model(None), model_dir)
    template = model_dir / "chat_template.jinja"
    template.write_text(BOMB_TEMPLATE + template.read_text())
    with serving("--model", str(model_dir), "--dtype", "float32", "--speculative", "none") as (base, _, lines):
        yield Served(base, lines, model_dir)


def check(body: Any, schema: str) -> None:
    problems = errors(body, schema)
    assert not problems, f"{schema}: {problems}\n{json.dumps(body)[:2000]}"


# --- 10: Responses' strict default ---------------------------------------------------------------


def test_a_responses_tool_without_strict_is_strict_where_it_can_be(served: Served) -> None:
    optional = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                 "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}
    for parameters, strict in ((WEATHER, True), (optional, False)):
        response = served.post("/v1/responses", {
            "input": "What is the weather in Paris?", "temperature": 0, "max_output_tokens": 40,
            "tools": [{"type": "function", "name": "get_weather", "parameters": parameters}],
            "tool_choice": "required"})
        assert response.status_code == 200, response.text
        body = response.json()
        check(body, "Response")
        assert body["tools"][0]["strict"] is strict
        assert body["tools"][0]["parameters"].get("additionalProperties") is (False if strict else None)
        (call,) = [item for item in body["output"] if item["type"] == "function_call"]
        jsonschema.validate(json.loads(call["arguments"]), {**parameters, "additionalProperties": False})


def test_langchain_tools_work_over_responses(served: Served) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    llm = ChatOpenAI(model=MODEL, base_url=f"{served.base}/v1", api_key="unused", temperature=0,
                     max_tokens=40, max_retries=0, use_responses_api=True)
    answer = llm.bind_tools([get_weather], tool_choice="required").invoke("What is the weather in Paris?")
    assert [call["name"] for call in answer.tool_calls] == ["get_weather"]
    assert isinstance(answer.tool_calls[0]["args"]["city"], str)


# --- 11: a call cut by the length limit ----------------------------------------------------------


def written(served: Served, body: dict[str, Any]) -> list[str]:
    """The tokens the model wrote for this chat request (markup included), from their logprobs."""
    answer = served.post("/v1/chat/completions", {**body, "logprobs": True}).json()
    return [entry["token"] for entry in answer["choices"][0]["logprobs"]["content"]]


def streamed_calls(chunks: list[dict[str, Any]]) -> tuple[str, dict[int, dict[str, str]], str | None]:
    content, calls, finish = "", {}, None
    for chunk in chunks:
        check(chunk, "CreateChatCompletionStreamResponse")
        for choice in chunk["choices"]:
            content += choice["delta"].get("content") or ""
            finish = choice["finish_reason"] or finish
            for fragment in choice["delta"].get("tool_calls") or []:
                call = calls.setdefault(fragment["index"], {"name": "", "arguments": ""})
                call["name"] += fragment["function"].get("name") or ""
                call["arguments"] += fragment["function"].get("arguments") or ""
    return content, calls, finish


def cut_answers(served: Served, body: dict[str, Any]) -> list[tuple[str, list[dict[str, str]], str]]:
    """(content, calls, finish reason) of the chat request whole and streamed."""
    whole = served.post("/v1/chat/completions", body).json()
    check(whole, "CreateChatCompletionResponse")
    message = whole["choices"][0]["message"]
    answers = [(message["content"] or "", [c["function"] for c in message.get("tool_calls") or []],
                whole["choices"][0]["finish_reason"])]
    content, calls, finish = streamed_calls(served.stream("/v1/chat/completions", body))
    return [*answers, (content, [calls[i] for i in sorted(calls)], finish or "")]


def cut_response(served: Served, body: dict[str, Any]) -> dict[str, Any]:
    """The same request as a Response, streamed: its final Response (its events checked)."""
    response = served.post("/v1/responses", {
        "input": body["messages"][-1]["content"], "temperature": 0, "max_output_tokens": body["max_tokens"],
        "stream": True, "tool_choice": {"type": "function", "name": "get_weather"},
        "tools": [{"type": "function", **tool["function"], "strict": False} for tool in body["tools"]]})
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
    for event in events:
        check(event, "ResponseStreamEvent")
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    final = events[-1]["response"]
    (call,) = [item for item in final["output"] if item["type"] == "function_call"]
    assert call["arguments"] == streamed
    return final


def test_a_call_cut_short_holds_only_what_the_model_wrote_inside_it(served: Served) -> None:
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": NAMED, "temperature": 0, "max_tokens": 80}
    tokens = written(served, body)
    text = "".join(tokens)
    assert text.startswith(CALL_OPEN) and text.endswith(CALL_CLOSE), text
    arguments = text[text.index('"arguments": ') + len('"arguments": '):-len(CALL_CLOSE)]
    head = len(text) - len(CALL_CLOSE) - len(arguments)
    # a cut inside the arguments, and every cut from their last token to just before the call's last
    cuts = [k for k in range(1, len(tokens)) if len("".join(tokens[:k])) > head + 1]
    assert len(cuts) >= 8
    cuts = cuts[:1] + cuts[-8:]
    for k in cuts:
        expected = "".join(tokens[:k])[head:head + len(arguments)]
        for content, calls, finish in cut_answers(served, {**body, "max_tokens": k}):
            assert (content, finish) == ("", "length"), (k, content)
            assert [call["name"] for call in calls] == ["get_weather"], (k, calls)
            assert calls[0]["arguments"] == expected, (k, calls)
            if len(expected) == len(arguments):
                json.loads(calls[0]["arguments"])  # whole: no "Extra data"
        # Responses renders its tools a little differently (strict is said): its own output, no markup
        response = cut_response(served, {**body, "max_tokens": k})
        assert response["status"] == "incomplete"
        assert [item["type"] for item in response["output"]] == ["function_call"]
        assert not re.search(r"\n|</?tool|\}\}$", response["output"][0]["arguments"]), response["output"]
    assert_unharmed(served.base, MAX_SESSIONS)


def test_a_second_call_cut_before_its_arguments_is_never_content(served: Served) -> None:
    vocab = served.tokenizer.get_vocab()
    ends = {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab} | {served.tokenizer.eos_token_id}
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 0, "max_tokens": 80,
            "logit_bias": {str(t): -100 for t in ends}}  # the turn cannot end: a second call follows the first
    tokens = written(served, body)
    second = "".join(tokens).index(CALL_CLOSE) + len(CALL_CLOSE) + len("\n" + CALL_OPEN + '{"name": "get_')
    k = next(k for k in range(len(tokens)) if len("".join(tokens[:k])) >= second)  # inside the second's name
    for content, calls, finish in cut_answers(served, {**body, "max_tokens": k}):
        assert content == "" and finish == "length", content
        assert [call["name"] for call in calls] == ["get_weather"]
        json.loads(calls[0]["arguments"])
    assert_unharmed(served.base, MAX_SESSIONS)


# --- 12: a history holding a call cut short ------------------------------------------------------


@pytest.mark.parametrize("arguments", ['{"city": "Pa', '{"city": "C"}}\n</tool_call', "not json at all",
                                       '{"city": "\\ud800"}'])  # JSON, but not of valid Unicode: as given
def test_a_history_with_a_call_cut_short_is_accepted_as_given(served: Served, arguments: str) -> None:
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    answer = served.client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                                   temperature=0, max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    tokens = served.post("/tokenize", {"messages": history, "tools": TOOLS}).json()["tokens"]
    prompt = served.post("/detokenize", {"tokens": tokens}).json()["prompt"]
    assert f'"arguments": {arguments}}}' in prompt  # rendered into the prompt as given
    response = served.client.responses.create(model=MODEL, temperature=0, max_output_tokens=8, input=[
        {"type": "message", "role": "user", "content": ASK[0]["content"]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": arguments},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    assert response.status in ("completed", "incomplete")
    assert_unharmed(served.base, MAX_SESSIONS)


# --- 13: the prefix cache's hits in usage ----------------------------------------------------------


def test_usage_reports_the_prefix_cache_hits(served: Served) -> None:
    hits = "inferencemesh_prefix_cache_hits_total"
    messages = [{"role": "system", "content": "You are a terse assistant. " * 8},
                {"role": "user", "content": f"Say something about caching ({time.time()})."}]  # new to the cache
    chat = {"messages": messages, "temperature": 0, "max_tokens": 4}
    before = served.counter(hits)
    first = served.post("/v1/chat/completions", chat).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == served.counter(hits) - before
    before = served.counter(hits)
    again = served.post("/v1/chat/completions", chat).json()
    check(again, "CreateChatCompletionResponse")
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < again["usage"]["prompt_tokens"] and cached == served.counter(hits) - before

    before = served.counter(hits)
    chunks = served.stream("/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}})
    check(chunks[-1], "CreateChatCompletionStreamResponse")
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == served.counter(hits) - before > 0

    prompt = {"prompt": f"def cached_{int(time.time())}(a, b):\n    return a + b\n" * 4, "temperature": 0,
              "max_tokens": 4}
    served.post("/v1/completions", prompt)
    before = served.counter(hits)
    completion = served.post("/v1/completions", prompt).json()
    check(completion, "CreateCompletionResponse")
    assert completion["usage"]["prompt_tokens_details"]["cached_tokens"] == served.counter(hits) - before > 0

    before = served.counter(hits)
    response = served.post("/v1/responses", {"input": messages, "temperature": 0, "max_output_tokens": 4}).json()
    check(response, "Response")
    assert response["usage"]["input_tokens_details"]["cached_tokens"] == served.counter(hits) - before > 0


# --- 14: non-strict json_schema ----------------------------------------------------------------


def test_a_non_strict_json_schema_is_closed_and_ends(served: Served) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "port": {"type": "integer", "minimum": 1, "maximum": 65535}},
              "required": ["name", "port"]}
    for temperature in (0, 1):
        answer = served.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "A service config as JSON."}], max_tokens=60,
            temperature=temperature, seed=3,
            response_format={"type": "json_schema", "json_schema": {"name": "service", "schema": schema}})
        assert answer.choices[0].finish_reason == "stop", answer.choices[0].message.content
        jsonschema.validate(json.loads(answer.choices[0].message.content or ""),
                            {**schema, "additionalProperties": False})


# --- 15: an honest incomplete reason, 4xx in the log ----------------------------------------------


def test_a_response_cut_by_the_context_does_not_claim_max_output_tokens(served: Served) -> None:
    limit = served.client.models.list().data[0].max_model_len
    filler = "x = 1\n" * 10

    def room(user: str) -> int:
        return limit - served.post("/tokenize", {"messages": [{"role": "user", "content": user}]}).json()["count"]

    per_filler = room(filler) - room(filler * 2)
    user = filler * ((room(filler) - 24) // per_filler + 1)
    while room(user) < 8:
        user = user[len(filler):]
    assert room(user) < 60  # tokens of room: far fewer than the schema's string needs
    text = {"format": {"type": "json_schema", "name": "long", "strict": True, "schema": {
        "type": "object", "properties": {"s": {"type": "string", "minLength": 1000}}, "required": ["s"],
        "additionalProperties": False}}}
    response = served.post("/v1/responses", {"input": user, "temperature": 0, "text": text}).json()
    check(response, "Response")
    assert response["status"] == "incomplete" and response["max_output_tokens"] is None
    assert response["incomplete_details"].get("reason") != "max_output_tokens"
    limited = served.post("/v1/responses", {"input": "hello", "temperature": 0, "text": text,
                                            "max_output_tokens": 5}).json()
    assert limited["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_4xx_is_logged_with_its_parameter_and_reason(served: Served) -> None:
    refused = served.post("/v1/chat/completions", {"messages": ASK, "temperature": "hot"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "temperature"
    deadline = time.monotonic() + 5
    while not any(re.search(r"answered 400 .*\(param temperature\): '.*temperature", line) for line in served.lines):
        assert time.monotonic() < deadline, "".join(served.lines[-20:])
        time.sleep(0.1)


# --- 8: a chat template that loops without bound ----------------------------------------------------


def test_a_chat_template_that_never_ends_is_stopped(served: Served) -> None:
    started = time.monotonic()
    bomb = served.post("/v1/chat/completions", {"messages": [{"role": "user", "content": BOMB}], "max_tokens": 4})
    assert bomb.status_code == 500 and bomb.json()["error"]["code"] == "chat_template_error", bomb.text
    assert time.monotonic() - started < 10
    check(bomb.json(), "ErrorResponse")
    assert_unharmed(served.base, MAX_SESSIONS)
