"""The engine alone decides when a choice stops and why: its last Step carries finish_reason.

"stop" for a stop token (emitted or not), "length" for max_tokens or the model's context; every
other Step carries None. Through the real engine over a real 2-stage mesh.
"""

from __future__ import annotations

import asyncio

import pytest
from mesh_helpers import start_mesh
from tiny_models import write_tiny_model

from inferencemesh.frontend.engine.api import GenerationRequest, Step
from inferencemesh.frontend.engine.engine import EngineOptions, PipelineEngine
from inferencemesh.frontend.engine.pipeline import GrpcPipeline

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
CONTEXT = 64


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    model = write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", num_layers=2)
    mesh = start_mesh(model, 2, max_context=CONTEXT)
    yield mesh
    mesh.stop()


def steps_of(mesh, request: GenerationRequest) -> list[Step]:
    async def go() -> list[Step]:
        engine = PipelineEngine(GrpcPipeline(mesh.addresses), EngineOptions("t", max_context=CONTEXT))
        try:
            return [step async for step in engine.generate(request)]
        finally:
            await engine.close()

    return asyncio.run(go())


def tokens(steps: list[Step]) -> list[int]:
    return [t for step in steps for t in step]


def reasons(steps: list[Step]) -> list[str | None]:
    return [step.finish_reason for step in steps]


def test_max_tokens_ends_with_length_and_only_the_last_step_says_so(mesh) -> None:
    steps = steps_of(mesh, GenerationRequest("a", PROMPT, 6, temperature=0.0))
    assert len(tokens(steps)) == 6
    assert reasons(steps) == [None] * (len(steps) - 1) + ["length"]


def test_a_stop_token_ends_with_stop_emitted_or_not(mesh) -> None:
    plain = tokens(steps_of(mesh, GenerationRequest("a", PROMPT, 8, temperature=0.0)))
    stop = plain[3]
    first = plain.index(stop)
    hidden = steps_of(mesh, GenerationRequest("b", PROMPT, 8, temperature=0.0, stop_token_ids=frozenset({stop})))
    assert tokens(hidden) == plain[:first] and reasons(hidden)[-1] == "stop"
    shown = steps_of(mesh, GenerationRequest("c", PROMPT, 8, temperature=0.0, stop_token_ids=frozenset({stop}),
                                             emit_stop_token=True))
    assert tokens(shown) == plain[: first + 1] and reasons(shown)[-1] == "stop"


def test_the_context_ends_with_length(mesh) -> None:
    prompt = (PROMPT * 6)[: CONTEXT - 3]
    steps = steps_of(mesh, GenerationRequest("d", prompt, 100, temperature=0.0))
    assert len(tokens(steps)) == 3 and reasons(steps)[-1] == "length"


def test_prompt_scoring_alone_is_one_step_that_ends_with_length(mesh) -> None:
    steps = steps_of(mesh, GenerationRequest("e", PROMPT, 0, temperature=0.0, prompt_logprobs=0))
    assert len(steps) == 1 and list(steps[0]) == [] and steps[0].prompt_logprobs is not None
    assert steps[0].finish_reason == "length"
