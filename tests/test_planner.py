"""The memory planner: contiguous ranges, planned by bytes and budgets, with clear refusals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from inferencemesh.bundled import resolve_model
from inferencemesh.planner import (
    PlanError,
    PlanInputs,
    parse_bytes,
    plan_auto,
    plan_explicit,
    plan_stages,
    render_plan,
)

MIB = 1024**2


def inputs(layers: int = 8, layer_mib: int = 100, embed_mib: int = 200, tail_mib: int = 200) -> PlanInputs:
    return PlanInputs([layer_mib * MIB] * layers, embed_mib * MIB, tail_mib * MIB, 10 * MIB, 0)


def test_ranges_are_contiguous_and_cover_every_layer() -> None:
    plan = plan_stages(inputs(), 3)
    assert plan[0].layer_start == 0 and plan[-1].layer_end == 8
    assert all(a.layer_end == b.layer_start for a, b in zip(plan, plan[1:], strict=False))
    assert all(s.num_layers >= 1 for s in plan)


def test_without_a_budget_the_layers_are_balanced_and_a_budget_makes_the_end_stages_give_way() -> None:
    # No memory binds: the compute (the layers' own weights) is balanced, the embedding (a lookup) aside.
    assert [s.num_layers for s in plan_stages(inputs(layers=9, embed_mib=300, tail_mib=0), 3)] == [3, 3, 3]
    # Ties go to the smaller memory: the embedding's stage takes the shorter range.
    assert [s.num_layers for s in plan_stages(inputs(layers=8, embed_mib=300, tail_mib=0), 3)] == [2, 3, 3]
    # A budget binds: stage 0 carries the embedding, so it takes fewer layers.
    plan = plan_stages(inputs(layers=9, embed_mib=300, tail_mib=0), 3, [700 * MIB])
    assert plan[0].num_layers < plan[1].num_layers


def test_bigger_budget_takes_more_layers() -> None:
    plan = plan_stages(inputs(layers=12, embed_mib=0, tail_mib=0), 2, [16 * 1024 * MIB, 48 * 1024 * MIB])
    assert plan[1].num_layers > plan[0].num_layers


def test_impossible_plans_are_refused_with_reasons() -> None:
    with pytest.raises(PlanError, match="only 8 layers"):
        plan_stages(inputs(), 9)
    with pytest.raises(PlanError, match="does not fit"):
        plan_stages(inputs(), 2, [300 * MIB])
    with pytest.raises(PlanError, match="overlap"):
        plan_explicit(inputs(), [(0, 5), (4, 8)])
    with pytest.raises(PlanError, match="not assigned"):
        plan_explicit(inputs(), [(0, 3), (4, 8)])


def test_auto_picks_the_fewest_stages_that_fit() -> None:
    plan = plan_auto(inputs(), 700 * MIB)
    assert len(plan) == 2 and all(s.total_bytes <= 700 * MIB for s in plan)


def test_parse_bytes() -> None:
    assert parse_bytes("16GiB") == 16 * 1024**3
    assert parse_bytes("24G") == 24 * 1000**3
    assert parse_bytes("512Mi") == 512 * MIB
    with pytest.raises(PlanError):
        parse_bytes("lots")


def test_kv_reserve_follows_the_cache_dtype(tmp_path) -> None:
    from tiny_models import write_tiny_model

    from inferencemesh.checkpoint.read import read_local

    model = write_tiny_model(tmp_path / "m", "llama", num_layers=2, shards=1, dtype=torch.bfloat16)
    facts = read_local(model)
    half = PlanInputs.from_checkpoint(facts, kv_tokens=200)  # on a GPU: the checkpoint's
    on_cpu = PlanInputs.from_checkpoint(facts, kv_tokens=200, dtype="bfloat16", on_cpu=True)
    assert on_cpu.kv_bytes_per_layer == 2 * half.kv_bytes_per_layer  # a CPU stage's cache is float32
    assert on_cpu.layer_bytes == half.layer_bytes  # its weights bfloat16, as asked
    # auto on a CPU: float32 weights unless the CPU has native bf16 units
    emulated = PlanInputs.from_checkpoint(facts, kv_tokens=200, on_cpu=True, cpu_flags=frozenset({"avx2"}))
    native = PlanInputs.from_checkpoint(facts, kv_tokens=200, on_cpu=True, cpu_flags=frozenset({"avx2", "avx512_bf16"}))
    assert native.layer_bytes == half.layer_bytes
    assert emulated.layer_bytes == tuple(2 * b for b in half.layer_bytes)
    # the pool's positions, whatever the sessions: 500 of them cost 2.5 times 200
    pool = PlanInputs.from_checkpoint(facts, kv_tokens=500)
    assert pool.kv_bytes_per_layer * 200 == half.kv_bytes_per_layer * 500
    # 2 (K, V) x kv heads x head dim x 2 bytes (the checkpoint's bfloat16) x positions
    assert half.kv_bytes_per_layer == 2 * facts.num_kv_heads * facts.head_dim * 2 * 200


# ---- the first stage embedded in the frontend: stage 0's process also holds the draft ----------------------


def test_a_first_stage_reserve_counts_against_stage_0_only() -> None:
    from dataclasses import replace

    plain = inputs(layers=8, embed_mib=0, tail_mib=0)
    reserved = replace(plain, first_stage_reserved_bytes=300 * MIB)
    # no budget: the layers stay balanced (the reserve computes nothing); a budget that binds makes
    # stage 0 give up layers to the reserve it holds
    assert [s.num_layers for s in plan_stages(plain, 2)] == [s.num_layers for s in plan_stages(reserved, 2)] == [4, 4]
    assert [s.num_layers for s in plan_stages(plain, 2, [700 * MIB])] == [4, 4]
    embedded = plan_stages(reserved, 2, [700 * MIB])
    assert [s.num_layers for s in embedded] == [3, 5]
    assert embedded[0].reserved_bytes == 300 * MIB and embedded[1].reserved_bytes == 0
    assert embedded[0].total_bytes == 3 * 110 * MIB + 300 * MIB  # 3 layers of 100 MiB + 10 MiB KV, and the reserve
    # a budget that holds the split without the reserve refuses it with the reserve, saying why
    assert plan_explicit(plain, [(0, 4), (4, 8)], [450 * MIB])
    with pytest.raises(PlanError, match=r"stage 0 \(layers 0-3\) needs 740.00 MiB \(300.00 MiB of it the "
                                        r"frontend's draft beside the embedded first stage\) but has 450.00 MiB"):
        plan_explicit(reserved, [(0, 4), (4, 8)], [450 * MIB])
    # auto needs one stage more once stage 0 carries the reserve
    assert len(plan_auto(plain, 450 * MIB)) == 2 and len(plan_auto(reserved, 450 * MIB)) == 3
    assert plan_stages(plain, 2)[0].to_dict()["reserved_bytes"] == 0
    assert embedded[0].to_dict()["reserved_bytes"] == 300 * MIB
    assert "300.00 MiB held beside its layers" in render_plan(embedded)


def _bundled_draft_bytes(kv_tokens: int) -> int:
    """The bundled draft's float32 weights and KV for the pool's positions, counted from its files,
    not by the planner."""
    import json

    from safetensors import safe_open

    from inferencemesh.bundled import DRAFT_MODEL, bundled_path

    path = bundled_path(DRAFT_MODEL)
    config = json.loads((path / "config.json").read_text())
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        params = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118
    kv = 2 * config["num_key_value_heads"] * config["head_dim"] * 4 * kv_tokens * config["num_hidden_layers"]
    return params * 4 + kv


def test_serve_reserves_the_bundled_draft_in_the_embedded_first_stage() -> None:
    from inferencemesh.config import ServeConfig
    from inferencemesh.programs.plan import plan_from_settings

    def settings(**fields: object) -> ServeConfig:
        return ServeConfig(device="cpu", max_context=256, kv_cache_tokens=1024, **fields)

    def reserved(config: ServeConfig) -> int:
        return plan_from_settings(config)[2][0].reserved_bytes

    want = _bundled_draft_bytes(1024)  # the bundled target's package declares the bundled draft
    assert reserved(settings()) == want  # serve embeds by default
    assert reserved(settings(embed_first_stage=False)) == 0
    assert reserved(settings(speculative="ngram")) == 0  # no draft runs
    assert reserved(settings(no_draft=True)) == 0
    # the plan serve runs carries it on stage 0
    _, _, plan = plan_from_settings(settings())
    assert plan[0].reserved_bytes == want and all(s.reserved_bytes == 0 for s in plan[1:])
    _, _, separate = plan_from_settings(settings(embed_first_stage=False))
    assert plan[0].num_layers == separate[0].num_layers  # no budget: the layers are balanced either way
    # a budget stage 0's four layers fit only without the draft: it gives one up for it
    tight = plan[0].total_bytes - MIB
    assert plan[0].total_bytes - plan[0].reserved_bytes < tight
    tight = f"{tight // 1024}Ki"
    assert [s.num_layers for s in plan_from_settings(settings(stage_memory=tight))[2]] == [3, 5]


def test_an_unreadable_draft_reserves_nothing(tmp_path, capsys) -> None:
    from inferencemesh.config import ServeConfig
    from inferencemesh.programs.plan import plan_from_settings

    config = ServeConfig(device="cpu", draft=str(tmp_path / "no-such-draft"))
    assert plan_from_settings(config)[2][0].reserved_bytes == 0
    assert "no room for it" in capsys.readouterr().err


# ---- serve and the operator: one plan assembler --------------------------------------------------

SAME_REQUESTS = [  # (serve's flags, the spec's fields saying the same)
    ({"stages": 2}, {"stages": {"count": 2}}),
    ({"stages": 3, "embed_first_stage": False}, {"stages": {"count": 3}}),
    ({"stages": 2, "embed_first_stage": True}, {"stages": {"count": 2}, "frontend": {"embedFirstStage": True}}),
    ({"stages": 2, "embed_first_stage": True, "speculative": "ngram"},
     {"stages": {"count": 2}, "frontend": {"embedFirstStage": True}, "speculative": {"strategy": "ngram"}}),
    ({"stages": 2, "embed_first_stage": True, "no_draft": True},
     {"stages": {"count": 2}, "frontend": {"embedFirstStage": True}, "speculative": {"noDraft": True}}),
    ({"stages": "auto", "stage_memory": "320Mi", "embed_first_stage": True},
     {"stages": {"count": "auto", "memory": ["320Mi"]}, "frontend": {"embedFirstStage": True}}),
    ({"stages": 2, "stage_memory": "300Mi,400Mi", "kv_cache_tokens": 1536},
     {"stages": {"count": 2, "memory": ["300Mi", "400Mi"]}, "kvCacheTokens": 1536}),
]


@pytest.mark.parametrize(("flags", "fields"), SAME_REQUESTS)
def test_serve_and_the_operator_make_the_same_plan(flags: dict, fields: dict) -> None:
    """`serve` and the operator, asked the same of the bundled model (CPU stages, float32), make
    the same plan through the one assembler: the same ranges and bytes, the same draft reserved
    beside an embedded first stage, the same speculative choice."""
    from dataclasses import replace

    from inferencemesh.config import ServeConfig
    from inferencemesh.operator.modelfacts import ModelFacts
    from inferencemesh.operator.planning import make_plan
    from inferencemesh.operator.planning import plan_request as spec_request
    from inferencemesh.operator.spec import parse_spec
    from inferencemesh.programs.plan import plan_from_settings, plan_request

    common = {"device": "cpu", "dtype": "float32", "max_context": 256, "max_sessions": 4}
    flags = {"embed_first_stage": False, **flags}
    config = ServeConfig(**common, **flags)
    _, _, served = plan_from_settings(config)
    stages = {"gpus": 0, "device": "cpu", **fields.get("stages", {})}
    spec = parse_spec({"model": {"name": "bundled://imesh-code-target", "dtype": "float32"}, "contextLength": 256,
                       "maxSessions": 4, **fields, "stages": stages})
    planned = make_plan(spec, ModelFacts().info(spec))
    assert list(planned.stages) == served
    assert planned.embedded_first_stage == config.embed_first_stage
    # the two requests differ only where the operator bounds its work
    assert replace(spec_request(spec), max_auto_stages=64) == plan_request(config)
    assert planned.speculative.strategy == plan_request(config).speculative_choice(Path(resolve_model(None))).strategy
