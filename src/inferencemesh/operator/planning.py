"""From a spec and its model's facts to a plan: layer ranges per stage and the speculative strategy.

The plan is assembled by inferencemesh.plan_assembly, as `inferencemesh serve` assembles its
own: the same speculation rule, the same first-stage reserve, the same planner. This module
only says the spec in the assembler's terms, reads the draft as the operator reads models, and
bounds the planner's work (hostile specs must not stall the operator).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from inferencemesh.operator.modelfacts import ModelFacts, ModelInfo
from inferencemesh.operator.spec import MAX_STAGES, MeshSpec
from inferencemesh.plan_assembly import PlanRequest, assemble_plan, split_layers
from inferencemesh.planner import PlanError, PlanInputs, StagePlan, parse_bytes
from inferencemesh.protocol.transport import message_limit
from inferencemesh.speculation import SpeculativeChoice

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


def plan_request(spec: MeshSpec) -> PlanRequest:
    """The spec in the plan assembler's terms."""
    memory, _ = stage_memory_budgets(spec)
    sp = spec.speculative
    return PlanRequest(
        stages=spec.stages.count, memory=tuple(memory or ()), ranges=tuple(spec.stages.ranges or ()),
        max_auto_stages=MAX_STAGES, embed_first_stage=spec.frontend.embed_first_stage, dtype=spec.model.dtype,
        on_cpu=spec.stages.on_cpu, kv_tokens=spec.kv_pool_tokens, strategy=sp.strategy, draft=sp.draft,
        no_draft=sp.no_draft, window=sp.window.flag() if sp.window else None)


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


@contextmanager
def _bounded(spec: MeshSpec, inputs: PlanInputs) -> Iterator[None]:
    """Refuses what the operator does not plan (too many layers, a budget of nothing) and names, in
    the planner's refusals, where the memory budget came from."""
    num_layers = len(inputs.layer_bytes)
    if num_layers > MAX_PLAN_LAYERS:
        raise PlanError(f"the model has {num_layers} layers; the operator plans models of up to {MAX_PLAN_LAYERS}")
    memory, source = stage_memory_budgets(spec)
    if memory and any(m <= 0 for m in memory):
        raise PlanError(f"{source}: stage memory sizes must be positive")
    try:
        yield
    except PlanError as err:
        raise PlanError(f"{err} (memory budget from {source})" if memory else str(err)) from err


def plan_layers(spec: MeshSpec, inputs: PlanInputs) -> list[StagePlan]:
    """The layer ranges for the spec of a model with planner inputs `inputs`, without a first-stage
    reserve. Raises PlanError with a user-facing message."""
    with _bounded(spec, inputs):
        return list(split_layers(inputs, plan_request(spec)))


def resolve_speculative(spec: MeshSpec, info: ModelInfo) -> SpeculativeChoice:
    """What the frontend will run: the decision the frontend makes, with the same reading of the model
    package, where the operator can read the model (bundled or a path)."""
    return plan_request(spec).speculative_choice(info.model_dir)


def make_plan(spec: MeshSpec, info: ModelInfo, facts: ModelFacts | None = None) -> Plan:
    """The mesh's plan (plan_assembly.assemble_plan), the draft read as the operator reads models:
    a hub outage raises ModelUnavailable (retried, like the model's own)."""
    reader = facts or ModelFacts()
    with _bounded(spec, info.inputs):
        assembled = assemble_plan(info.inputs, plan_request(spec), model_dir=info.model_dir,
                                  read_draft=lambda draft: reader.draft_facts(draft, info))
    shape = info.facts
    limit = message_limit(hidden_size=shape.hidden_size, vocab_size=shape.vocab_size,
                          max_batch_tokens=spec.max_batch_tokens, max_sessions=spec.max_sessions,
                          max_context=spec.context_length) if shape else None
    return Plan(assembled.stages, info.source, assembled.speculative, spec.frontend.embed_first_stage,
                assembled.reserve.note, limit)
