"""Logprobs and sampling controls end to end through real gRPC stages: the numbers the last
stage returns are transformers' own (float32, 1e-4), for generated and prompt tokens, at one
and two stages, with and without speculation; penalties keep speculation exact."""

from __future__ import annotations

import asyncio

import pytest
import torch
from mesh_helpers import start_mesh
from speculation_rounds import Rounds, assert_speculated
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from inferencemesh.bundled import DEFAULT_MODEL, bundled_path
from inferencemesh.config import SpeculativeOptions
from inferencemesh.frontend.engine.api import GenerationRequest
from inferencemesh.frontend.engine.engine import EngineOptions, PipelineEngine
from inferencemesh.frontend.engine.metrics import FrontendMetrics
from inferencemesh.frontend.engine.pipeline import GrpcPipeline
from inferencemesh.frontend.engine.proposers.build import Speculation, resolve_speculation

TARGET = bundled_path(DEFAULT_MODEL)
CODE = "def read_lines(path):\n    with open(path) as f:\n        return [line.rstrip() for line in f]\n\n\n" \
       "def read_words(path):\n    with open(path) as f:\n"
TOP = 5
ATOL = 1e-4


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TARGET)


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def meshes():
    started = {}
    try:
        for stages in (1, 2):
            started[stages] = start_mesh(TARGET, stages, max_context=512, dtype="float32")
        yield started
    finally:
        for mesh in started.values():
            mesh.stop()


@pytest.fixture(scope="module")
def strategies(tokenizer) -> dict:
    return {name: resolve_speculation(SpeculativeOptions(speculative=name), TARGET, tokenizer, dtype="float32",
                                      device="cpu", max_context=512) for name in ("none", "ngram", "draft")}


def run(mesh, request: GenerationRequest, speculation: Speculation | None = None, prefill_chunk: int = 256):
    """(tokens, their logprobs, the prompt's logprobs) of one request through the mesh."""
    return run_counted(mesh, request, speculation, prefill_chunk)[0]


def run_counted(mesh, request: GenerationRequest, speculation: Speculation | None = None, prefill_chunk: int = 256):
    """run's answer, and the speculative rounds it took (speculation None: no proposals)."""
    metrics = FrontendMetrics("t")

    async def go():
        engine = PipelineEngine(GrpcPipeline(mesh.addresses),
                                EngineOptions("t", max_context=512, prefill_chunk=prefill_chunk),
                                proposer_for=speculation.with_metrics(metrics).proposer_for if speculation else None,
                                metrics=metrics)
        tokens, logprobs, prompt_logprobs = [], [], None
        try:
            async for step in engine.generate(request):
                tokens.extend(step)
                logprobs.extend(step.logprobs or [])
                if step.prompt_logprobs is not None:
                    prompt_logprobs = step.prompt_logprobs
        finally:
            await engine.close()
        return tokens, logprobs, prompt_logprobs

    return asyncio.run(go()), Rounds.counted(metrics)


def reference(model, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax over the whole sequence: row i scores the token at i + 1."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def assert_matches(entry, row: torch.Tensor, token: int) -> None:
    assert entry.token == token
    assert abs(entry.logprob - float(row[token])) < ATOL, (entry.logprob, float(row[token]))
    best = row.topk(TOP)
    assert [t for t, _ in entry.top] == best.indices.tolist() or \
        torch.allclose(row[[t for t, _ in entry.top]], best.values, atol=ATOL)  # ties may order either way
    assert torch.allclose(torch.tensor([lp for _, lp in entry.top]), best.values, atol=ATOL)


@pytest.mark.parametrize(("stages", "strategy", "temperature"), [
    (1, "none", 0.0), (2, "none", 0.0), (1, "ngram", 0.0), (2, "draft", 0.0), (2, "draft", 0.8), (2, "ngram", 0.8)])
def test_logprobs_are_the_target_models(tokenizer, model, meshes, strategies, stages, strategy, temperature) -> None:
    prompt = tokenizer(CODE).input_ids
    request = GenerationRequest("lp", prompt, 24, temperature=temperature, seed=7, logprobs=TOP, prompt_logprobs=TOP)
    # Small prefill chunks: prompt logprobs cross chunk boundaries (the stage keeps the last row).
    tokens, logprobs, prompt_logprobs = run(meshes[stages], request, strategies[strategy],
                                            prefill_chunk=16)
    assert len(tokens) == 24 and len(logprobs) == 24
    rows = reference(model, prompt + tokens)
    for i, (token, entry) in enumerate(zip(tokens, logprobs, strict=True)):
        assert_matches(entry, rows[len(prompt) + i - 1], token)
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        assert_matches(prompt_logprobs[i], rows[i - 1], prompt[i])


def test_prompt_scoring_without_generation(tokenizer, model, meshes) -> None:
    prompt = tokenizer(CODE).input_ids
    tokens, _, prompt_logprobs = run(meshes[2], GenerationRequest("score", prompt, 0, logprobs=1, prompt_logprobs=1))
    assert tokens == []
    rows = reference(model, prompt)
    scored = [entry.logprob for entry in prompt_logprobs[1:]]
    expected = [float(rows[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    assert torch.allclose(torch.tensor(scored), torch.tensor(expected), atol=ATOL)


def hf_penalised_greedy(model, prompt: list[int], new: int, penalty: float) -> list[int]:
    """transformers' own RepetitionPenaltyLogitsProcessor, step by step (no early stop)."""
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(new):
            logits = model(torch.tensor([ids])).logits[:, -1].float()
            ids.append(int(processor(torch.tensor([ids]), logits).argmax()))
    return ids[len(prompt):]


def test_repetition_penalty_is_transformers_and_speculation_stays_exact(tokenizer, model, meshes, strategies) -> None:
    prompt = tokenizer(CODE).input_ids
    expected = hf_penalised_greedy(model, prompt, 60, 1.3)  # 60: enough for n-gram drafts to be verified
    plain = hf_penalised_greedy(model, prompt, 60, 1.0)
    assert expected != plain  # the penalty changes what greedy decoding says
    for name, strategy in strategies.items():
        (got, _, _), rounds = run_counted(meshes[2], GenerationRequest(name, prompt, 60, temperature=0.0,
                                                                        repetition_penalty=1.3), strategy)
        assert got == expected, name
        assert_speculated(name, [rounds], accepted=name != "ngram")


def test_every_control_keeps_speculation_exact(tokenizer, meshes, strategies) -> None:
    """Greedy with every transform on: the same tokens whether the window is verified or decoded."""
    prompt = tokenizer(CODE).input_ids
    controls = dict(temperature=0.0, presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.1,
                    logit_bias=((tokenizer.convert_tokens_to_ids("Ġself"), 3.0),), min_tokens=8,
                    stop_token_ids=frozenset({tokenizer.eos_token_id}))
    outputs = {}
    for name, strategy in strategies.items():  # 60 tokens: enough for n-gram drafts to be verified and accepted
        (outputs[name], _, _), rounds = run_counted(meshes[2], GenerationRequest(name, prompt, 60, **controls),
                                                    strategy)
        assert_speculated(name, [rounds])
    plain = run(meshes[2], GenerationRequest("plain", prompt, 60, temperature=0.0))[0]
    assert outputs["none"] != plain
    assert outputs["ngram"] == outputs["none"] and outputs["draft"] == outputs["none"], outputs
