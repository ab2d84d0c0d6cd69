"""Speculative decoding over the split pipeline: exact for greedy, resolved from the package.

An exactness test proves something only if drafts were verified and accepted: each one reads the
frontend's metrics and asserts that every strategy but "none" ran VERIFY rounds whose drafts the
target kept (and "none" never did)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
from mesh_helpers import collect, start_mesh
from speculation_rounds import Rounds, assert_speculated
from transformers import AutoTokenizer

from inferencemesh.bundled import DEFAULT_MODEL, DRAFT_MODEL, bundled_path
from inferencemesh.config import SpeculativeOptions
from inferencemesh.frontend.engine.engine import EngineOptions, PipelineEngine
from inferencemesh.frontend.engine.metrics import MODEL_LABEL, PREFIX, FrontendMetrics
from inferencemesh.frontend.engine.pipeline import GrpcPipeline
from inferencemesh.frontend.engine.proposers.build import Speculation, resolve_speculation
from inferencemesh.frontend.engine.proposers.ngram import AutoProposer, favourable_prompt, ngram_lookup
from inferencemesh.modeling.runtime import StageRuntime
from inferencemesh.programs.mesh import in_process_pipeline
from inferencemesh.speculation import WindowPolicy

TARGET = bundled_path(DEFAULT_MODEL)
CODE = "def read_lines(path):\n    with open(path) as f:\n        return [line.rstrip() for line in f]\n\n\n" \
       "def read_words(path):\n    with open(path) as f:\n"
PROSE = "The weather in the valley was mild that spring, and the farmers"


def resolve(model_dir: Path, tokenizer, **options):
    return resolve_speculation(SpeculativeOptions(**options), model_dir, tokenizer, dtype="float32", device="cpu",
                               max_context=512)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TARGET)


@pytest.fixture(scope="module")
def setups(tokenizer) -> dict[str, Speculation]:
    return {name: resolve(TARGET, tokenizer, speculative=name) for name in
            ("none", "ngram", "draft", "auto")}


def engine_for(pipeline, setup: Speculation, metrics: FrontendMetrics) -> PipelineEngine:
    """An engine proposing with `setup` even under load, counting into `metrics`."""
    return PipelineEngine(pipeline, EngineOptions("t", max_context=512, speculative_disable_by_batch_size=0),
                          proposer_for=setup.with_metrics(metrics).proposer_for, metrics=metrics)


def generate_counted(pipeline, setup: Speculation, prompt: list[int], new_tokens: int) -> tuple[list[int], Rounds]:
    """One greedy request through a pipeline (closed afterwards): its tokens and its rounds."""
    metrics = FrontendMetrics("t")

    async def go() -> list[int]:
        engine = engine_for(pipeline, setup, metrics)
        try:
            return await collect(engine, prompt, new_tokens, temperature=0.0)
        finally:
            await engine.close()

    return asyncio.run(go()), Rounds.counted(metrics)


def run_all(pipeline_factory, setups: dict[str, Speculation], prompt: list[int],
            new_tokens: int = 40) -> dict[str, tuple[list[int], Rounds]]:
    return {name: generate_counted(pipeline_factory(), setup, prompt, new_tokens) for name, setup in setups.items()}


def test_every_strategy_is_exact_in_process(tokenizer, setups) -> None:
    assert setups["draft"].strategy == "draft", setups["draft"].reason
    runtime = StageRuntime(TARGET, 0, 8, dtype="float32", max_context=512)
    rounds: dict[str, list[Rounds]] = {name: [] for name in setups}
    for text in (CODE, PROSE):
        outputs = run_all(lambda: in_process_pipeline([runtime]), setups, tokenizer(text).input_ids)
        assert all(tokens == outputs["none"][0] for tokens, _ in outputs.values()), outputs
        for name, (_, counted) in outputs.items():
            rounds[name].append(counted)
    for name, counted_rounds in rounds.items():
        assert_speculated(name, counted_rounds)


def test_every_strategy_is_exact_when_the_prefix_cache_serves_a_conversation(tokenizer, setups) -> None:
    """Each turn forks the conversation so far from the prefix cache: proposers keep their own
    state, so every strategy answers as without the cache and without speculation."""
    runtime = StageRuntime(TARGET, 0, 8, dtype="float32", max_context=512)
    turns = [tokenizer(PROSE).input_ids, tokenizer(CODE[20:]).input_ids]

    async def conversation(setup: Speculation, cache: bool) -> tuple[list[list[int]], float, Rounds]:
        metrics = FrontendMetrics("t")
        engine = PipelineEngine(in_process_pipeline([runtime]), EngineOptions(
            "t", max_context=512, prefix_cache=cache, speculative_disable_by_batch_size=0),
            proposer_for=setup.with_metrics(metrics).proposer_for, metrics=metrics)
        history, answers = tokenizer(CODE).input_ids, []
        try:
            for turn in turns:
                answers.append(await collect(engine, history, 16, temperature=0.0))
                history = history + answers[-1] + turn
            answers.append(await collect(engine, history, 16, temperature=0.0))
        finally:
            await engine.close()
        hits = metrics.registry.get_sample_value(PREFIX + "prefix_cache_hits_total", {MODEL_LABEL: "t"})
        return answers, hits or 0.0, Rounds.counted(metrics)

    expected, _, _ = asyncio.run(conversation(setups["none"], cache=False))
    for name, setup in setups.items():
        answers, hits, rounds = asyncio.run(conversation(setup, cache=True))
        assert answers == expected, name
        assert hits > 0, name
        assert_speculated(name, [rounds])


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 4])
def test_every_strategy_is_exact_across_stages(tokenizer, setups, stages: int) -> None:
    runtime = StageRuntime(TARGET, 0, 8, dtype="float32", max_context=512)
    prompt = tokenizer(CODE).input_ids
    expected, _ = generate_counted(in_process_pipeline([runtime]), setups["none"], prompt, 40)
    mesh = start_mesh(TARGET, stages, max_context=512, dtype="float32")
    try:
        outputs = run_all(lambda: GrpcPipeline(mesh.addresses), setups, prompt)
    finally:
        mesh.stop()
    assert {name: tokens for name, (tokens, _) in outputs.items()} == {name: expected for name in setups}
    for name, (_, rounds) in outputs.items():
        assert_speculated(name, [rounds])


def test_package_default_is_the_declared_draft(tokenizer) -> None:
    chosen = resolve(TARGET, tokenizer)
    assert chosen.strategy == "draft" and "model package" in chosen.reason
    assert Path(chosen.draft.source).resolve() == bundled_path(DRAFT_MODEL).resolve()
    assert chosen.window == WindowPolicy(adaptive=True, initial=4, minimum=1, maximum=8)
    off = resolve(TARGET, tokenizer, no_draft=True)
    assert off.strategy == "auto" and "noDraft" in off.reason
    explicit = resolve(TARGET, tokenizer, speculative="ngram")
    assert explicit.strategy == "ngram" and "explicitly" in explicit.reason


def test_missing_declared_draft_serves_without_speculation(tmp_path, tokenizer) -> None:
    package = tmp_path / "target"
    shutil.copytree(TARGET, package)
    spec = json.loads((package / "model-package.json").read_text())
    spec["generation"]["speculative_decoding"]["strategies"]["bundled-draft"]["draft_model"] = "../no-such-draft"
    (package / "model-package.json").write_text(json.dumps(spec))
    chosen = resolve(package, tokenizer)
    assert chosen.strategy == "none" and "could not be loaded" in chosen.reason
    assert chosen.describe()["message"] == chosen.reason and chosen.describe()["reason"] == "DraftUnavailable"


def test_malformed_package_is_reported_not_fatal(tmp_path, tokenizer) -> None:
    package = tmp_path / "target"
    shutil.copytree(TARGET, package)
    (package / "model-package.json").write_text('{"generation": {"speculative_decoding": {"default": "x"}}}')
    chosen = resolve(package, tokenizer)
    assert chosen.strategy == "auto" and "model package ignored" in chosen.reason


def test_draft_with_another_vocabulary_is_refused(tmp_path, tokenizer) -> None:
    from tiny_models import write_tiny_model

    other = write_tiny_model(tmp_path / "other", "llama", num_layers=2)
    chosen = resolve(TARGET, tokenizer, draft=str(other))
    assert chosen.strategy == "none" and "vocabulary" in chosen.reason


def test_ngram_lookup_and_auto_gating() -> None:
    history = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert ngram_lookup(history, 3) == [4, 5, 9]
    assert ngram_lookup([1, 2, 3, 4], 3) == []
    assert favourable_prompt("```python\nprint(1)\n```") and favourable_prompt("SELECT * FROM t")
    assert not favourable_prompt("The weather was mild that spring")
    auto = AutoProposer(WindowPolicy(), favourable=False)
    assert auto.state == "observing"
    repeated = [7, 8, 9] * 3
    proposals = [auto.propose(repeated[: i + 1]) for i in range(len(repeated))]
    assert auto.state == "active" and proposals[-1] is not None  # repetition switched it on
    for _ in range(AutoProposer.RECENT_ROUNDS):
        auto.observe(4, 0, 0.001, 0.01)  # nothing accepted
    assert auto.state == "cooldown" and auto.propose(repeated) is None


@pytest.mark.slow
@pytest.mark.parametrize("stages", [1, 2, 4])
def test_every_strategy_is_exact_for_concurrent_streams_with_the_first_stage_embedded(tokenizer, setups,
                                                                                      stages: int) -> None:
    """Four streams at once, speculating even under load, through microbatches with stage 0 in
    this process: each stream's greedy tokens are its solo in-process run's, for every strategy."""
    from mesh_helpers import embedded_pipeline

    runtime = StageRuntime(TARGET, 0, 8, dtype="float32", max_context=512)
    prompts = [tokenizer(text).input_ids for text in (CODE, PROSE, CODE[40:], PROSE[10:])]
    expected = [generate_counted(in_process_pipeline([runtime]), setups["none"], p, 24)[0] for p in prompts]
    mesh = start_mesh(TARGET, stages, max_context=512, dtype="float32", embed_first=True)

    async def together(setup: Speculation) -> tuple[list[list[int]], Rounds]:
        pipeline = embedded_pipeline(TARGET, mesh, max_context=512, dtype="float32")
        assert await pipeline.wait_ready(60)
        metrics = FrontendMetrics("t")
        engine = engine_for(pipeline, setup, metrics)
        try:
            outputs = list(await asyncio.gather(*(collect(engine, p, 24, temperature=0.0) for p in prompts)))
        finally:
            await engine.close()
        return outputs, Rounds.counted(metrics)

    try:
        outputs = {name: asyncio.run(together(setup)) for name, setup in setups.items()}
    finally:
        mesh.stop()
    assert {name: tokens for name, (tokens, _) in outputs.items()} == {name: expected for name in setups}
    for name, (_, rounds) in outputs.items():
        assert_speculated(name, [rounds])
