"""The memory planner: contiguous ranges, planned by bytes and budgets, with clear refusals."""

from __future__ import annotations

import pytest
import torch

from inferencemesh.planner import PlanError, PlanInputs, parse_bytes, plan_auto, plan_explicit, plan_stages

MIB = 1024**2


def inputs(layers: int = 8, layer_mib: int = 100, embed_mib: int = 200, tail_mib: int = 200) -> PlanInputs:
    return PlanInputs([layer_mib * MIB] * layers, embed_mib * MIB, tail_mib * MIB, 10 * MIB, 0)


def test_ranges_are_contiguous_and_cover_every_layer() -> None:
    plan = plan_stages(inputs(), 3)
    assert plan[0].layer_start == 0 and plan[-1].layer_end == 8
    assert all(a.layer_end == b.layer_start for a, b in zip(plan, plan[1:], strict=False))
    assert all(s.num_layers >= 1 for s in plan)


def test_end_stages_take_fewer_layers_for_embedding_and_head() -> None:
    plan = plan_stages(inputs(layers=8, embed_mib=300, tail_mib=300), 2)
    assert [s.num_layers for s in plan] == [4, 4]
    plan = plan_stages(inputs(layers=9, embed_mib=300, tail_mib=0), 3)
    assert plan[0].num_layers < plan[1].num_layers  # stage 0 carries the embedding


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

    from inferencemesh.checkpoint import read_local

    model = write_tiny_model(tmp_path / "m", "llama", num_layers=2, shards=1, dtype=torch.bfloat16)
    facts = read_local(model)
    half = PlanInputs.from_checkpoint(facts, context_length=100, max_sessions=2)
    on_cpu = PlanInputs.from_checkpoint(facts, context_length=100, max_sessions=2, kv_dtype="float32")
    assert on_cpu.kv_bytes_per_layer == 2 * half.kv_bytes_per_layer
    assert on_cpu.layer_bytes == half.layer_bytes
