"""The one assembly of a mesh's plan, for `serve`/`plan` and the operator alike.

A plan is made in three steps, each decided here once: the speculative strategy the frontend
will run (inferencemesh.speculation, read from the model package as the frontend reads it), what
stage 0's process then holds beside its layers (planner.first_stage_reserve: the draft, with the
first stage embedded in the frontend), and the layer ranges of the planner's inputs with that
reserve (explicit ranges sized, the fewest stages that fit, or a count of stages). The callers
differ only in what is theirs: how they read a model and its draft (a local process from disk or
the hub, the operator from what it can reach), the operator's bounds on hostile specs, and the
command line's printing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from inferencemesh.checkpoint.facts import CheckpointFacts
from inferencemesh.config import DEFAULT_KV_CONTEXTS, DEFAULT_MAX_CONTEXT
from inferencemesh.planner import (
    FirstStageReserve,
    PlanError,
    PlanInputs,
    StagePlan,
    first_stage_reserve,
    plan_auto,
    plan_explicit,
    plan_stages,
)
from inferencemesh.speculation import SpeculativeChoice, choose_for_model

MAX_AUTO_STAGES = 64  # "auto" tries stage counts up to this


@dataclass(frozen=True)
class PlanRequest:
    """What a plan is asked for: `serve`'s and `plan`'s flags and a mesh's spec both say it."""

    stages: int | str  # a count of stages, or "auto": the fewest of `memory` each that hold the model
    memory: tuple[int, ...] = ()  # bytes: one budget for every stage, or one per stage; () none binds
    ranges: tuple[tuple[int, int], ...] = ()  # explicit [start, end) layer ranges, one per stage
    max_auto_stages: int = MAX_AUTO_STAGES
    embed_first_stage: bool = False  # stage 0 runs in the frontend's process, beside its draft
    dtype: str | None = None  # the stages' compute dtype as asked (auto / None: compute_dtype's choice)
    on_cpu: bool = False  # the stages compute on a CPU (the dtype auto chooses there, a float32 KV cache)
    kv_tokens: int = DEFAULT_KV_CONTEXTS * DEFAULT_MAX_CONTEXT  # a stage's KV pool (config.kv_pool_tokens)
    # The speculative options as given (None: unset, the model package's declaration decides).
    strategy: str | None = None
    draft: str | None = None
    no_draft: bool = False
    window: str | None = None

    def speculative_choice(self, model_dir: Path | None) -> SpeculativeChoice:
        """What the frontend will run, decided as the frontend decides it, with the model package
        read from `model_dir` (None: no package can be read)."""
        return choose_for_model(model_dir, strategy=self.strategy, draft=self.draft, no_draft=self.no_draft,
                                window=self.window)


@dataclass(frozen=True)
class AssembledPlan:
    stages: tuple[StagePlan, ...]
    speculative: SpeculativeChoice  # what the frontend will run
    reserve: FirstStageReserve  # what stage 0's process holds beside its layers, and the sentence why


def assemble_plan(inputs: PlanInputs, request: PlanRequest, *, model_dir: Path | None,
                  read_draft: Callable[[str], CheckpointFacts]) -> AssembledPlan:
    """The plan for `request` of a model whose planner inputs are `inputs` (its first stage's reserve
    not yet in them) and whose package, if readable, is at `model_dir`; `read_draft` reads the
    draft the frontend will load. Raises PlanError with a user-facing message; errors of
    `read_draft` that mean "try again later" propagate."""
    choice = request.speculative_choice(model_dir)
    reserve = first_stage_reserve(choice, read_draft, embed_first_stage=request.embed_first_stage,
                                  dtype=request.dtype, on_cpu=request.on_cpu, kv_tokens=request.kv_tokens)
    if reserve.bytes:
        inputs = dataclasses.replace(inputs, first_stage_reserved_bytes=reserve.bytes)
    return AssembledPlan(split_layers(inputs, request), choice, reserve)


def split_layers(inputs: PlanInputs, request: PlanRequest) -> tuple[StagePlan, ...]:
    """The layer ranges alone (the first stage's reserve already in `inputs`). Raises PlanError."""
    return _split(inputs, request.stages, request.memory, request.ranges, request.max_auto_stages)


# Cached: the operator plans the same mesh again on every reconcile, and a plan of many layers
# and stages costs up to a second or two.
@lru_cache(maxsize=256)
def _split(inputs: PlanInputs, stages: int | str, memory: tuple[int, ...], ranges: tuple[tuple[int, int], ...],
           max_auto_stages: int) -> tuple[StagePlan, ...]:
    budgets = list(memory) or None
    if ranges:
        return tuple(plan_explicit(inputs, list(ranges), budgets))
    if stages == "auto":
        if len(memory) != 1:
            raise PlanError("a plan of auto stages needs exactly one memory size (the memory of each stage)")
        return tuple(plan_auto(inputs, memory[0], max_auto_stages))
    if not isinstance(stages, int):
        raise PlanError(f"stages must be a number or auto, not {stages!r}")
    return tuple(plan_stages(inputs, stages, budgets))
