"""Third-party frameworks against the frontend, as their users call them: LangChain's ChatOpenAI
(invoke, stream, batch) and its `OpenAI` LLM's .batch() (a list of prompts in one request), and
litellm's completion with an `openai/` model (streamed and not).

Greedy decoding makes the expected text knowable: every framework must return exactly what the
official openai client gets for the same request.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from fixture_engine import FixtureModel, build_fixture_model, serve
from openai import OpenAI

from inferencemesh.frontend.openai.app import create_app

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm fetches a price list at import otherwise

QUESTIONS = ["def add(a, b):", "import os\n", "class Stack:"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def fm() -> FixtureModel:
    return build_fixture_model()


@pytest.fixture(scope="module")
def base_url(fm: FixtureModel) -> Iterator[str]:
    with serve(create_app(fm.engine, fm.tokenizer, served_model_name=fm.name)) as url:
        yield f"{url}/v1"


@pytest.fixture(scope="module")
def expected(base_url: str, fm: FixtureModel) -> dict[str, str]:
    """What the official client gets for each question (greedy)."""
    client = OpenAI(base_url=base_url, api_key="unused")
    texts = {q: client.chat.completions.create(model=fm.name, messages=[{"role": "user", "content": q}],
                                              max_tokens=MAX_TOKENS, temperature=0).choices[0].message.content
            for q in QUESTIONS}
    assert all(texts.values()), texts  # empty answers would make every comparison below vacuous
    return texts


def test_langchain_chat_openai_invoke_stream_batch(base_url: str, fm: FixtureModel, expected: dict[str, str]) -> None:
    from langchain_core.messages import AIMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=fm.name, base_url=base_url, api_key="unused", temperature=0, max_tokens=MAX_TOKENS,
                     max_retries=0)
    question = QUESTIONS[0]
    reply = llm.invoke(question)
    assert isinstance(reply, AIMessage) and reply.content == expected[question]
    assert reply.response_metadata["finish_reason"] in ("stop", "length")
    assert reply.usage_metadata["output_tokens"] > 0
    chunks = list(llm.stream(question))
    assert len(chunks) > 1 and "".join(c.content for c in chunks) == expected[question]
    replies = llm.batch(QUESTIONS)
    assert [r.content for r in replies] == [expected[q] for q in QUESTIONS]


def test_litellm_completion_with_an_openai_model(base_url: str, fm: FixtureModel, expected: dict[str, str]) -> None:
    import litellm

    question = QUESTIONS[1]
    kwargs = {"model": f"openai/{fm.name}", "api_base": base_url, "api_key": "unused",
              "messages": [{"role": "user", "content": question}], "max_tokens": MAX_TOKENS, "temperature": 0}
    done = litellm.completion(**kwargs)
    assert done.choices[0].message.content == expected[question]
    assert done.usage.completion_tokens > 0
    pieces = [chunk.choices[0].delta.content or "" for chunk in litellm.completion(**kwargs, stream=True)
              if chunk.choices]
    assert len(pieces) > 1 and "".join(pieces) == expected[question]


def test_langchain_openai_llm_batch(base_url: str, fm: FixtureModel) -> None:
    """LangChain's completions LLM batches its prompts into one request with a list of prompts."""
    from langchain_openai import OpenAI as LangChainOpenAI

    client = OpenAI(base_url=base_url, api_key="unused")
    alone = [client.completions.create(model=fm.name, prompt=q, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
             for q in QUESTIONS]
    assert all(alone), alone
    llm = LangChainOpenAI(model=fm.name, base_url=base_url, api_key="unused", temperature=0, max_tokens=MAX_TOKENS,
                          max_retries=0)
    assert llm.batch(QUESTIONS) == alone
