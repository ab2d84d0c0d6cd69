"""vLLM's utility endpoints: /tokenize, /detokenize, /version, /health, in vLLM's shapes.

/tokenize must count what a generation request sends: its counts are checked against the
`usage.prompt_tokens` the completions and chat endpoints report for the same prompt.
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib import metadata

import httpx
import openai
import pytest
from fixture_engine import FixtureModel, TransformersEngine, build_fixture_model, serve
from openai_spec import errors

from inferencemesh.frontend.openai.app import create_app

CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def fm() -> FixtureModel:
    return build_fixture_model()


@pytest.fixture(scope="module")
def http(fm: FixtureModel) -> Iterator[httpx.Client]:
    with serve(create_app(fm.engine, fm.tokenizer, served_model_name=fm.name)) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        yield client


def refused(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert not errors(body, "ErrorResponse"), body
    assert body["error"]["param"] == param, body


def test_tokenize_text_counts_what_a_completion_sends(http: httpx.Client, fm: FixtureModel) -> None:
    prompt = "def fibonacci(n):\n    return"
    out = http.post("/tokenize", json={"model": fm.name, "prompt": prompt}).json()
    assert set(out) == {"count", "max_model_len", "tokens"}
    assert out["tokens"] == fm.tokenizer(prompt)["input_ids"] and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == fm.engine.max_context
    usage = http.post("/v1/completions", json={"model": fm.name, "prompt": prompt, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == out["count"]
    bare = http.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False,  # model is optional
                                        "return_token_strs": True}).json()
    assert bare["tokens"] == fm.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert bare["token_strs"] == fm.tokenizer.convert_ids_to_tokens(bare["tokens"])


def test_tokenize_chat_counts_what_a_chat_completion_sends(http: httpx.Client, fm: FixtureModel) -> None:
    out = http.post("/tokenize", json={"model": fm.name, "messages": CHAT}).json()
    chat = http.post("/v1/chat/completions", json={"model": fm.name, "messages": CHAT, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == out["count"] == len(out["tokens"])
    text = fm.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert out["tokens"] == fm.tokenizer(text, add_special_tokens=False)["input_ids"]
    # Without the generation prompt the template stops after the user's turn: a strict prefix.
    plain = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()["tokens"]
    assert len(plain) < len(out["tokens"]) and out["tokens"][: len(plain)] == plain
    # continue_final_message leaves the assistant's turn open for the model to continue.
    prefill = [*CHAT, {"role": "assistant", "content": "    return a +"}]
    open_turn = http.post("/tokenize", json={"messages": prefill, "add_generation_prompt": False,
                                             "continue_final_message": True}).json()["tokens"]
    assert fm.tokenizer.decode(open_turn).endswith("    return a +")
    # Tools are rendered as a chat request with them renders them: the template's tools section.
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {
        "q": {"type": "string"}}}}}]
    with_tools = http.post("/tokenize", json={"messages": CHAT, "tools": tools}).json()["tokens"]
    text = fm.tokenizer.apply_chat_template(CHAT, tools=tools, add_generation_prompt=True, tokenize=False)
    assert with_tools == fm.tokenizer(text, add_special_tokens=False)["input_ids"] and len(with_tools) > len(
        out["tokens"])


def test_detokenize_inverts_tokenize(http: httpx.Client, fm: FixtureModel) -> None:
    text = "import os\nprint(os.getcwd())  # ünïcode"
    ids = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert http.post("/detokenize", json={"model": fm.name, "tokens": ids}).json() == {"prompt": text}
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


def test_version_and_health(http: httpx.Client) -> None:
    assert http.get("/version").json() == {"version": metadata.version("inferencemesh")}
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/tokenize", {"prompt": 3}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools.0.function"),
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ messages }}"}, 400, "chat_template"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"messages": CHAT, "add_generation_prompt": False, "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/detokenize", {"tokens": [0, 10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model"),
])
def test_bad_input_is_an_openai_error_naming_the_param(http: httpx.Client, path: str, body: dict, status: int,
                                                       param: str) -> None:
    refused(http.post(path, json=body), status, param)


def test_a_body_that_is_not_an_object_is_a_400(http: httpx.Client) -> None:
    refused(http.post("/tokenize", content=b"[1, 2]", headers={"Content-Type": "application/json"}), 400, None)
    refused(http.post("/detokenize", content=b"{not json", headers={"Content-Type": "application/json"}), 400, None)


def test_models_are_listed_only_once_ready(fm: FixtureModel) -> None:
    """/v1/models answers as /ready does: a 503 in OpenAI's error format while the model is not
    ready (clients take a listed model for a servable one; the openai client retries a 503)."""
    engine = TransformersEngine(fm.engine.model, model_name=fm.name, max_context=fm.engine.max_context)
    engine.ready = False
    with serve(create_app(engine, fm.tokenizer, served_model_name=fm.name)) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        for path in ("/v1/models", f"/v1/models/{fm.name}", "/ready"):
            answer = client.get(path)
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "not_ready", (path, answer.text)
            assert not errors(answer.json(), "ErrorResponse")
        with pytest.raises(openai.InternalServerError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0).models.list()
        engine.ready = True
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [fm.name]
        assert client.get(f"/v1/models/{fm.name}").status_code == 200
