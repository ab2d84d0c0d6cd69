"""`inferencemesh plan`: print the memory-planned layer ranges for a model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from inferencemesh.bundled import resolve_model
from inferencemesh.checkpoint.errors import CheckpointError
from inferencemesh.checkpoint.facts import CheckpointFacts
from inferencemesh.checkpoint.read import read_checkpoint
from inferencemesh.config import PlanConfig, ServeConfig, kv_pool_tokens
from inferencemesh.plan_assembly import PlanRequest, assemble_plan
from inferencemesh.planner import PlanError, PlanInputs, StagePlan, parse_bytes, render_plan


def _on_cpu(device: str | None) -> bool:
    if device == "auto":
        import torch  # only `serve` names a device; `plan` stays free of torch's start-up

        return not torch.cuda.is_available()
    return device == "cpu"


def plan_request(settings: ServeConfig | PlanConfig) -> PlanRequest:
    """`serve`'s or `plan`'s flags (the same fields) in the plan assembler's terms. The window is
    left out: it shapes only how the frontend speculates, never what the plan holds."""
    memory = tuple(parse_bytes(m) for m in settings.stage_memory.split(",")) if settings.stage_memory else ()
    stages: int | str = str(settings.stages)
    if stages == "auto" and len(memory) != 1:
        raise PlanError("--stages auto needs exactly one --stage-memory size (the memory of each stage)")
    if stages != "auto":
        try:
            stages = int(stages)
        except ValueError as err:
            raise PlanError(f"--stages must be a number or auto, not {stages!r}") from err
    return PlanRequest(stages=stages, memory=memory, embed_first_stage=settings.embed_first_stage,
                       dtype=settings.dtype, on_cpu=_on_cpu(settings.device),
                       kv_tokens=kv_pool_tokens(settings.kv_cache_tokens, settings.max_context),
                       strategy=settings.speculative, draft=settings.draft, no_draft=settings.no_draft)


def plan_from_settings(settings: ServeConfig | PlanConfig) -> tuple[str, CheckpointFacts, list[StagePlan]]:
    """The model (resolved), its checkpoint's facts and its plan for `serve`'s or `plan`'s config
    (plan_assembly.assemble_plan, as the operator plans a mesh). A model that cannot be planned
    ends the program: exit status 2, after one line saying why; an unreadable draft is noted on
    stderr (stage 0 then holds no room for it)."""
    model = resolve_model(settings.model)
    try:
        facts = read_checkpoint(model, revision=settings.revision)
        if settings.quantization:
            from inferencemesh.operator.modelfacts import check_quantization  # the operator plans by the same rule

            check_quantization(facts, settings.quantization, model)
        request = plan_request(settings)
        inputs = PlanInputs.from_checkpoint(facts, dtype=request.dtype, kv_tokens=request.kv_tokens,
                                            on_cpu=request.on_cpu, quantization=settings.quantization)
        plan = assemble_plan(inputs, request, model_dir=Path(model) if Path(model).is_dir() else None,
                             read_draft=lambda draft: read_checkpoint(resolve_model(draft)))
    except (PlanError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if plan.reserve.draft_unreadable:
        print(f"note: {plan.reserve.note}", file=sys.stderr)
    return model, facts, list(plan.stages)


def run_plan(config: PlanConfig) -> int:
    model, facts, plan = plan_from_settings(config)
    if config.layout:
        from inferencemesh.compute_dtype import choose_dtype
        from inferencemesh.operator.modelfacts import layout_of

        on_cpu = _on_cpu(config.device)
        dtype = choose_dtype(config.dtype, facts.checkpoint_dtype, on_cpu=on_cpu).name
        layout = {"layout": layout_of(facts, dtype=dtype, on_cpu=on_cpu, quantization=config.quantization)
                  .model_dump(by_alias=True)}
        print(json.dumps(layout, indent=2) if config.json else yaml.safe_dump(layout, sort_keys=False).rstrip("\n"))
        return 0
    if config.json:
        print(json.dumps({"model": model, "quantization": config.quantization, "stages": [s.to_dict() for s in plan]},
                         indent=2))
    else:
        print(f"model: {model}" + (f" ({config.quantization}, quantized at load)" if config.quantization else ""))
        print(render_plan(plan))
    return 0
