"""From a spec and its model's facts to a plan: layer ranges per stage and the speculative strategy.

The ranges come from the data plane's planner (inferencemesh.planner), the same one
`inferencemesh serve` uses. This module only bounds its work (hostile specs must not stall the
operator) and asks the shared speculation rule what the frontend will run, for the status and,
with the first stage embedded in the frontend, for the draft that stage 0's memory must also hold.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache

from inferencemesh.operator.modelfacts import ModelFacts, ModelInfo
from inferencemesh.operator.spec import MAX_STAGES, MeshSpec
from inferencemesh.planner import (
    PlanError,
    PlanInputs,
    StagePlan,
    parse_bytes,
    plan_auto,
    plan_explicit,
    plan_stages,
)
from inferencemesh.planner import first_stage_reserve as shared_first_stage_reserve
from inferencemesh.protocol.transport import message_limit
from inferencemesh.speculation import SpeculativeChoice, choose_for_model

# The planner's dynamic programme is O(stages x layers^2); these keep one plan well under a second.
MAX_PLAN_LAYERS = 256


@dataclass(frozen=True)
class Plan:
    stages: tuple[StagePlan, ...]
    model_source: str
    speculative: SpeculativeChoice
    # Stage 0 runs in the frontend pod (spec.frontend.embedFirstStage): no stage-0 objects of its own.
    embedded_first_stage: bool = False
    note: str = ""  # for the Planned condition's message
    # Both ends of every stage stream take it (transport.message_limit); None where the operator
    # knows the model only by its spec.model.layout: the stages' fallback.
    message_limit: int | None = None

    def to_dict(self) -> dict:
        return {
            "modelSource": self.model_source,
            "stages": [s.to_dict() for s in self.stages],
            "speculative": {"strategy": self.speculative.strategy, "reason": self.speculative.reason},
            "embeddedFirstStage": self.embedded_first_stage,
            "maxMessageBytes": self.message_limit,
        }

    @property
    def remote_stages(self) -> range:
        """The indexes of the stages that run as stage pods: all but an embedded first stage."""
        return range(1 if self.embedded_first_stage else 0, len(self.stages))

    @property
    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def plan_layers(spec: MeshSpec, inputs: PlanInputs) -> list[StagePlan]:
    """The layer ranges for the spec. Raises PlanError with a user-facing message."""
    num_layers = len(inputs.layer_bytes)
    if num_layers > MAX_PLAN_LAYERS:
        raise PlanError(f"the model has {num_layers} layers; the operator plans models of up to {MAX_PLAN_LAYERS}")
    memory, source = stage_memory_budgets(spec)
    if memory and any(m <= 0 for m in memory):
        raise PlanError(f"{source}: stage memory sizes must be positive")
    try:
        return list(_cached_plan(inputs, spec.stages.count, tuple(spec.stages.ranges or ()),
                                 tuple(memory or ())))
    except PlanError as err:
        raise PlanError(f"{err} (memory budget from {source})" if memory else str(err)) from err


def stage_memory_budgets(spec: MeshSpec) -> tuple[list[int] | None, str]:
    """The per-stage memory the plan must fit, and where it came from: stages.memory when given;
    else, for CPU stages, the container's memory limit, since the layers, their KV reserve and the
    runtime all live in the pod's own memory (a plan beyond it would be OOM-killed while loading)."""
    if spec.stages.memory:
        return [parse_bytes(m) for m in spec.stages.memory], "stages.memory"
    limit = ((spec.stages.resources or {}).get("limits") or {}).get("memory")
    if limit and spec.stages.on_cpu:
        return [parse_bytes(str(limit))], f"stages.resources.limits.memory ({limit})"
    return None, "none"


@lru_cache(maxsize=256)
def _cached_plan(inputs: PlanInputs, count: int | str, ranges: tuple, memory: tuple) -> tuple[StagePlan, ...]:
    mem = list(memory) or None
    if ranges:
        return tuple(plan_explicit(inputs, list(ranges), mem))
    if count == "auto":
        assert mem is not None
        return tuple(plan_auto(inputs, mem[0], MAX_STAGES))
    assert isinstance(count, int)
    return tuple(plan_stages(inputs, count, mem))


def resolve_speculative(spec: MeshSpec, info: ModelInfo) -> SpeculativeChoice:
    """What the frontend will run: the decision the frontend makes, with the same reading of the model
    package (inferencemesh.speculation), where the operator can read the model (bundled or a path)."""
    sp = spec.speculative
    return choose_for_model(info.model_dir, strategy=sp.strategy, draft=sp.draft, no_draft=sp.no_draft,
                            window=sp.window.flag() if sp.window else None)


def first_stage_reserve(spec: MeshSpec, info: ModelInfo, choice: SpeculativeChoice,
                        facts: ModelFacts) -> tuple[int, str]:
    """What stage 0's process holds beside its layers, and a note for the Planned message
    (planner.first_stage_reserve: the rule `serve` and `plan` apply too), the draft read as the
    operator reads models; a hub outage raises ModelUnavailable (retried, like the model's own)."""
    reserve = shared_first_stage_reserve(
        choice, lambda draft: facts.draft_facts(draft, info), embed_first_stage=spec.frontend.embed_first_stage,
        dtype=spec.model.dtype, on_cpu=spec.stages.on_cpu, context_length=spec.context_length,
        max_sessions=spec.max_sessions)
    return reserve.bytes, reserve.note


def make_plan(spec: MeshSpec, info: ModelInfo, facts: ModelFacts | None = None) -> Plan:
    choice = resolve_speculative(spec, info)
    reserved, note = first_stage_reserve(spec, info, choice, facts or ModelFacts())
    inputs = dataclasses.replace(info.inputs, first_stage_reserved_bytes=reserved) if reserved else info.inputs
    shape = info.facts
    limit = message_limit(hidden_size=shape.hidden_size, vocab_size=shape.vocab_size,
                          max_batch_tokens=spec.max_batch_tokens, max_sessions=spec.max_sessions) if shape else None
    return Plan(tuple(plan_layers(spec, inputs)), info.source, choice, spec.frontend.embed_first_stage, note, limit)
