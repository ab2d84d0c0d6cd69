"""Planning in the operator: model facts from each source, bounded planner work, speculative choice."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferencemesh import bundled
from inferencemesh.checkpoint.errors import CheckpointError
from inferencemesh.checkpoint.read import read_local
from inferencemesh.operator import modelfacts
from inferencemesh.operator.modelfacts import ModelFacts, ModelInfo, ModelUnavailable
from inferencemesh.operator.planning import make_plan, plan_layers, resolve_speculative
from inferencemesh.operator.spec import parse_spec
from inferencemesh.planner import PlanError, PlanInputs, plan_stages
from inferencemesh.protocol.transport import message_limit
from inferencemesh.speculation import choose_for_model


def spec(**fields: object) -> object:
    return parse_spec({"model": {"name": "org/m"}, **fields})


def layout_spec(num_layers: int, layer_bytes: int = 1000, **fields: object) -> object:
    return parse_spec({"model": {"name": "m", "layout": {"numLayers": num_layers, "layerBytes": layer_bytes,
                                                         "embedBytes": 500, "headBytes": 500,
                                                         "kvBytesPerToken": 0}}, **fields})


def test_local_checkpoint_is_planned_from_its_headers(tiny_model: Path) -> None:
    s = parse_spec({"model": {"name": str(tiny_model)}, "stages": {"count": 2}})
    info = ModelFacts().info(s)
    assert info.source == "local" and len(info.inputs.layer_bytes) == 4
    plan = make_plan(s, info)
    assert [(p.layer_start, p.layer_end) for p in plan.stages] == [(0, 2), (2, 4)]
    facts = read_local(tiny_model)
    assert list(info.inputs.layer_bytes) == facts.layer_bytes(4)  # float32 checkpoint, auto dtype


def test_the_kv_pool_is_planned(tiny_model: Path) -> None:
    """A stage's KV reserve is its pool, kvCacheTokens positions (default 16 x contextLength), as
    `serve` plans it (config.kv_pool_tokens); maxSessions, a scheduling limit, sizes nothing."""
    fields = {"contextLength": 100, "maxSessions": 2}
    default = ModelFacts().info(parse_spec({"model": {"name": str(tiny_model)}, **fields})).inputs
    pool = ModelFacts().info(parse_spec({"model": {"name": str(tiny_model)}, **fields, "kvCacheTokens": 400})).inputs
    assert pool.kv_bytes_per_layer * 1600 == default.kv_bytes_per_layer * 400  # 16 x 100 by default
    many = ModelFacts().info(parse_spec({"model": {"name": str(tiny_model)}, "contextLength": 100,
                                         "maxSessions": 256})).inputs
    assert many.kv_bytes_per_layer == default.kv_bytes_per_layer
    by_layout = {"layout": {"numLayers": 4, "layerBytes": 1000, "kvBytesPerToken": 10}}
    assert ModelFacts().info(parse_spec({"model": {"name": "m", **by_layout}, **fields, "kvCacheTokens": 500})
                             ).inputs.kv_bytes_per_layer == 10 * 500


def test_the_layout_plan_prints_is_the_plan_of_the_checkpoint(tiny_model: Path) -> None:
    """`inferencemesh plan --layout` (what a user puts in spec.model.layout for a PVC model) reads
    back, through the operator, as the very planner inputs the operator makes from the checkpoint."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "inferencemesh", "plan", "--model", str(tiny_model), "--layout",
                          "--json", "--dtype", "float32", "--device", "cpu"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    fields = {"contextLength": 100, "maxSessions": 3, "kvCacheTokens": 800}
    by_layout = parse_spec({"model": {"name": "m", "pvc": {"claimName": "models"}, **json.loads(out)}, **fields})
    from_checkpoint = parse_spec({"model": {"name": str(tiny_model), "dtype": "float32"}, **fields})
    assert ModelFacts().info(by_layout).inputs == ModelFacts().info(from_checkpoint).inputs


def test_bigger_budget_gets_more_layers(tiny_model: Path) -> None:
    info = ModelFacts().info(parse_spec({"model": {"name": str(tiny_model)}}))
    whole = info.inputs.stage_bytes(0, 4, 4)[2]
    last_two = info.inputs.stage_bytes(2, 4, 4)[2]
    splits = []
    for budgets in ([whole, last_two - 1], [last_two - 1, whole]):
        stages = {"count": 2, "memory": [str(b) for b in budgets]}
        s = parse_spec({"model": {"name": str(tiny_model)}, "stages": stages})
        splits.append(tuple(p.num_layers for p in plan_layers(s, info.inputs)))
    assert splits == [(3, 1), (1, 3)]


def test_impossible_specs_raise_plan_errors(tiny_model: Path) -> None:
    info = ModelFacts().info(parse_spec({"model": {"name": str(tiny_model)}}))
    with pytest.raises(PlanError, match="only 4 layers"):
        plan_layers(parse_spec({"model": {"name": "x"}, "stages": {"count": 5}}), info.inputs)
    with pytest.raises(PlanError, match="does not fit"):
        plan_layers(parse_spec({"model": {"name": "x"}, "stages": {"count": 2, "memory": ["1Ki"]}}), info.inputs)
    with pytest.raises(PlanError, match="does not fit"):
        plan_layers(parse_spec({"model": {"name": "x"}, "stages": {"count": "auto", "memory": ["1Ki"]}}), info.inputs)
    with pytest.raises(PlanError, match="overlap"):
        plan_layers(parse_spec({"model": {"name": "x"}, "stages": {
            "count": 2, "ranges": [{"start": 0, "end": 3}, {"start": 2, "end": 4}]}}), info.inputs)
    with pytest.raises(PlanError, match="positive"):
        plan_layers(parse_spec({"model": {"name": "x"}, "stages": {"count": 2, "memory": ["0"]}}), info.inputs)


def test_auto_picks_the_fewest_stages_that_fit() -> None:
    # 32 layers of 512 MiB; 4 GiB per stage less 256 MiB overhead holds 7 layers: 5 stages.
    s = layout_spec(32, 512 * 2**20, stages={"count": "auto", "memory": ["4Gi"]})
    inputs = ModelFacts().info(s).inputs
    plan = plan_layers(s, inputs)
    assert len(plan) == 5 and all(p.total_bytes <= 4 * 2**30 for p in plan)
    with pytest.raises(PlanError):
        plan_stages(inputs, 4, [4 * 2**30])


def test_hostile_sizes_plan_within_bounds() -> None:
    s = layout_spec(256, stages={"count": 64})
    start = time.monotonic()
    plan = plan_layers(s, ModelFacts().info(s).inputs)
    assert len(plan) == 64 and plan[-1].layer_end == 256
    assert time.monotonic() - start < 20  # ~2 s on a busy 2-core machine
    with pytest.raises(PlanError, match="up to 256"):
        plan_layers(s, PlanInputs([1] * 300, 0, 0, 0, 0))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=24), st.integers(0, 5000), st.integers(0, 5000),
       st.integers(1, 6), st.booleans())
def test_prefix_sum_stage_bytes_equal_plain_sums(layers: list[int], embed: int, tail: int, n: int,
                                                 budget: bool) -> None:
    inputs = PlanInputs(layers, embed, tail, 7, 11)
    count = len(layers)
    for start in range(count):
        for end in range(start + 1, count + 1):
            weights = sum(layers[start:end]) + (embed if start == 0 else 0) + (tail if end == count else 0)
            kv = 7 * (end - start)
            assert inputs.stage_bytes(start, end, count) == (weights, kv, weights + kv + 11)


def test_the_plan_carries_the_message_limit_of_its_model_and_budgets(tiny_model: Path) -> None:
    """Both ends of every stage stream take it (render.py gives it to stage and frontend alike);
    a model known only by its layout keeps the stages' fallback."""
    fields = {"stages": {"count": 2}, "maxSessions": 8, "frontend": {"maxBatchTokens": 1024}}
    s = parse_spec({"model": {"name": str(tiny_model)}, **fields})
    plan = make_plan(s, ModelFacts().info(s))
    facts = read_local(tiny_model)
    assert plan.message_limit == message_limit(hidden_size=facts.hidden_size, vocab_size=facts.vocab_size,
                                               max_batch_tokens=1024, max_sessions=8, max_context=2048)
    assert plan.to_dict()["maxMessageBytes"] == plan.message_limit
    by_layout = layout_spec(4, **fields)
    unknown = make_plan(by_layout, ModelFacts().info(by_layout))
    assert unknown.message_limit is None and unknown.to_dict()["maxMessageBytes"] is None


def test_model_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model: Path) -> None:
    facts = ModelFacts()
    with pytest.raises(CheckpointError, match="bundled://NAME"):
        facts.info(parse_spec({"model": {"name": "bundled://../../etc"}}))
    with pytest.raises(CheckpointError, match="no bundled model"):
        facts.info(parse_spec({"model": {"name": "bundled://no-such-model"}}))
    with pytest.raises(CheckpointError, match="not a directory"):
        facts.info(parse_spec({"model": {"name": str(tmp_path / "missing")}}))
    with pytest.raises(CheckpointError, match="no config.json"):
        facts.info(parse_spec({"model": {"name": str(tmp_path)}}))
    with pytest.raises(CheckpointError, match="not a hub id"):
        facts.info(parse_spec({"model": {"name": "a/b/c d"}}))
    # bundled models outside the package: $INFERENCEMESH_BUNDLED_DIR/NAME
    monkeypatch.setenv(bundled.EXTRA_DIR_ENV, str(tiny_model.parent))
    info = facts.info(parse_spec({"model": {"name": f"bundled://{tiny_model.name}"}}))
    assert info.source == "bundled" and len(info.inputs.layer_bytes) == 4


def test_hub_reads_are_cached_and_outages_are_retryable(monkeypatch: pytest.MonkeyPatch, tiny_model: Path) -> None:
    calls = []

    def fake_read_hub(repo_id: str, revision: str | None = None) -> object:
        calls.append((repo_id, revision))
        if repo_id == "org/down":
            raise ConnectionError("hub unreachable")
        return read_local(tiny_model)

    monkeypatch.setattr(modelfacts, "read_hub", fake_read_hub)
    facts = ModelFacts()
    for _ in range(3):
        assert facts.info(parse_spec({"model": {"name": "org/up", "revision": "main"}})).source == "hub"
    assert calls == [("org/up", "main")]
    # The CLI's one-line wording (what is wrong, what to do), but retried: the hub may come back.
    with pytest.raises(ModelUnavailable, match="cannot reach the model hub for org/down") as unavailable:
        facts.info(parse_spec({"model": {"name": "org/down"}}))
    assert "local model directory" in str(unavailable.value) and "\n" not in str(unavailable.value)


def test_package_draft_and_speculative_resolution(tmp_path: Path, make_model: object) -> None:
    with_draft = make_model(tmp_path / "with-draft", package_draft="../the-draft")
    info = ModelFacts().info(parse_spec({"model": {"name": str(with_draft)}}))
    assert info.model_dir == with_draft
    # the package's draft, read by the frontend's own rule: a relative path is resolved against the package
    choice = resolve_speculative(spec(), info)
    assert choice.draft == str(tmp_path / "the-draft") and "(tiny-draft)" in choice.message
    plain = ModelInfo(info.inputs, "local")

    def choose(info: ModelInfo, **speculative: object) -> tuple[str, str]:
        c = resolve_speculative(spec(speculative=speculative), info)
        return c.strategy, c.reason

    # strategy unset (the CRD has no default): the package's declared draft is used
    assert choose(info) == ("draft", "PackageDefault")
    assert choose(info, strategy="auto") == ("auto", "Requested")  # an explicit auto is not "unset"
    assert choose(info, noDraft=True) == ("auto", "NoDraft")
    assert choose(info, strategy="none") == ("none", "Disabled")
    assert choose(info, strategy="ngram") == ("ngram", "Requested")
    assert choose(info, strategy="draft") == ("draft", "Requested")
    assert choose(plain, strategy="draft", draft="org/d") == ("draft", "Requested")
    assert choose(plain, draft="org/d") == ("draft", "Requested")
    assert choose(plain, strategy="draft") == ("none", "DraftUnresolved")
    assert choose(plain) == ("auto", "Auto")
    assert choose(ModelInfo(info.inputs, "hub")) == ("auto", "Auto")


def test_a_package_declaring_ngram_plans_ngram_as_the_frontend_runs_it(tmp_path: Path, make_model: object) -> None:
    """The operator reads model-package.json with the frontend's own rule (speculation.choose_for_model):
    an n-gram declaration shows as n-gram in the plan and status, not as auto."""
    model = make_model(tmp_path / "ngram-model")
    (model / "model-package.json").write_text(json.dumps({"generation": {"speculative_decoding": {
        "default": "lookup", "strategies": {"lookup": {"type": "ngram", "window_policy": {"initial_window": 3}}}}}}))
    s = parse_spec({"model": {"name": str(model)}, "stages": {"count": 2, "gpus": 0, "device": "cpu"}})
    plan = make_plan(s, ModelFacts().info(s), ModelFacts())
    assert (plan.speculative.strategy, plan.speculative.reason) == ("ngram", "PackageDefault")
    assert plan.to_dict()["speculative"] == {"strategy": "ngram", "reason": "PackageDefault"}
    assert choose_for_model(model, strategy=None) == plan.speculative  # what the frontend decides
    # an explicit setting still wins; a broken package is ignored, and the message says why
    assert resolve_speculative(spec(speculative={"strategy": "none"}), ModelFacts().info(s)).strategy == "none"
    (model / "model-package.json").write_text("{")
    broken = resolve_speculative(s, ModelFacts().info(s))
    assert broken.strategy == "auto" and "model package ignored" in broken.message


def test_a_cpu_stages_memory_limit_is_its_budget() -> None:
    """A CPU stage holds its layers in the pod's own memory: a limit below them is refused at
    planning time, with where the budget came from, instead of a pod OOM-killed while loading."""
    from inferencemesh.operator.planning import stage_memory_budgets
    from inferencemesh.operator.spec import parse_spec

    def cpu_spec(limit: str) -> object:
        return parse_spec({"model": {"name": "bundled://imesh-code-target"},
                           "stages": {"count": 2, "gpus": 0, "device": "cpu",
                                      "resources": {"limits": {"memory": limit}}}})

    assert stage_memory_budgets(cpu_spec("2Gi")) == ([2 * 1024**3], "stages.resources.limits.memory (2Gi)")
    gpu = parse_spec({"model": {"name": "m"}, "stages": {"resources": {"limits": {"memory": "1Gi"}}}})
    assert stage_memory_budgets(gpu) == (None, "none")  # a GPU stage's layers live in GPU memory
    explicit = parse_spec({"model": {"name": "m"}, "stages": {"memory": ["8Gi"], "resources": {
        "limits": {"memory": "1Gi"}}}})
    assert stage_memory_budgets(explicit) == ([8 * 1024**3], "stages.memory")
    inputs = PlanInputs(layer_bytes=(100 * 1024**2,) * 4, embed_bytes=0, tail_bytes=0, kv_bytes_per_layer=0,
                        overhead_bytes=0)
    with pytest.raises(PlanError, match="limits.memory"):
        plan_layers(cpu_spec("64Mi"), inputs)
    assert len(plan_layers(cpu_spec("1Gi"), inputs)) == 2


def test_an_embedded_first_stage_holds_the_packages_draft(tmp_path: Path, make_model: object) -> None:
    """Stage 0's memory must also hold the draft the frontend loads beside it: the operator reads the
    draft the model package names (relative to the package) and counts it against stage 0 only."""
    from inferencemesh.planner import draft_reserve_bytes

    target = make_model(tmp_path / "target", layers=4, package_draft="../draft")
    draft = make_model(tmp_path / "draft", layers=2, hidden=32, intermediate=64)

    def plan_for(stages: dict | None = None, **fields: object) -> object:
        s = parse_spec({"model": {"name": str(target)}, "contextLength": 64, "maxSessions": 2,
                        "stages": {"count": 2, "gpus": 0, "device": "cpu", **(stages or {})}, **fields})
        return make_plan(s, ModelFacts().info(s), ModelFacts())

    embed = {"embedFirstStage": True}
    separate, embedded = plan_for(), plan_for(frontend=embed)
    want = draft_reserve_bytes(read_local(draft), dtype="auto", on_cpu=True, kv_tokens=16 * 64)  # the default pool
    assert want > 0 and separate.stages[0].reserved_bytes == 0
    assert embedded.embedded_first_stage and embedded.stages[0].reserved_bytes == want
    assert embedded.stages[1].reserved_bytes == 0 and embedded.hash != separate.hash
    assert f"with its draft {tmp_path / 'draft'}" in embedded.note and embedded.to_dict()["embeddedFirstStage"]
    assert separate.to_dict()["embeddedFirstStage"] is False
    # no draft runs: nothing reserved; an unreadable draft: nothing reserved, and the note says why
    assert plan_for(frontend=embed, speculative={"strategy": "ngram"}).stages[0].reserved_bytes == 0
    lost = plan_for(frontend=embed, speculative={"draft": str(tmp_path / "missing")})
    assert lost.stages[0].reserved_bytes == 0 and "unreadable here" in lost.note
    # a budget that holds stage 0's layers but not the draft beside them is refused, naming the draft
    assert [(p.layer_start, p.layer_end) for p in separate.stages] == [(0, 2), (2, 4)]
    pinned = {"ranges": [{"start": 0, "end": 2}, {"start": 2, "end": 4}],
              "memory": [str(separate.stages[0].total_bytes + want // 2)]}
    assert plan_for(pinned).stages[0].total_bytes < int(pinned["memory"][0])
    with pytest.raises(PlanError, match="of it the frontend's draft beside the embedded first stage"):
        plan_for(pinned, frontend=embed)
