"""`inferencemesh plan`: print the memory-planned layer ranges for a model."""

from __future__ import annotations

import argparse
import json
import sys

from inferencemesh.bundled import resolve_model
from inferencemesh.checkpoint import CheckpointError, read_checkpoint
from inferencemesh.config import ServeConfig
from inferencemesh.planner import PlanError, PlanInputs, StagePlan, parse_bytes, plan_auto, plan_stages, render_plan


def plan_for(model: str, *, stages: str | int, stage_memory: str | None, dtype: str | None, context_length: int,
             max_sessions: int, revision: str | None = None, kv_dtype: str | None = None) -> list[StagePlan]:
    """The plan `serve` and `plan` share: stages is a count or 'auto' (needs stage_memory)."""
    facts = read_checkpoint(model, revision=revision)
    inputs = PlanInputs.from_checkpoint(facts, dtype=dtype, context_length=context_length, max_sessions=max_sessions,
                                        kv_dtype=kv_dtype)
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


def _kv_dtype(device: str | None) -> str | None:
    """Stages on CPU keep their KV cache in float32 (stage.attention); elsewhere in the model's dtype."""
    if device == "auto":
        import torch  # only `serve` names a device; `plan` stays free of torch's start-up

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return "float32" if device == "cpu" else None


def plan_from_settings(settings: ServeConfig | argparse.Namespace) -> tuple[str, list[StagePlan]] | None:
    """The model (resolved) and its plan for `serve`'s config or `plan`'s arguments (the same
    fields: model, revision, dtype, max_context, max_sessions, stages, stage_memory, device);
    None after printing why not."""
    model = resolve_model(settings.model)
    try:
        return model, plan_for(model, stages=settings.stages, stage_memory=settings.stage_memory,
                               dtype=settings.dtype, context_length=settings.max_context,
                               max_sessions=settings.max_sessions, revision=settings.revision,
                               kv_dtype=_kv_dtype(settings.device))
    except (PlanError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return None


def run_plan(args: argparse.Namespace) -> int:
    planned = plan_from_settings(args)
    if planned is None:
        return 2
    model, plan = planned
    if args.json:
        print(json.dumps({"model": model, "stages": [s.to_dict() for s in plan]}, indent=2))
    else:
        print(f"model: {model}")
        print(render_plan(plan))
    return 0
