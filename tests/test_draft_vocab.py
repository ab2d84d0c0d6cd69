"""A draft whose padded embedding differs from the target's (as Qwen2.5's small and large
checkpoints do, with one tokenizer) works: its proposals are fitted to the target's width, so
sampled verification gets distributions of the right size, and output stays exact."""

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
from inferencemesh.frontend.engine.proposers.draft_model import DraftModel

TARGET_VOCAB = 320  # tiny_models' padded vocabulary; the tokenizer has 259 tokens
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("vocab")
    return {
        "target": write_tiny_model(root / "target", "llama", num_layers=2),
        "larger": write_tiny_model(root / "larger", "llama", num_layers=1, seed=1, vocab_size=384),
        "smaller": write_tiny_model(root / "smaller", "llama", num_layers=1, seed=2, vocab_size=288,
                                    tie_word_embeddings=True),
    }


@pytest.mark.parametrize("draft", ["larger", "smaller"])
def test_the_draft_logits_have_the_targets_width(models, draft) -> None:
    model = DraftModel(str(models[draft]), device="cpu", max_context=64, vocab_size=TARGET_VOCAB)
    logits = model.forward(model.new_cache(), 0, PROMPT)
    assert logits.shape == (TARGET_VOCAB,)
    if draft == "smaller":
        assert bool((logits[288:] == float("-inf")).all())


def test_a_draft_with_another_padding_verifies_sampled_windows_over_the_mesh(models) -> None:
    target = models["target"]
    tokenizer = AutoTokenizer.from_pretrained(target)
    mesh = start_mesh(target, 2)
    try:
        async def run(proposer_for, request: GenerationRequest) -> list[int]:
            engine = PipelineEngine(GrpcPipeline(mesh.addresses), EngineOptions("t", max_context=256),
                                    proposer_for=proposer_for)
            try:
                return [t async for step in engine.generate(request) for t in step]
            finally:
                await engine.close()

        greedy = GenerationRequest("g", PROMPT, 16, temperature=0.0)
        sampled = GenerationRequest("s", PROMPT, 16, temperature=1.0, seed=5)
        # Unseeded: the draft sends its rows (Frame.draft_q) and may draw a remainder token past its own
        # embedding (the smaller draft's padding), which ends its window unfed.
        unseeded = GenerationRequest("u", PROMPT, 16, temperature=1.0)
        plain = asyncio.run(run(None, greedy))
        for name in ("larger", "smaller"):
            speculation = resolve_speculation(SpeculativeOptions(speculative="draft", draft=str(models[name])),
                                              target, tokenizer, dtype="float32", device="cpu", max_context=256)
            assert speculation.strategy == "draft", speculation.reason
            assert speculation.draft.vocab_size == TARGET_VOCAB
            assert asyncio.run(run(speculation.proposer_for, greedy)) == plain
            assert len(asyncio.run(run(speculation.proposer_for, sampled))) == 16
            assert len(asyncio.run(run(speculation.proposer_for, unseeded))) == 16
    finally:
        mesh.stop()
