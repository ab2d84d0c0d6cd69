"""OpenAI's Responses API (POST /v1/responses): the request's conversion to the chat request that
asks the same (OpenAI's chat shapes, tool calls included), the shaper's Response objects and
streamed events from synthetic pieces (text and tool calls, checked against OpenAI's spec), and,
through `inferencemesh serve` (two stages, draft speculation) and the official openai client:
plain and item input, streams, structured output, the length limit, the same greedy text as
/v1/chat/completions, and every refused parameter a 400 naming it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Annotated, Any

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mesh_helpers import serving
from openai import OpenAI
from openai_spec import errors
from pydantic import BaseModel, Field

from inferencemesh.frontend.engine.api import GenerationRequest
from inferencemesh.frontend.openai.choices import ChoiceState
from inferencemesh.frontend.openai.errors import APIError
from inferencemesh.frontend.openai.jobs import Job
from inferencemesh.frontend.openai.logprobs import LogprobsFormatter
from inferencemesh.frontend.openai.responses.protocol import CreateResponseRequest
from inferencemesh.frontend.openai.responses.shaper import ResponsesShaper
from inferencemesh.frontend.openai.responses.to_chat import to_chat
from inferencemesh.frontend.openai.text.pieces import Piece
from inferencemesh.frontend.openai.text.tool_calls import ToolCallDelta

MODEL = "m"


def check(body: object, schema: str) -> None:
    problems = errors(body, schema)
    assert not problems, f"{schema}: {problems}\n{json.dumps(body)[:2000]}"


# Each streamed event's own schema (ResponseStreamEvent is an anyOf of them: checked too).
EVENT_SCHEMAS = {
    "response.created": "ResponseCreatedEvent", "response.in_progress": "ResponseInProgressEvent",
    "response.output_item.added": "ResponseOutputItemAddedEvent",
    "response.output_item.done": "ResponseOutputItemDoneEvent",
    "response.content_part.added": "ResponseContentPartAddedEvent",
    "response.content_part.done": "ResponseContentPartDoneEvent",
    "response.output_text.delta": "ResponseTextDeltaEvent", "response.output_text.done": "ResponseTextDoneEvent",
    "response.function_call_arguments.delta": "ResponseFunctionCallArgumentsDeltaEvent",
    "response.function_call_arguments.done": "ResponseFunctionCallArgumentsDoneEvent",
    "response.completed": "ResponseCompletedEvent", "response.incomplete": "ResponseIncompleteEvent",
    "response.failed": "ResponseFailedEvent", "error": "ResponseErrorEvent",
}


def parse_events(text: str) -> list[dict[str, Any]]:
    """The events of a Responses stream, each checked: `event:` names its data's type, the data
    matches the spec, sequence numbers count from 0, and there is no [DONE]."""
    events = []
    for block in text.split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        assert lines[0].startswith("event: ") and lines[1].startswith("data: ") and len(lines) == 2, block
        event = json.loads(lines[1][len("data: "):])
        assert event["type"] == lines[0][len("event: "):]
        check(event, "ResponseStreamEvent")
        check(event, EVENT_SCHEMAS[event["type"]])
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


# --- the request's conversion (no server) -----------------------------------------------------


def convert(**body: Any) -> dict[str, Any]:
    request = CreateResponseRequest.model_validate_json(json.dumps({"model": MODEL, **body}))
    return to_chat(request).chat.model_dump(exclude_none=True)


def refused(**body: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        convert(**body)
    assert caught.value.status == 400
    return caught.value


def test_string_input_and_instructions_become_chat_messages() -> None:
    chat = convert(input="Hello", instructions="Be brief.", max_output_tokens=7, temperature=0.5, top_p=0.9,
                   user="u1", stream=True)
    assert chat["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert (chat["max_completion_tokens"], chat["temperature"], chat["top_p"], chat["stream"], chat["user"]) == \
        (7, 0.5, 0.9, True, "u1")


def test_items_become_chat_messages_with_tool_calls_in_openai_chat_shape() -> None:
    chat = convert(input=[
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                        {"type": "input_text", "text": "Paris and Rome?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking.",
                                                              "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "id": "fc_2", "call_id": "call_2", "name": "weather",
         "arguments": '{"city":"Rome"}', "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "21C"}]},
        {"type": "function_call", "call_id": "call_3", "name": "clock", "arguments": "{}"},
    ])
    call = {"type": "function"}
    assert chat["messages"] == [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {**call, "id": "call_1", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}},
            {**call, "id": "call_2", "function": {"name": "weather", "arguments": '{"city":"Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "21C"},
        {"role": "assistant", "tool_calls": [
            {**call, "id": "call_3", "function": {"name": "clock", "arguments": "{}"}}]},
    ]


def test_tools_tool_choice_and_text_format_become_chat_fields() -> None:
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    chat = convert(input="x", tools=[{"type": "function", "name": "weather", "description": "Weather now.",
                                      "parameters": params}, {"type": "function", "name": "clock", "strict": False}],
                   tool_choice={"type": "function", "name": "weather"}, parallel_tool_calls=False)
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "weather", "description": "Weather now.", "parameters": params,
                                          "strict": True}},  # Responses' default: strict
        {"type": "function", "function": {"name": "clock", "strict": False}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert chat["parallel_tool_calls"] is False
    assert convert(input="x", tool_choice="required")["tool_choice"] == "required"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    chat = convert(input="x", text={"format": {"type": "json_schema", "name": "s", "schema": schema, "strict": True}})
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "s", "schema": schema,
                                                                              "strict": True}}
    assert convert(input="x", text={"format": {"type": "json_object"}})["response_format"] == {"type": "json_object"}
    assert "response_format" not in convert(input="x", text={"format": {"type": "text"}})


def test_a_tool_that_does_not_say_strict_is_strict_where_its_schema_can_be() -> None:
    """OpenAI's rule (LangChain's tools never say strict): closing the objects is all a strict
    schema may lack; with an optional property it cannot be strict, and is taken non-strict."""
    open_ = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    optional = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                "required": ["city"]}
    tools = [{"type": "function", "name": "weather", "parameters": open_},
             {"type": "function", "name": "weather2", "parameters": optional},
             {"type": "function", "name": "clock"}]
    chat = convert(input="x", tools=tools)
    closed = {**open_, "additionalProperties": False}
    assert [t["function"] for t in chat["tools"]] == [
        {"name": "weather", "parameters": closed, "strict": True},
        {"name": "weather2", "parameters": optional, "strict": False},
        {"name": "clock", "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
         "strict": True}]
    echoed = CreateResponseRequest.model_validate_json(json.dumps({"model": MODEL, "input": "x", "tools": tools}))
    assert [(t["parameters"], t["strict"]) for t in echoed.echo()["tools"]] == [
        (closed, True), (optional, False), ({"type": "object", "properties": {}, "additionalProperties": False}, True)]


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"type": "reasoning", "id": "r", "summary": []}]}, "input.0.type"),
    ({"input": ["hi", {"type": "item_reference", "id": "msg_1"}]}, None),  # not an object: pydantic's 400
    ({"input": [{"role": "user", "content": "a"}, {"type": "item_reference", "id": "msg_1"}]}, "input.1.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.content.0.type"),
    ({"input": [{"role": "tool", "content": "a"}]}, "input.0.role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
    ({"input": []}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}, {"type": "file_search"}]}, "tools.1.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
])
def test_unservable_input_is_a_400_naming_it(body: dict[str, Any], param: str | None) -> None:
    if param is None:
        with pytest.raises(Exception):  # noqa: B017 - pydantic's ValidationError: FastAPI answers it with a 400
            convert(**body)
        return
    assert refused(**body).param == param


def test_chat_parameters_are_named_as_the_request_has_them() -> None:
    """An error found once the request is a chat request (the prompt's length, the schema,
    main's tool checks) names the Responses parameter, not the chat one."""
    request = CreateResponseRequest.model_validate_json(json.dumps({"model": MODEL, "instructions": "i", "input": [
        {"role": "user", "content": "a"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"}]}))
    name = to_chat(request).responses_param
    assert [name(f"messages.{i}") for i in range(4)] == ["instructions", "input.0", "input.1", "input.3"]
    assert name("messages.2.tool_calls.1.function.arguments") == "input.1"  # the turn's first call
    assert (name("messages"), name("messages.9"), name(None)) == ("input", "input", None)
    assert name("response_format.json_schema.schema") == "text.format.schema"
    assert name("response_format") == "text.format"
    assert name("max_completion_tokens") == "max_output_tokens"
    assert name("tools.1.function.parameters") == "tools.1.parameters"
    assert name("tool_choice.function.name") == "tool_choice.name"
    assert name("temperature") == "temperature"


def test_developer_and_refusal_parts_are_text() -> None:
    chat = convert(input=[{"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]}])
    assert chat["messages"] == [{"role": "assistant", "content": "No."}]


# --- the shaper, from synthetic pieces (no server) ---------------------------------------------


def make_job(finish_reason: str, **echo: Any) -> tuple[ResponsesShaper, Any]:
    """A shaper and a choice that ended for finish_reason after 9 tokens (its job and its state,
    as a ChoiceRun has them), of a request with these settings."""
    shaper = ResponsesShaper(LogprobsFormatter(None))  # type: ignore[arg-type]  # no logprobs here
    body = CreateResponseRequest.model_validate_json(json.dumps({"model": MODEL, "input": "x", **echo}))
    job = Job("response", "resp_test", int(time.time()), MODEL, [1, 2, 3], GenerationRequest("r", [1, 2, 3], 16),
              [], True, False, 0.0, echoed=body.echo())
    return shaper, SimpleNamespace(job=job, state=ChoiceState(finish_reason=finish_reason, completion_tokens=9))


TOOL_PIECES = [
    Piece("I will check ", [1], None), Piece("both.", [2], None),
    Piece("", [3], None, [ToolCallDelta(0, id="call_a", name="weather")]),
    Piece("", [4], None, [ToolCallDelta(0, arguments='{"city":')]),
    Piece("", [5], None, [ToolCallDelta(0, arguments='"Paris"}'), ToolCallDelta(1, '{"city":"Rome"}', "call_b",
                                                                                "weather")]),
]
TOOLS = [{"type": "function", "name": "weather", "parameters": {"type": "object"}, "description": "w"}]


def stream_of(shaper: ResponsesShaper, run: Any, pieces: list[Piece]) -> list[dict[str, Any]]:
    """The events a stream of these pieces sends, as serving.py sends them."""
    job, state = run.job, run.state
    text = "".join(shaper.chunk(job, state, opening) for opening in shaper.opening(run))
    for piece in pieces:
        text += shaper.chunk(job, state, shaper.delta(run, piece))
    text += shaper.chunk(job, state, shaper.closing(run))
    text += "".join(shaper.stream_end([run], {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}))
    return parse_events(text)


def without_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


def test_function_calls_in_a_response() -> None:
    shaper, run = make_job("tool_calls", tools=TOOLS, tool_choice={"type": "function", "name": "weather"},
                           metadata={"k": "v"})
    choice = shaper.choice(run, TOOL_PIECES)
    body = shaper.response([run], [choice], {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12})
    check(body, "Response")
    assert (body["status"], body["store"], body["metadata"], body["incomplete_details"]) == \
        ("completed", False, {"k": "v"}, None)
    assert body["tool_choice"] == {"type": "function", "name": "weather"}
    assert body["tools"] == [{"type": "function", "name": "weather", "description": "w",  # any object: not strict
                              "parameters": {"type": "object"}, "strict": False}]
    message, first, second = body["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == "I will check both."
    assert first["id"].startswith("fc_") and second["id"].startswith("fc_") and first["id"] != second["id"]
    assert without_ids([first, second]) == [
        {"type": "function_call", "status": "completed", "call_id": "call_a", "name": "weather",
         "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "status": "completed", "call_id": "call_b", "name": "weather",
         "arguments": '{"city":"Rome"}'}]
    assert body["usage"] == {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                             "output_tokens": 9, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 12}


def test_function_calls_in_a_stream() -> None:
    shaper, run = make_job("tool_calls", tools=TOOLS)
    events = stream_of(shaper, run, TOOL_PIECES)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [(e["output_index"], e["item"]["type"], e["item"]["status"]) for e in added] == \
        [(0, "message", "in_progress"), (1, "function_call", "in_progress"), (2, "function_call", "in_progress")]
    assert added[1]["item"]["call_id"] == "call_a" and added[1]["item"]["arguments"] == ""
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [(e["output_index"], e["name"], e["arguments"]) for e in done] == \
        [(1, "weather", '{"city":"Paris"}'), (2, "weather", '{"city":"Rome"}')]
    final = events[-1]["response"]
    items_done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert final["output"] == items_done  # the final response holds exactly the items announced done
    assert final["usage"]["total_tokens"] == 12 and final["status"] == "completed"
    # the same pieces answered whole give the same items (ids aside)
    whole = shaper.choice(run, TOOL_PIECES)["output"]
    assert without_ids(whole) == without_ids(final["output"])


def test_the_openai_clients_stream_state_accumulates_the_function_calls() -> None:
    """The state machine behind the openai client's responses.stream() (a private module: the
    helper itself needs a server) turns our events into its parsed function calls."""
    from openai import omit
    from openai._models import construct_type
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    shaper, run = make_job("tool_calls", tools=TOOLS)
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
            "additionalProperties": False}
    tools: Any = [{"type": "function", "name": "weather", "parameters": city, "strict": True}]
    state = ResponseStreamState(input_tools=tools, text_format=omit)
    seen = [out for event in stream_of(shaper, run, TOOL_PIECES)
            for out in state.handle_event(construct_type(type_=ResponseStreamEvent, value=event))]  # type: ignore[arg-type]
    snapshots = [e.snapshot for e in seen if e.type == "response.function_call_arguments.delta"]
    assert snapshots == ['{"city":', '{"city":"Paris"}', '{"city":"Rome"}']
    final = seen[-1]
    assert final.type == "response.completed"
    message, *calls = final.response.output
    assert message.content[0].text == "I will check both."  # type: ignore[union-attr, index]
    assert [(c.call_id, c.parsed_arguments) for c in calls] == [  # type: ignore[union-attr]
        ("call_a", {"city": "Paris"}), ("call_b", {"city": "Rome"})]


def test_a_stream_cut_by_the_length_limit_is_incomplete() -> None:
    shaper, run = make_job("length", max_output_tokens=2)
    events = stream_of(shaper, run, [Piece("Hel", [1], None), Piece("lo", [2], None)])
    assert events[-1]["type"] == "response.incomplete"
    final = events[-1]["response"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"} and final["max_output_tokens"] == 2
    assert final["output"][0]["status"] == "incomplete" and final["output"][0]["content"][0]["text"] == "Hello"


def test_an_empty_answer_is_an_empty_message() -> None:
    shaper, run = make_job("stop")
    events = stream_of(shaper, run, [])
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == ""
    body = shaper.response([run], [shaper.choice(run, [])],
                           {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3})
    check(body, "Response")


def test_a_failure_after_the_headers_is_an_error_then_response_failed() -> None:
    shaper, run = make_job("stop")
    text = "".join(shaper.chunk(run.job, run.state, opening) for opening in shaper.opening(run))
    text += shaper.chunk(run.job, run.state, shaper.delta(run, Piece("par", [1], None)))
    error = APIError(503, "A stage is gone.", type="service_unavailable", code="stage_unavailable").body()
    text += "".join(shaper.stream_error(run.job, run.state, error))
    events = parse_events(text)
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert (events[-2]["code"], events[-2]["message"]) == ("stage_unavailable", "A stage is gone.")
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": "server_error", "message": "A stage is gone."}
    # a stream that fails before it started (a late start): the same two events, numbered from 0
    shaper, run = make_job("stop")
    overloaded = APIError(429, "Busy.", type="rate_limit_error", code="overloaded").body()
    events = parse_events("".join(shaper.stream_error(run.job, ChoiceState(), overloaded)))
    assert [e["type"] for e in events] == ["error", "response.failed"]
    assert events[0]["code"] == "overloaded" and events[1]["response"]["error"]["code"] == "rate_limit_exceeded"


def test_the_echo_of_a_structured_request() -> None:
    schema = {"type": "object", "properties": {}, "additionalProperties": False}
    shaper, run = make_job("stop", instructions="Be brief.", temperature=0, top_p=0.5, parallel_tool_calls=False,
                           text={"format": {"type": "json_schema", "name": "s", "schema": schema, "strict": True}},
                           service_tier="auto", user="u", safety_identifier="s1", prompt_cache_key="k")
    body = shaper.response([run], [shaper.choice(run, [Piece("{}", [1], None)])],
                           {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4})
    check(body, "Response")
    assert (body["instructions"], body["temperature"], body["top_p"], body["parallel_tool_calls"]) == \
        ("Be brief.", 0, 0.5, False)
    assert body["text"]["format"] == {"type": "json_schema", "name": "s", "schema": schema, "strict": True}
    assert (body["service_tier"], body["user"], body["safety_identifier"], body["prompt_cache_key"]) == \
        ("auto", "u", "s1", "k")
    assert body["completed_at"] >= body["created_at"]


# --- through `inferencemesh serve` ----------------------------------------------------------------


Served = tuple[str, OpenAI, str]  # base URL, client, model name


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serving("--speculative", "draft") as (base, _, _):
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        yield base, client, client.models.list().data[0].id


CONVERSATION = [
    {"role": "user", "content": "Write a Python function that adds two numbers."},
    {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
    {"role": "user", "content": "Now one that multiplies them."},
]
INSTRUCTIONS = "You are a terse coding assistant."


def as_items(messages: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Chat messages as Responses input items, with typed parts."""
    return [{"type": "message", "role": m["role"],
             "content": [{"type": "output_text" if m["role"] == "assistant" else "input_text", "text": m["content"],
                          **({"annotations": []} if m["role"] == "assistant" else {})}]} for m in messages]


@pytest.mark.slow
def test_greedy_output_is_chat_completions_output(served: Served) -> None:
    base, client, model = served
    chat = client.chat.completions.create(model=model, temperature=0, max_completion_tokens=32, messages=[
        {"role": "system", "content": INSTRUCTIONS}, *CONVERSATION])  # type: ignore[list-item]
    items: Any = as_items(CONVERSATION)  # the client's TypedDicts, as plain dicts
    response = client.responses.create(model=model, instructions=INSTRUCTIONS, input=items, temperature=0,
                                       max_output_tokens=32)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == \
        (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.to_dict()["store"] is False and response.instructions == INSTRUCTIONS
    # the raw body matches OpenAI's spec
    raw = httpx.post(f"{base}/v1/responses", json={"model": model, "input": "Say hi.", "max_output_tokens": 8,
                                                    "metadata": {"run": "1"}}, timeout=120)
    assert raw.status_code == 200, raw.text
    check(raw.json(), "Response")
    assert raw.json()["id"].startswith("resp_") and raw.json()["metadata"] == {"run": "1"}


@pytest.mark.slow
def test_a_stream_is_the_same_text_with_events_the_spec_allows(served: Served) -> None:
    base, client, model = served
    body = {"model": model, "input": "def fib(n):", "temperature": 0, "max_output_tokens": 24}
    whole = client.responses.create(**body)  # type: ignore[call-overload]
    with httpx.stream("POST", f"{base}/v1/responses", json={**body, "stream": True}, timeout=120) as streamed:
        assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
        text = "".join(streamed.iter_text())
    assert "[DONE]" not in text
    events = parse_events(text)
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    final = events[-1]
    assert final["type"] == f"response.{whole.status}"
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == whole.output_text == final["response"]["output"][0]["content"][0]["text"]
    assert final["response"]["usage"]["output_tokens"] == whole.usage.output_tokens  # type: ignore[union-attr]
    # the openai client's own stream helpers accumulate the same response
    with client.responses.stream(**body) as stream:  # type: ignore[call-overload]
        seen = list(stream)
    snapshots = [event.snapshot for event in seen if event.type == "response.output_text.delta"]
    assert snapshots[-1] == whole.output_text  # the helper's accumulated text
    assert seen[-1].type == f"response.{whole.status}"  # (its get_final_response() wants response.completed)
    chunks = list(client.responses.create(**body, stream=True))  # type: ignore[call-overload]
    assert chunks[-1].response.output_text == whole.output_text


@pytest.mark.slow
def test_max_output_tokens_makes_it_incomplete(served: Served) -> None:
    _, client, model = served
    response = client.responses.create(model=model, input="Count from 1 to 100: 1, 2, 3,", max_output_tokens=3,
                                       temperature=0)  # sampled, an end-of-text token could honestly end it first
    assert response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 3


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "port": {"type": "integer", "minimum": 1, "maximum": 65535}},
          "required": ["name", "port"], "additionalProperties": False}


class Service(BaseModel):
    name: Annotated[str, Field(max_length=12)]  # bounded: sampling ends within max_output_tokens
    port: Annotated[int, Field(ge=1, le=65535)]


@pytest.mark.slow
def test_json_schema_output_parses_and_validates(served: Served) -> None:
    _, client, model = served
    for temperature in (0, 1):
        response = client.responses.create(
            model=model, input="A service config as JSON.", temperature=temperature, max_output_tokens=80,
            text={"format": {"type": "json_schema", "name": "service", "schema": SCHEMA, "strict": True}})
        assert response.status == "completed", response.output_text
        jsonschema.validate(json.loads(response.output_text), SCHEMA)
    parsed = client.responses.parse(model=model, input="A service config as JSON.", text_format=Service,
                                    max_output_tokens=80, temperature=0)
    assert isinstance(parsed.output_parsed, Service)
    assert parsed.output_parsed == Service.model_validate_json(parsed.output_text)


@pytest.mark.slow
def test_an_openai_agents_agent_runs_on_it(served: Served) -> None:
    """The openai-agents SDK (its default model class is the Responses API's): a structured-output
    agent, run whole and streamed, gets the same pydantic answer (greedy)."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no network here
    base, _, model = served

    async def run() -> tuple[Any, Any]:
        client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        agent = Agent(name="config", instructions="Answer with a service config.", output_type=Service,
                      model=OpenAIResponsesModel(model=model, openai_client=client),
                      model_settings=ModelSettings(max_tokens=80, temperature=0))
        whole = await Runner.run(agent, "The web service.")
        streamed = Runner.run_streamed(agent, "The web service.")
        async for _ in streamed.stream_events():
            pass
        return whole.final_output, streamed.final_output

    whole, streamed = asyncio.run(run())
    assert isinstance(whole, Service) and whole == streamed


ADD_TOOL = {"type": "function", "name": "add", "description": "a + b", "strict": True, "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}


@pytest.mark.slow
def test_function_tools_call_stream_and_take_their_output_back(served: Served) -> None:
    """A function call comes back as a function_call item (whole and streamed, every event the
    spec's), and its output sent back as a function_call_output item is in the next prompt."""
    base, client, model = served
    asked: dict[str, Any] = {"model": model, "input": "What is 2 + 3?", "tools": [ADD_TOOL],
                             "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0,
                             "max_output_tokens": 64}
    whole = httpx.post(f"{base}/v1/responses", json=asked, timeout=120).json()
    assert not errors(whole, "Response"), errors(whole, "Response")
    (call,) = [item for item in whole["output"] if item["type"] == "function_call"]
    assert call["name"] == "add" and call["call_id"].startswith("call_") and whole["status"] == "completed"
    jsonschema.validate(json.loads(call["arguments"]), ADD_TOOL["parameters"])
    events = []
    with httpx.stream("POST", f"{base}/v1/responses", json={**asked, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    for event in events:
        assert not errors(event, "ResponseStreamEvent"), (event, errors(event, "ResponseStreamEvent"))
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert arguments == call["arguments"] and events[-1]["type"] == "response.completed"
    follow = [{"type": "message", "role": "user", "content": "What is 2 + 3?"},
              {"type": "function_call", "call_id": call["call_id"], "name": "add", "arguments": call["arguments"]}]
    answers = [client.responses.create(model=model, input=[*follow, {"type": "function_call_output",  # type: ignore
                                                                     "call_id": call["call_id"], "output": output}],
                                       tools=[ADD_TOOL], temperature=0, max_output_tokens=8)  # type: ignore
               for output in ("5", "a much longer tool output, with more tokens")]
    assert answers[0].usage is not None and answers[1].usage is not None
    assert answers[1].usage.input_tokens > answers[0].usage.input_tokens  # the output is in the prompt


@pytest.mark.slow
def test_an_openai_agents_agent_calls_a_function_tool_over_responses(served: Served) -> None:
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from agents.items import ToolCallOutputItem
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no network here
    base, _, model = served
    seen: list[tuple[int, int]] = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        seen.append((a, b))
        return a + b

    async def run() -> Any:
        client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        # The tool's result is the agent's answer (stop_on_first_tool): a second turn in free text
        # would run the bundled code model to max_output_tokens, which the SDK takes as a failure
        # over the Responses API ("incomplete").
        agent = Agent(name="adder", instructions="Use the add tool.", tools=[add],
                      model=OpenAIResponsesModel(model=model, openai_client=client),
                      tool_use_behavior="stop_on_first_tool",
                      model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                                   max_tokens=48))
        return await Runner.run(agent, "What is 2 + 3?", max_turns=2)

    result = asyncio.run(run())
    outputs = [item for item in result.new_items if isinstance(item, ToolCallOutputItem)]
    assert len(seen) == 1 and outputs and str(outputs[0].output) == str(sum(seen[0]))
    assert str(result.final_output) == str(sum(seen[0]))


@pytest.mark.slow
def test_refused_parameters_are_400s_naming_them(served: Served) -> None:
    base, _, model = served
    cases: dict[str, dict[str, Any]] = {
        "store": {"store": True}, "previous_response_id": {"previous_response_id": "resp_1"},
        "conversation": {"conversation": "conv_1"}, "background": {"background": True},
        "prompt": {"prompt": {"id": "pmpt_1"}}, "reasoning": {"reasoning": {"effort": "low"}},
        "include": {"include": ["message.output_text.logprobs"]}, "top_logprobs": {"top_logprobs": 3},
        "truncation": {"truncation": "auto"}, "text.verbosity": {"text": {"verbosity": "low"}},
        "stream_options": {"stream_options": {"include_obfuscation": False}},
        "input.0.type": {"input": [{"type": "input_image", "image_url": "http://x/y.png"}]},
        "tools.0.type": {"tools": [{"type": "web_search"}]},
        "temperature": {"temperature": "1"},  # strict types, as OpenAI's
        "max_output_tokens": {"max_output_tokens": 0},
        "model": {"model": "not-this-one"},
    }
    for param, extra in cases.items():
        answer = httpx.post(f"{base}/v1/responses", json={"model": model, "input": "hi", **extra}, timeout=60)
        assert answer.status_code == (404 if param == "model" else 400), (param, answer.text)
        check(answer.json(), "ErrorResponse")
        assert answer.json()["error"]["param"] == param, (param, answer.text)
    # accepted labels and fixed values
    answer = httpx.post(f"{base}/v1/responses", timeout=60, json={
        "model": model, "input": "hi", "max_output_tokens": 2, "store": False, "background": False,
        "truncation": "disabled", "include": [], "user": "u", "safety_identifier": "s", "prompt_cache_key": "k",
        "service_tier": "auto", "some_future_field": 1})
    assert answer.status_code == 200, answer.text


@pytest.mark.slow
def test_responses_are_not_stored(served: Served) -> None:
    base, _, _ = served
    for method in ("GET", "DELETE"):
        answer = httpx.request(method, f"{base}/v1/responses/resp_123", timeout=30)
        assert answer.status_code == 404
        check(answer.json(), "ErrorResponse")
        assert "not store" in answer.json()["error"]["message"]
    assert httpx.get(f"{base}/v1/responses/resp_123/input_items", timeout=30).status_code == 404
    cancel = httpx.post(f"{base}/v1/responses/resp_123/cancel", timeout=30)
    assert cancel.status_code == 404 and "not store" in cancel.json()["error"]["message"]


# --- in process: the fixture engine behind the real app -----------------------------------------


@pytest.fixture(scope="module")
def inprocess() -> Iterator[tuple[str, Any, Any, str]]:
    """(URL, app, engine, model name): the app over the fixture engine, short context."""
    from fixture_engine import TransformersEngine, build_fixture_model, serve

    from inferencemesh.frontend.openai.app import create_app

    fm = build_fixture_model()
    engine = TransformersEngine(fm.engine.model, model_name=fm.name, max_context=128)
    app = create_app(engine, fm.tokenizer, served_model_name=fm.name,  # type: ignore[arg-type]  # a list, not Sequence
                     max_body_bytes=64 * 1024)
    with serve(app) as url:
        yield url, app, engine, fm.name


@pytest.mark.slow
def test_answers_whole_streamed_and_refused(inprocess: tuple[str, Any, Any, str]) -> None:
    """Whole, streamed, refused by the engine (naming the Responses parameter), or a stream its
    client left early; the shaper holds nothing of any request (it is stateless: the echoed
    settings travel on the job, a stream's output items on its choice's state)."""
    base, app, _, model = inprocess
    shaper = app.state.frontend.shapers["response"]
    assert list(vars(shaper)) == ["formatter"]
    body = {"model": model, "input": "def add(a, b):", "max_output_tokens": 6}
    with httpx.Client(base_url=base, timeout=60) as http:
        whole = http.post("/v1/responses", json=body)
        assert whole.status_code == 200 and whole.json()["max_output_tokens"] == 6  # the request's settings echoed
        with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as streamed:
            events = parse_events("".join(streamed.iter_text()))
        assert events[-1]["type"] in ("response.completed", "response.incomplete")
        assert events[-1]["response"]["max_output_tokens"] == 6
        too_long = http.post("/v1/responses", json={**body, "max_output_tokens": 10**6})
        assert (too_long.status_code, too_long.json()["error"]["param"]) == (400, "input")  # chat's "messages"
        # an engine-side 400 about response_format (this engine constrains nothing) names text.format
        schema = {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}
        bad_schema = http.post("/v1/responses", json={**body, "text": {"format": {"type": "json_schema", "name": "s",
                                                                                  "schema": schema}}})
        assert bad_schema.status_code == 400 and bad_schema.json()["error"]["param"].startswith("text.format"), \
            bad_schema.text
        with http.stream("POST", "/v1/responses", json={**body, "stream": True, "max_output_tokens": 64}) as left:
            next(left.iter_lines())  # the client goes away after the first line
    assert list(vars(shaper)) == ["formatter"]


JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 40) | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=8)
TEXTS = st.text(max_size=12)
PART_TYPES = st.sampled_from(["input_text", "output_text", "refusal", "input_image", "input_file", "x"])
PARTS = st.builds(lambda t, text, refusal: {"type": t, "text": text, "refusal": refusal}, PART_TYPES, TEXTS, TEXTS)
ITEMS = st.one_of(
    st.builds(lambda role, content: {"role": role, "content": content},
              st.sampled_from(["user", "system", "developer", "assistant", "tool", "x"]),
              TEXTS | st.lists(PARTS, max_size=2) | JSON),
    st.builds(lambda call, name, args: {"type": "function_call", "call_id": call, "name": name, "arguments": args},
              TEXTS, TEXTS, TEXTS | JSON),
    st.builds(lambda call, out: {"type": "function_call_output", "call_id": call, "output": out},
              TEXTS | JSON, TEXTS | st.lists(PARTS, max_size=2)),
    st.dictionaries(st.sampled_from(["type", "role", "content", "id", "call_id"]), JSON, max_size=4),
)
FIELDS = {
    "input": TEXTS | st.lists(ITEMS, max_size=4), "instructions": TEXTS | JSON,
    "max_output_tokens": st.integers(1, 8) | JSON, "stream": st.booleans(), "temperature": st.floats(0, 2) | JSON,
    "top_p": st.floats(0, 1), "metadata": st.dictionaries(TEXTS, TEXTS, max_size=2) | JSON,
    "tools": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]), "name": TEXTS}),
                      max_size=2) | JSON,
    "tool_choice": st.sampled_from(["none", "auto", "required"]) | JSON,
    "text": st.fixed_dictionaries({"format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {
        "type": "json_schema", "name": "s", "schema": {"type": "object", "properties": {"a": {"type": "boolean"}},
                                                       "required": ["a"], "additionalProperties": False}}]) | JSON}),
    "store": JSON, "previous_response_id": JSON, "include": JSON, "truncation": JSON, "user": TEXTS | JSON,
    "service_tier": st.sampled_from(["auto", "default", "x"]), "stream_options": JSON,
}


GOOD_ITEMS = st.one_of(
    st.builds(lambda role, text: {"role": role, "content": text}, st.sampled_from(["user", "system", "assistant"]),
              TEXTS),
    st.builds(lambda text: {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]},
              TEXTS),
    st.builds(lambda call: {"type": "function_call_output", "call_id": call, "output": "1"}, TEXTS))


def fuzzed_bodies(model: str) -> st.SearchStrategy:
    fields = st.fixed_dictionaries({"input": FIELDS["input"]},
                                   optional={k: v for k, v in FIELDS.items() if k != "input"})
    served = st.fixed_dictionaries(  # well-formed: these reach the engine
        {"model": st.just(model), "input": TEXTS | st.lists(GOOD_ITEMS, min_size=1, max_size=3),
         "max_output_tokens": st.integers(1, 6)},
        optional={"instructions": TEXTS, "temperature": st.floats(0, 2),
                  "metadata": st.dictionaries(TEXTS, TEXTS, max_size=2)})
    return st.one_of(served, served.map(lambda body: {**body, "stream": True}),
                     fields.map(lambda body: {**body, "model": model, "max_output_tokens": 4}),
                     fields.map(lambda body: {**body, "model": model}), JSON)


@pytest.mark.slow
def test_fuzzed_bodies_never_5xx(inprocess: tuple[str, Any, Any, str]) -> None:
    """Whatever arrives: no 5xx, errors in OpenAI's format, every answer (whole or streamed) valid
    against OpenAI's spec, and no engine session left behind, nor anything on the (stateless) shaper."""
    base, app, engine, model = inprocess
    answered: list[str] = []  # what each body got: a status, and for 200s whether streamed

    @settings(max_examples=120, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(fuzzed_bodies(model))
    def run(body: Any) -> None:
        with httpx.Client(base_url=base, timeout=60) as http:
            answer = http.post("/v1/responses", content=json.dumps(body).encode(),
                               headers={"content-type": "application/json"})
        assert answer.status_code < 500, (answer.status_code, answer.text[:500], body)
        answered.append(f"{answer.status_code} {answer.headers['content-type'].split(';')[0]}")
        if answer.status_code != 200:
            assert answer.status_code in (400, 404), (answer.status_code, answer.text[:500])
            check(answer.json(), "ErrorResponse")
        elif answer.headers["content-type"].startswith("text/event-stream"):
            assert parse_events(answer.text)[-1]["type"] in ("response.completed", "response.incomplete")
        else:
            check(answer.json(), "Response")

    run()
    assert engine.open_sessions == 0
    assert list(vars(app.state.frontend.shapers["response"])) == ["formatter"]
    # the bodies reached the engine too, whole and streamed, not only the checks
    assert answered.count("200 application/json") >= 5 and answered.count("200 text/event-stream") >= 5, \
        sorted(answered)
