"""A draft, sampling or verify failure stays with the request that caused it.

The draft batcher drafts concurrent requests' proposals in shared forward passes; one request's
failure used to be handed to every request of the round (5 of 12 innocent requests got a 500
beside one with repetition_penalty 5e-324). Real draft model, real batcher, real 2-stage mesh.
"""

from __future__ import annotations

import asyncio

import pytest
from mesh_helpers import start_mesh
from tiny_models import write_tiny_model
from transformers import AutoTokenizer

from inferencemesh.config import SpeculativeOptions
from inferencemesh.frontend.engine.api import GenerationRequest
from inferencemesh.frontend.engine.engine import EngineOptions, PipelineEngine
from inferencemesh.frontend.engine.pipeline import GrpcPipeline
from inferencemesh.frontend.engine.proposers.build import resolve_speculation
from inferencemesh.frontend.engine.proposers.draft import DraftBatcher, DraftProposer
from inferencemesh.frontend.engine.proposers.draft_model import DraftModel
from inferencemesh.sampling import SamplingParams
from inferencemesh.speculation import WindowPolicy

POLICY = WindowPolicy(adaptive=False, initial=4, minimum=4, maximum=4)
GREEDY = SamplingParams(0.0, 1.0, 0, 0)
SAMPLED = SamplingParams(1.0, 1.0, 0, 11)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", num_layers=2)


def histories(count: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 250 for j in range(5 + 3 * i)] for i in range(count)]


def drafted_together(draft: DraftModel, jobs: list[tuple[SamplingParams, list[int]]]) -> list[object]:
    batcher = DraftBatcher()
    proposers = [DraftProposer(draft, POLICY, params, batcher=batcher) for params, _ in jobs]

    async def go():
        return await asyncio.gather(*(p.propose_async(h) for p, (_, h) in zip(proposers, jobs, strict=True)),
                                    return_exceptions=True)

    return asyncio.run(go())


def alone(draft: DraftModel, params: SamplingParams, history: list[int]) -> list[int]:
    return DraftProposer(draft, POLICY, params).propose(history).tokens


@pytest.mark.parametrize("form", ["lean", "stage"])  # the draft's two forward forms
@pytest.mark.parametrize("poison", ["sampling", "forward"])
def test_a_poisoned_proposal_fails_alone_in_the_batcher(model, poison, form) -> None:
    draft = DraftModel(str(model), device="cpu", max_context=128, form=form)
    jobs = [(GREEDY if i % 2 else SAMPLED, h) for i, h in enumerate(histories(12))]
    if poison == "sampling":  # its own step fails: a bias on a token the vocabulary does not have
        jobs[5] = (SamplingParams(1.0, 1.0, 0, 3, logit_bias=((10**6, 1.0),)), jobs[5][1])
    else:  # the shared forward pass fails: a token id past the draft's embedding
        jobs[5] = (GREEDY, jobs[5][1] + [10**6])
    outcomes = drafted_together(draft, jobs)
    assert isinstance(outcomes[5], (IndexError, RuntimeError, ValueError)), repr(outcomes[5])
    for i, ((params, history), outcome) in enumerate(zip(jobs, outcomes, strict=True)):
        if i != 5:
            assert not isinstance(outcome, BaseException), (i, outcome)
            assert outcome.tokens == alone(draft, params, history), i


@pytest.mark.parametrize("form", ["lean", "stage"])
def test_non_finite_draft_distributions_end_the_proposal_instead_of_raising(model, form) -> None:
    draft = DraftModel(str(model), device="cpu", max_context=128, form=form)
    extreme = SamplingParams(1.0, 1.0, 0, 5, repetition_penalty=5e-324)
    history = histories(3)[2]
    proposal = DraftProposer(draft, POLICY, extreme).propose(history)
    assert proposal is not None and len(proposal.tokens) < POLICY.initial  # ended, not raised
    [outcome] = drafted_together(draft, [(extreme, history)])
    assert not isinstance(outcome, BaseException)


def test_a_poisoned_request_beside_innocent_ones_over_the_mesh(model) -> None:
    """Twelve concurrent requests with draft speculation, one with repetition_penalty 5e-324: the
    eleven innocent ones finish exactly as alone; the poisoned one is refused or finishes."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    speculation = resolve_speculation(SpeculativeOptions(speculative="draft", draft=str(model)), model, tokenizer,
                                      dtype="float32", device="cpu", max_context=256)
    assert speculation.strategy == "draft"
    mesh = start_mesh(model, 2, max_sessions=16)
    try:
        requests = [GenerationRequest(f"r{i}", h, 12, temperature=0.0) for i, h in enumerate(histories(12))]
        requests[4] = GenerationRequest("poisoned", histories(12)[4], 12, temperature=1.0, seed=1,
                                        repetition_penalty=5e-324)

        async def tokens_of(engine: PipelineEngine, request: GenerationRequest) -> list[int]:
            out: list[int] = []
            async for step in engine.generate(request):
                out.extend(step)
            return out

        async def go():
            engine = PipelineEngine(GrpcPipeline(mesh.addresses), EngineOptions("t", max_context=256),
                                    proposer_for=speculation.proposer_for)
            try:
                solo = [await tokens_of(engine, r) for i, r in enumerate(requests) if i != 4]
                together = await asyncio.gather(*(tokens_of(engine, r) for r in requests), return_exceptions=True)
                assert engine.free_slots == engine.options.max_sessions
                return solo, together
            finally:
                await engine.close()

        solo, together = asyncio.run(go())
    finally:
        mesh.stop()
    poisoned = together.pop(4)
    assert not isinstance(poisoned, BaseException) or getattr(poisoned, "status_code", 500) == 400, repr(poisoned)
    assert together == solo
