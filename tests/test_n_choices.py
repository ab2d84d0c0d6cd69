"""n continuations of one prompt through real gRPC stages: the prompt is prefilled once and its
full KV blocks shared by reference with the other choices, which compute only the rest; greedy
choices equal the solo run, seeded ones are reproducible and each equals a request alone with its
derived seed; every block comes back; the HTTP answers validate against OpenAI's spec;
LangChain's n works."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator

import grpc
import httpx
import pytest
from fixture_engine import serve
from mesh_helpers import start_mesh
from openai import OpenAI
from openai_spec import COMPLETION_STREAM_CHUNK, errors
from transformers import AutoTokenizer

from inferencemesh.bundled import DEFAULT_MODEL, bundled_path
from inferencemesh.config import SpeculativeOptions
from inferencemesh.frontend.engine.api import GenerationRequest, choice_seed
from inferencemesh.frontend.engine.engine import EngineOptions, PipelineEngine
from inferencemesh.frontend.engine.pipeline import GrpcPipeline
from inferencemesh.frontend.engine.proposers.build import resolve_speculation
from inferencemesh.frontend.openai.app import create_app
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol import stage_pb2_grpc as pb_grpc
from inferencemesh.protocol.transport import KV_BLOCK_TOKENS

TARGET = bundled_path(DEFAULT_MODEL)
NAME = "imesh-code-target"
CODE = "def read_lines(path):\n    with open(path) as f:\n"
MAX_SESSIONS = 8  # per stage: the raw-frame test fills it
ATOL = 1e-4


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TARGET)


@pytest.fixture(scope="module")
def mesh():
    mesh = start_mesh(TARGET, 2, max_context=512, dtype="float32", max_sessions=MAX_SESSIONS)
    yield mesh
    mesh.stop()


def engine_for(mesh, **options) -> PipelineEngine:
    return PipelineEngine(GrpcPipeline(mesh.addresses), EngineOptions("t", max_context=512, **options))


async def drain(iterator) -> tuple[list[int], list, list | None]:
    """(tokens, their logprobs, the prompt's logprobs) of one iterator of Steps."""
    tokens, logprobs, prompt_logprobs = [], [], None
    async for step in iterator:
        tokens.extend(step)
        logprobs.extend(step.logprobs or [])
        if step.prompt_logprobs is not None:
            prompt_logprobs = step.prompt_logprobs
    return tokens, logprobs, prompt_logprobs


def run_n(mesh, request: GenerationRequest, n: int, proposer_for=None) -> list[tuple]:
    async def go():
        engine = PipelineEngine(GrpcPipeline(mesh.addresses), EngineOptions("t", max_context=512),
                                proposer_for=proposer_for)
        try:
            choices = await engine.generate_n(request, n)
            shared = (len(request.prompt_ids) - 1) // KV_BLOCK_TOKENS
            if shared:  # the prompt's first block (a fresh pool's block 0) is every choice's, by reference
                assert engine.blocks.refs[0] == n
            answers = list(await asyncio.gather(*(drain(c) for c in choices)))
            assert engine.blocks.available == engine.blocks.num_blocks and sum(engine.blocks.refs) == 0
            return answers
        finally:
            await engine.close()

    return asyncio.run(go())


def run_one(mesh, request: GenerationRequest, proposer_for=None) -> tuple:
    async def go():
        engine = PipelineEngine(GrpcPipeline(mesh.addresses), EngineOptions("t", max_context=512),
                                proposer_for=proposer_for)
        try:
            return await drain(engine.generate(request))
        finally:
            await engine.close()

    return asyncio.run(go())


def stage_counters(mesh) -> list[dict[str, float]]:
    """Per stage: token positions computed, and frames by kind."""
    out = []
    for port in mesh.metrics_ports:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        counters = {"tokens": float(re.search(r"^inferencemesh_stage_tokens_total\{.*\} (\S+)$", text, re.M)[1])}
        for kind, value in re.findall(r'^inferencemesh_stage_frames_total\{.*kind="(\w+)".*\} (\S+)$', text, re.M):
            counters[kind] = float(value)
        out.append(counters)
    return out


def active_sessions(mesh) -> list[int]:
    infos = []
    for address in mesh.addresses:
        with grpc.insecure_channel(address) as channel:
            infos.append(pb_grpc.StageStub(channel).Info(pb.InfoRequest(), timeout=5).active_sessions)
    return infos


# --- the engine over gRPC ------------------------------------------------------------------------


def test_greedy_choices_equal_the_solo_run_and_the_prompt_is_prefilled_once(mesh, tokenizer) -> None:
    prompt, new, n = tokenizer(CODE).input_ids, 12, 3
    shared = (len(prompt) - 1) // KV_BLOCK_TOKENS * KV_BLOCK_TOKENS
    assert shared, "the prompt fills a block: the choices share it"
    solo, _, _ = run_one(mesh, GenerationRequest("solo", prompt, new, temperature=0.0))
    before = stage_counters(mesh)
    choices = run_n(mesh, GenerationRequest("n", prompt, new, temperature=0.0), n)
    after = stage_counters(mesh)
    assert [tokens for tokens, _, _ in choices] == [solo] * n
    for b, a in zip(before, after, strict=True):
        # The prompt once, then each other choice the prompt past its full blocks (its last token
        # included), then n x (new - 1) decodes.
        assert a["tokens"] - b["tokens"] == len(prompt) + (n - 1) * (len(prompt) - shared) + n * (new - 1)
    saved = (n - 1) * shared
    print(f"n={n}, prompt {len(prompt)} tokens: {saved} prefill positions saved per stage by sharing blocks")
    assert active_sessions(mesh) == [0, 0]


@pytest.mark.parametrize("strategy", ["none", "ngram"])
def test_seeded_choices_are_reproducible_and_each_is_its_seed_alone(mesh, tokenizer, strategy: str) -> None:
    proposer_for = resolve_speculation(SpeculativeOptions(speculative=strategy), TARGET, tokenizer, dtype="float32",
                                       device="cpu", max_context=512).proposer_for
    prompt = tokenizer(CODE).input_ids
    request = GenerationRequest("s", prompt, 16, temperature=1.0, top_k=40, seed=2024)
    first = [tokens for tokens, _, _ in run_n(mesh, request, 4, proposer_for)]
    again = [tokens for tokens, _, _ in run_n(mesh, request, 4, proposer_for)]
    alone = [run_one(mesh, GenerationRequest(f"a{j}", prompt, 16, temperature=1.0, top_k=40,
                                             seed=choice_seed(2024, j)), proposer_for)[0] for j in range(4)]
    assert first == again == alone
    assert len({tuple(t) for t in first}) > 1  # different seeds, different samples
    assert active_sessions(mesh) == [0, 0]


def test_logprobs_of_each_choice_are_its_solo_runs(mesh, tokenizer) -> None:
    prompt = tokenizer(CODE).input_ids
    request = GenerationRequest("lp", prompt, 8, temperature=0.9, seed=5, logprobs=3, prompt_logprobs=3)
    choices = run_n(mesh, request, 3)
    for j, (tokens, logprobs, prompt_logprobs) in enumerate(choices):
        solo_tokens, solo_logprobs, solo_prompt = run_one(mesh, GenerationRequest(
            "lp1", prompt, 8, temperature=0.9, seed=choice_seed(5, j), logprobs=3, prompt_logprobs=3))
        assert tokens == solo_tokens and len(logprobs) == 8
        for got, want in zip(logprobs, solo_logprobs, strict=True):
            assert got.token == want.token and abs(got.logprob - want.logprob) < ATOL
            assert [t for t, _ in got.top] == [t for t, _ in want.top]
        # every choice echoes the prompt's logprobs, computed once
        assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
        assert all(abs(g.logprob - w.logprob) < ATOL for g, w in zip(prompt_logprobs[1:], solo_prompt[1:], strict=True))


# --- a stage lost while n choices decode ---------------------------------------------------------


def test_choices_survive_a_killed_stage(mesh, tokenizer) -> None:
    """Each choice recovers as any session does: it prefills its own history into a new session."""
    prompt, new, n = tokenizer(CODE).input_ids, 48, 3
    request = GenerationRequest("k", prompt, new, temperature=0.7, seed=8)
    expected = [tokens for tokens, _, _ in run_n(mesh, request, n)]
    killed: list[float] = []

    def kill_and_restart() -> None:
        os.kill(mesh.processes[1].process.pid, signal.SIGKILL)
        killed.append(time.monotonic())
        time.sleep(0.5)
        mesh.processes[1].start()

    async def go() -> list[list[int]]:
        engine = engine_for(mesh, recovery_timeout_s=90)
        try:
            async def one(choice) -> list[int]:
                out: list[int] = []
                async for step in choice:
                    out.extend(step)
                    if len(out) >= 8 and not killed:
                        threading.Thread(target=kill_and_restart, daemon=True).start()
                        await asyncio.sleep(0.05)
                    await asyncio.sleep(0.01)
                return out

            results = await asyncio.gather(*(one(c) for c in await engine.generate_n(request, n)))
            assert engine.recoveries >= 1
            return list(results)
        finally:
            await engine.close()

    assert asyncio.run(go()) == expected
    assert killed
    mesh.wait_ready(60)
    assert active_sessions(mesh) == [0, 0]


# The OpenAI surface's engine holds the stages' pool (its stream) until the module ends: the tests
# with engines of their own come before it.
# --- the OpenAI surface --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def url(mesh, tokenizer) -> Iterator[str]:
    engine = PipelineEngine(GrpcPipeline(mesh.addresses), EngineOptions(NAME, max_context=512, max_sessions=16))
    with serve(create_app(engine, tokenizer, served_model_name=NAME)) as base:
        yield base


def check(body: object, schema: str) -> None:
    problems = errors(body, schema)
    assert not problems, f"{schema}: {problems}\n{json.dumps(body)[:1500]}"


def events(raw: str) -> list[dict]:
    return [json.loads(block[6:]) for block in raw.split("\n\n") if block.startswith("data: {")]


def test_n_with_prompts_answers_in_openai_order_and_shape(url: str) -> None:
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    prompts = [CODE, "import os\n"]
    alone = [client.completions.create(model=NAME, prompt=p, max_tokens=10, temperature=0) for p in prompts]
    with httpx.Client(base_url=url, timeout=120) as http:
        body = {"model": NAME, "prompt": prompts, "n": 3, "max_tokens": 10, "temperature": 0}
        answer = http.post("/v1/completions", json=body).json()
        check(answer, "CreateCompletionResponse")
        assert [c["index"] for c in answer["choices"]] == list(range(6))
        assert [c["text"] for c in answer["choices"]] == [a.choices[0].text for a in alone for _ in range(3)]
        assert answer["usage"]["prompt_tokens"] == sum(a.usage.prompt_tokens for a in alone)  # each prompt once
        assert answer["usage"]["completion_tokens"] == 3 * sum(a.usage.completion_tokens for a in alone)
        # Streamed: every chunk names its choice; each choice's pieces make its text.
        raw = http.post("/v1/completions", json={**body, "stream": True,
                                                  "stream_options": {"include_usage": True}}).text
        chunks = events(raw)
        for chunk in chunks:
            check(chunk, COMPLETION_STREAM_CHUNK)
        texts = {i: "".join(c["text"] for e in chunks for c in e["choices"] if c["index"] == i) for i in range(6)}
        assert [texts[i] for i in range(6)] == [c["text"] for c in answer["choices"]]
        assert chunks[-1]["usage"] == answer["usage"] and raw.endswith("data: [DONE]\n\n")
        finishes = [c for e in chunks for c in e["choices"] if c["finish_reason"]]
        assert sorted(c["index"] for c in finishes) == list(range(6))
        # Sampled with a seed: the same n answers every time, not all alike.
        sampled = {**body, "prompt": CODE, "n": 4, "temperature": 1.2, "seed": 99}
        texts = [[c["text"] for c in http.post("/v1/completions", json=sampled).json()["choices"]] for _ in range(2)]
        assert texts[0] == texts[1] and len(set(texts[0])) > 1
        # echo + logprobs: every choice starts with the prompt's entries (computed once); the first
        # prompt token's logprob is null (see openai_spec: the one deviation OpenAI's API makes too).
        scored = http.post("/v1/completions", json={**body, "prompt": CODE, "n": 2, "echo": True,
                                                     "logprobs": 2}).json()
        check(scored, "CreateCompletionResponse")
        prompt_tokens = scored["usage"]["prompt_tokens"]
        first, second = (c["logprobs"] for c in scored["choices"])
        assert first["tokens"] == second["tokens"] and first["token_logprobs"][0] is None
        assert first["token_logprobs"][:prompt_tokens] == second["token_logprobs"][:prompt_tokens]
        assert len(first["tokens"]) == prompt_tokens + 10


def test_chat_n_streamed_and_not(url: str) -> None:
    messages = [{"role": "user", "content": CODE}]
    with httpx.Client(base_url=url, timeout=120) as http:
        body = {"model": NAME, "messages": messages, "n": 2, "max_tokens": 8, "temperature": 0.8, "seed": 3,
                "logprobs": True, "top_logprobs": 2}
        answer = http.post("/v1/chat/completions", json=body).json()
        check(answer, "CreateChatCompletionResponse")
        assert [c["index"] for c in answer["choices"]] == [0, 1]
        assert all(len(c["logprobs"]["content"]) == answer["usage"]["completion_tokens"] // 2 or
                   c["finish_reason"] == "stop" for c in answer["choices"])
        chunks = events(http.post("/v1/chat/completions", json={**body, "stream": True}).text)
        for chunk in chunks:
            check(chunk, "CreateChatCompletionStreamResponse")
        roles = [c["index"] for e in chunks for c in e["choices"] if c["delta"].get("role")]
        assert sorted(roles) == [0, 1]
        for choice in answer["choices"]:
            streamed = "".join(c["delta"].get("content", "") for e in chunks for c in e["choices"]
                               if c["index"] == choice["index"])
            assert streamed == choice["message"]["content"]
        r = http.post("/v1/chat/completions", json={**body, "n": 17})  # more than the engine runs at once
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        check(r.json(), "ErrorResponse")


def test_langchain_n(url: str) -> None:
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI
    from langchain_openai import OpenAI as LangChainOpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    prompts = [CODE, "class Stack:"]
    alone = [client.completions.create(model=NAME, prompt=p, max_tokens=8, temperature=0).choices[0].text
             for p in prompts]
    llm = LangChainOpenAI(model=NAME, base_url=f"{url}/v1", api_key="unused", temperature=0, max_tokens=8, n=2,
                          max_retries=0)
    assert llm.batch(prompts) == alone  # .batch() keeps each prompt's first choice
    result = llm.generate(prompts)  # LangChain splits the choices per prompt by index: prompt * n + j
    assert [[g.text for g in gens] for gens in result.generations] == [[text, text] for text in alone]
    chat = ChatOpenAI(model=NAME, base_url=f"{url}/v1", api_key="unused", temperature=1.0, seed=7, max_tokens=8,
                      n=2, max_retries=0)
    replies = chat.generate([[HumanMessage(CODE)]]).generations[0]
    again = chat.generate([[HumanMessage(CODE)]]).generations[0]
    assert len(replies) == 2 and [r.text for r in replies] == [r.text for r in again]
