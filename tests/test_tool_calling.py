"""Function calling as agents use it, through the speculative split: `inferencemesh serve` (two
stages, the first embedded, the bundled draft speculating), the official openai client, LangChain's
bind_tools and the OpenAI Agents SDK.

Every call parses and matches its function's schema; a streamed answer is the whole one in
fragments (the first naming the call, the others appending arguments); every body and chunk is
OpenAI's (their spec); greedy, the call is exactly the model's own greedy output under the same
grammar (transformers, float32); and an agent runs a tool and reads its result.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
import torch
from grammar_reference import constrained_greedy
from mesh_helpers import serving
from openai import OpenAI
from openai_spec import errors
from transformers import AutoModelForCausalLM, AutoTokenizer

from inferencemesh.bundled import resolve_model
from inferencemesh.frontend.openai.tools import tool_calling_from_request

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Paris?"}]
CHOICES: dict[str, Any] = {"auto": "auto", "required": "required", "named": {"type": "function",
                                                                             "function": {"name": "add"}}}
MAX_TOKENS = 80


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[OpenAI, str, str]]:
    # float32: greedy output is compared with transformers' float32 forward
    with serving("--dtype", "float32") as (base, _, _):
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        yield client, client.models.list().data[0].id, base


def valid_calls(calls: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def model_greedy(messages: list[dict[str, Any]], tool_choice: Any, parallel: bool) -> str:
    """The model's greedy output under the tools' grammar, without the serving code: the prompt by
    transformers' chat template, each step transformers' logits masked by the same grammar."""
    model_dir = resolve_model(None)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    calling = tool_calling_from_request(TOOLS, tool_choice, parallel)
    assert calling is not None
    constraint = calling.constraint(None)
    assert constraint is not None
    ids = tokenizer.apply_chat_template(messages, tools=calling.template_tools(), add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
    return constrained_greedy(model, tokenizer, ids, constraint, MAX_TOKENS)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_call_is_the_models_own_greedy_output_under_the_grammar(served, choice: str) -> None:
    client, model, _ = served
    answer = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=CHOICES[choice],
                                            parallel_tool_calls=False, temperature=0, max_tokens=MAX_TOKENS)
    choice_ = answer.choices[0]
    assert choice_.finish_reason == "tool_calls" and choice_.message.content is None
    ((name, arguments),) = valid_calls(choice_.message.tool_calls)
    assert name == "add" or choice != "named"
    written = f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'
    assert written == model_greedy(MESSAGES, CHOICES[choice], False)


@pytest.mark.parametrize("choice", list(CHOICES))
def test_every_tool_choice_streams_what_it_answers_whole(served, choice: str) -> None:
    client, model, base = served
    request = {"model": model, "messages": MESSAGES, "tools": TOOLS, "tool_choice": CHOICES[choice],
               "temperature": 0, "max_tokens": MAX_TOKENS, "parallel_tool_calls": False}
    whole = httpx.post(f"{base}/v1/chat/completions", json=request, timeout=120).json()
    assert not errors(whole, "CreateChatCompletionResponse"), errors(whole, "CreateChatCompletionResponse")
    message = whole["choices"][0]["message"]
    chunks = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**request, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    calls: dict[int, dict[str, Any]] = {}
    content = ""
    for chunk in chunks:
        assert not errors(chunk, "CreateChatCompletionStreamResponse"), errors(chunk,
                                                                               "CreateChatCompletionStreamResponse")
        delta = chunk["choices"][0]["delta"]
        content += delta.get("content") or ""
        for fragment in delta.get("tool_calls") or []:
            if fragment["index"] not in calls:  # the first fragment names the call
                assert fragment["id"].startswith("call_") and fragment["type"] == "function"
                calls[fragment["index"]] = {"name": fragment["function"]["name"], "arguments": ""}
            else:
                assert set(fragment) == {"index", "function"} and set(fragment["function"]) == {"arguments"}
            calls[fragment["index"]]["arguments"] += fragment["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert content == (message["content"] or "")
    assert [calls[i] for i in sorted(calls)] == [c["function"] for c in message.get("tool_calls") or []]
    if choice != "auto":
        assert whole["choices"][0]["finish_reason"] == "tool_calls" and len(calls) == 1


def test_a_tool_result_in_the_history_is_answered(served) -> None:
    client, model, _ = served
    first = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=MAX_TOKENS)
    call = first.choices[0].message.tool_calls[0]
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    after = client.chat.completions.create(model=model, messages=history, tools=TOOLS, temperature=0, max_tokens=16)
    without = client.chat.completions.create(model=model, messages=history[:-1] + [
        {"role": "tool", "tool_call_id": call.id, "content": "storm warning"}], tools=TOOLS, temperature=0,
        max_tokens=16)
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the result is in the prompt: a different result, a different prompt
    assert after.usage.prompt_tokens != without.usage.prompt_tokens or \
        after.choices[0].message != without.choices[0].message


def test_langchain_bind_tools(served) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    _, model, base = served

    @tool
    def add(a: int, b: int) -> int:
        """a + b"""
        return a + b

    llm = ChatOpenAI(model=model, base_url=f"{base}/v1", api_key="unused", temperature=0, max_tokens=MAX_TOKENS,
                     max_retries=0)
    bound = llm.bind_tools([add], tool_choice="add", parallel_tool_calls=False)
    message = bound.invoke("What is 2 + 3?")
    (call,) = message.tool_calls
    assert call["name"] == "add" and set(call["args"]) == {"a", "b"} and all(isinstance(v, int)
                                                                             for v in call["args"].values())
    streamed = None
    for chunk in bound.stream("What is 2 + 3?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None and [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"],
                                                                                               call["args"])]


def test_an_openai_agents_sdk_agent_calls_a_tool_and_uses_its_result(served) -> None:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from agents.items import ToolCallOutputItem
    from openai import AsyncOpenAI

    _, model, base = served
    set_tracing_disabled(True)
    seen: list[tuple[int, int]] = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        seen.append((a, b))
        return a + b

    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    agent = Agent(name="adder", instructions="Use the add tool.", tools=[add],
                  model=OpenAIChatCompletionsModel(model=model, openai_client=client),
                  # the first turn must call the tool; the SDK then resets tool_choice to auto
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                               max_tokens=48))
    result = Runner.run_sync(agent, "What is 2 + 3?", max_turns=4)
    assert len(seen) >= 1
    outputs = [item for item in result.new_items if isinstance(item, ToolCallOutputItem)]
    assert outputs and str(outputs[0].output) == str(sum(seen[0]))
    assert isinstance(result.final_output, str)
    # the tool's result went back to the model: the last turn's prompt holds it
    assert any(getattr(item, "type", "") == "tool_call_output_item" for item in result.new_items)
