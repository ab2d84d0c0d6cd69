"""Speculation steps aside under load (vLLM's disable_by_batch_size) and stays exact."""

from __future__ import annotations

import asyncio

import pytest
from mesh_helpers import collect, start_mesh
from tiny_models import write_tiny_model

from inferencemesh.config import FrontendConfig
from inferencemesh.flags import ConfigError
from inferencemesh.frontend.engine.engine import EngineOptions, PipelineEngine
from inferencemesh.frontend.engine.pipeline import GrpcPipeline
from inferencemesh.frontend.engine.proposers.base import Proposal
from inferencemesh.frontend.engine.proposers.ngram import NgramProposer
from inferencemesh.speculation import WindowPolicy

REPEATING = [5, 6, 7, 8, 9] * 6  # n-gram lookup finds continuations in it from the start


class CountingProposer(NgramProposer):
    """n-gram proposals, counting how many steps asked for one."""

    asked = 0

    def propose(self, history: list[int]) -> Proposal | None:
        CountingProposer.asked += 1
        return super().propose(history)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    model = write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", num_layers=4)
    mesh = start_mesh(model, 2)
    yield mesh
    mesh.stop()


def run(mesh, prompts: list[list[int]], disable_by_batch_size: int) -> tuple[list[list[int]], int]:
    CountingProposer.asked = 0

    async def go() -> list[list[int]]:
        engine = PipelineEngine(
            GrpcPipeline(mesh.addresses),
            EngineOptions("t", max_context=256, speculative_disable_by_batch_size=disable_by_batch_size),
            proposer_for=lambda _request: CountingProposer(WindowPolicy("fixed", 4)))
        try:
            return await asyncio.gather(*(collect(engine, p, 24, temperature=0.0) for p in prompts))
        finally:
            await engine.close()

    return asyncio.run(go()), CountingProposer.asked


def test_no_proposals_while_the_pipeline_is_busy_and_the_same_tokens(mesh) -> None:
    prompts = [REPEATING, REPEATING[1:], REPEATING[2:]]
    always, asked_always = run(mesh, prompts, 0)
    busy, asked_busy = run(mesh, prompts, 3)  # three running: at the limit from the first step
    alone, asked_alone = run(mesh, prompts[:1], 3)
    assert asked_always > 0 and asked_alone > 0
    # Once all three run, no step proposes; only steps taken before the last one was admitted may.
    assert asked_busy < len(prompts) < asked_always, (asked_busy, asked_always)
    assert busy == always and alone == always[:1]


def test_the_limit_is_a_frontend_flag() -> None:
    config = FrontendConfig(model="m", stage_addresses=("a:1",), speculative_disable_by_batch_size=8).check()
    assert config.speculative_disable_by_batch_size == 8
    try:
        FrontendConfig(model="m", stage_addresses=("a:1",), speculative_disable_by_batch_size=-1).check()
    except ConfigError as err:
        assert "--speculative-disable-by-batch-size" in str(err)
    else:
        raise AssertionError("a negative limit must be refused")
