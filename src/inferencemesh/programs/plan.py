"""`inferencemesh plan`: print the memory-planned layer ranges for a model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from inferencemesh.bundled import resolve_model
from inferencemesh.checkpoint import CheckpointError, CheckpointFacts, read_checkpoint
from inferencemesh.config import PlanConfig, ServeConfig
from inferencemesh.planner import (
    PlanError,
    PlanInputs,
    StagePlan,
    parse_bytes,
    plan_auto,
    plan_stages,
    render_plan,
)
from inferencemesh.planner import first_stage_reserve as planner_first_stage_reserve
from inferencemesh.speculation import choose_for_model


def plan_for(facts: CheckpointFacts, *, stages: str | int, stage_memory: str | None, dtype: str | None,
             context_length: int, max_sessions: int, prefix_cache_tokens: int = 0, on_cpu: bool = False,
             first_stage_reserved_bytes: int = 0) -> list[StagePlan]:
    """The plan `serve` and `plan` share: stages is a count or 'auto' (needs stage_memory); on_cpu:
    the stages compute on this machine's CPU (the dtype auto chooses there, a float32 KV cache);
    first_stage_reserved_bytes: what stage 0's process holds beside its layers (first_stage_reserve)."""
    inputs = PlanInputs.from_checkpoint(facts, dtype=dtype, context_length=context_length, max_sessions=max_sessions,
                                        prefix_cache_tokens=prefix_cache_tokens, on_cpu=on_cpu,
                                        first_stage_reserved_bytes=first_stage_reserved_bytes)
    memory = [parse_bytes(m) for m in stage_memory.split(",")] if stage_memory else None
    if str(stages) == "auto":
        if not memory or len(memory) != 1:
            raise PlanError("--stages auto needs exactly one --stage-memory size (the memory of each stage)")
        return plan_auto(inputs, memory[0])
    try:
        count = int(stages)
    except ValueError as err:
        raise PlanError(f"--stages must be a number or auto, not {stages!r}") from err
    return plan_stages(inputs, count, memory)


def _on_cpu(device: str | None) -> bool:
    if device == "auto":
        import torch  # only `serve` names a device; `plan` stays free of torch's start-up

        return not torch.cuda.is_available()
    return device == "cpu"


def first_stage_reserve(settings: ServeConfig | PlanConfig, model: str) -> int:
    """Bytes the first stage's process holds beside its layers (planner.first_stage_reserve, the
    rule the operator applies too), for the resolved `model`; an unreadable draft is noted on stderr."""
    choice = choose_for_model(Path(model) if Path(model).is_dir() else None, strategy=settings.speculative,
                              draft=settings.draft, no_draft=settings.no_draft)
    reserve = planner_first_stage_reserve(
        choice, lambda draft: read_checkpoint(resolve_model(draft)), embed_first_stage=settings.embed_first_stage,
        dtype=settings.dtype, on_cpu=_on_cpu(settings.device), context_length=settings.max_context,
        max_sessions=settings.max_sessions)
    if reserve.draft_unreadable:
        print(f"note: {reserve.note}", file=sys.stderr)
    return reserve.bytes


def plan_from_settings(settings: ServeConfig | PlanConfig) -> tuple[str, CheckpointFacts, list[StagePlan]]:
    """The model (resolved), its checkpoint's facts and its plan for `serve`'s or `plan`'s config
    (the same fields). A model that cannot be planned ends the program: exit status 2, after one
    line saying why."""
    model = resolve_model(settings.model)
    try:
        facts = read_checkpoint(model, revision=settings.revision)
        return model, facts, plan_for(facts, stages=settings.stages, stage_memory=settings.stage_memory,
                                      dtype=settings.dtype, context_length=settings.max_context,
                                      max_sessions=settings.max_sessions,
                                      prefix_cache_tokens=settings.prefix_cache_tokens,
                                      on_cpu=_on_cpu(settings.device),
                                      first_stage_reserved_bytes=first_stage_reserve(settings, model))
    except (PlanError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def run_plan(config: PlanConfig) -> int:
    model, facts, plan = plan_from_settings(config)
    if config.layout:
        from inferencemesh.compute_dtype import choose_dtype
        from inferencemesh.operator.modelfacts import layout_of

        on_cpu = _on_cpu(config.device)
        dtype = choose_dtype(config.dtype, facts.checkpoint_dtype, on_cpu=on_cpu).name
        layout = {"layout": layout_of(facts, dtype=dtype, on_cpu=on_cpu).model_dump(by_alias=True)}
        print(json.dumps(layout, indent=2) if config.json else yaml.safe_dump(layout, sort_keys=False).rstrip("\n"))
        return 0
    if config.json:
        print(json.dumps({"model": model, "stages": [s.to_dict() for s in plan]}, indent=2))
    else:
        print(f"model: {model}")
        print(render_plan(plan))
    return 0
