"""Memory-planned contiguous layer ranges: the one plan both `inferencemesh serve` and the operator use.

A stage's memory need is its layers' weight bytes, plus the embedding (first stage) and
final norm + LM head (last stage; a tied head reuses the embedding matrix), plus its layers' share of
the KV pool (config.kv_pool_tokens positions, which the stage allocates and the frontend gives out
in blocks), plus a fixed runtime overhead. A first stage embedded in the frontend process also holds what that process
needs beside its layers (the draft model: `draft_reserve_bytes`), given as
`PlanInputs.first_stage_reserved_bytes`. Ranges are chosen to minimise the largest stage's share of its memory
budget, so a 24 GiB GPU takes more layers than a 16 GiB one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from inferencemesh.checkpoint.errors import CheckpointError
from inferencemesh.checkpoint.facts import TORCH_DTYPE_BYTES, CheckpointFacts
from inferencemesh.compute_dtype import choose_dtype
from inferencemesh.config import DEFAULT_KV_CONTEXTS, DEFAULT_MAX_CONTEXT
from inferencemesh.speculation import SpeculativeChoice, draft_dtype

GIB = 1024**3
DEFAULT_OVERHEAD_BYTES = 256 * 1024**2  # allocator slack, activations, runtime
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


class PlanError(ValueError):
    """The request cannot be planned: more stages than layers, does not fit, bad ranges."""


@dataclass(frozen=True)
class StagePlan:
    index: int
    layer_start: int  # inclusive
    layer_end: int  # exclusive
    weight_bytes: int
    kv_reserve_bytes: int
    total_bytes: int  # weights + kv reserve + overhead + reserved
    memory_bytes: int | None  # the budget it was planned against, if any
    reserved_bytes: int = 0  # held beside the layers by the process it runs in (the embedded first stage's draft)

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PlanInputs:
    """Per-layer and end-stage byte counts in the serving dtype, and the KV reserve per layer."""

    layer_bytes: tuple[int, ...]
    embed_bytes: int
    tail_bytes: int  # final norm + LM head
    kv_bytes_per_layer: int
    overhead_bytes: int
    # Bytes the first stage's process holds beside its layers: with the first stage embedded in the
    # frontend, the draft model and its KV (draft_reserve_bytes). They count against stage 0's budget.
    first_stage_reserved_bytes: int = 0
    _prefix: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Hashable (plans can be cached) and with prefix sums, so stage_bytes is O(1) and the
        # planner stays O(stages x layers^2).
        object.__setattr__(self, "layer_bytes", tuple(self.layer_bytes))
        sums = [0]
        for size in self.layer_bytes:
            sums.append(sums[-1] + size)
        object.__setattr__(self, "_prefix", tuple(sums))

    @classmethod
    def from_checkpoint(
        cls,
        facts: CheckpointFacts,
        *,
        dtype: str | None = None,
        kv_tokens: int = DEFAULT_KV_CONTEXTS * DEFAULT_MAX_CONTEXT,
        overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
        first_stage_reserved_bytes: int = 0,
        on_cpu: bool = False,
        cpu_flags: frozenset[str] | None = None,
        quantization: str | None = None,
    ) -> PlanInputs:
        """dtype: as asked (auto / None: compute_dtype.choose_dtype's choice for a stage on_cpu or
        not, on a CPU with cpu_flags, None: this machine's). A stage on a CPU keeps its KV cache in
        float32 whatever it computes in (modeling.attention.kv_cache_dtype). The KV reserve is the
        pool: kv_tokens positions (config.kv_pool_tokens) per layer. quantization: the 16-bit
        checkpoint's linear layers, and the embedding and head (tied or not), quantized as the stages read
        them (int8, int4, fp8)."""
        dtype = choose_dtype(dtype, facts.checkpoint_dtype, on_cpu=on_cpu, flags=cpu_flags).name
        if dtype not in TORCH_DTYPE_BYTES:
            raise PlanError(f"unsupported dtype {dtype!r}; use one of {', '.join(TORCH_DTYPE_BYTES)}")
        width = TORCH_DTYPE_BYTES[dtype]
        kv_width = TORCH_DTYPE_BYTES["float32"] if on_cpu else width
        kv = 2 * facts.num_kv_heads * facts.head_dim * kv_width * kv_tokens
        return cls(
            layer_bytes=tuple(facts.layer_bytes(width, quantize=quantization)),
            embed_bytes=facts.group_bytes("embed", width, quantization),
            tail_bytes=facts.group_bytes("norm", width) + facts.head_bytes(width, quantization),
            kv_bytes_per_layer=kv,
            overhead_bytes=overhead_bytes,
            first_stage_reserved_bytes=first_stage_reserved_bytes,
        )

    def stage_bytes(self, start: int, end: int, num_layers: int) -> tuple[int, int, int]:
        """(weights, kv reserve, total) for a stage holding layers [start, end); the first stage's
        total includes first_stage_reserved_bytes."""
        weights = self.layer_weight_bytes(start, end)
        if start == 0:
            weights += self.embed_bytes
        if end == num_layers:
            weights += self.tail_bytes
        kv = self.kv_bytes_per_layer * (end - start)
        return weights, kv, weights + kv + self.overhead_bytes + self.reserved_bytes(start)

    def layer_weight_bytes(self, start: int, end: int) -> int:
        """The weights of layers [start, end) alone."""
        return self._prefix[end] - self._prefix[start]

    def reserved_bytes(self, start: int) -> int:
        return self.first_stage_reserved_bytes if start == 0 else 0


def draft_reserve_bytes(draft: CheckpointFacts, *, dtype: str | None, on_cpu: bool, kv_tokens: int) -> int:
    """What the frontend's draft model holds beside an embedded first stage (that stage's
    first_stage_reserved_bytes): all its weights, once (a tied head is the embedding matrix), and KV
    for as many positions as the pool (the draft keeps KV for live sessions only, whose tokens the
    pool bounds), in the dtype the frontend loads it in (speculation.draft_dtype). No runtime
    overhead of its own: the stage's process counts one."""
    inputs = PlanInputs.from_checkpoint(draft, dtype=draft_dtype(dtype, on_cpu), kv_tokens=kv_tokens,
                                        overhead_bytes=0, on_cpu=on_cpu)
    n = len(inputs.layer_bytes)
    weights, kv, _ = inputs.stage_bytes(0, n, n)
    if not draft.group_bytes("head"):  # tied: stage_bytes counted the embedding again as the head
        weights -= inputs.embed_bytes
    return weights + kv


@dataclass(frozen=True)
class FirstStageReserve:
    """What stage 0's process holds beside its layers, and the sentence that says why."""

    bytes: int
    note: str  # empty: the first stage is a process of its own
    draft_unreadable: bool = False


def first_stage_reserve(choice: SpeculativeChoice, read_draft: Callable[[str], CheckpointFacts], *,
                        embed_first_stage: bool, dtype: str | None, on_cpu: bool,
                        kv_tokens: int) -> FirstStageReserve:
    """The one rule for stage 0's reserve, for `plan`/`serve` and the operator alike: with the first
    stage embedded in the frontend, the draft model the frontend will load (`choice`, the
    frontend's own decision, inferencemesh.speculation), read by `read_draft` (each caller reads
    models its own way: a local process from disk or the hub, the operator from what it can
    reach); else nothing. A draft that cannot be read reserves nothing, and the note says so:
    the frontend then serves without it. Errors that mean "try again later" propagate."""
    if not embed_first_stage:
        return FirstStageReserve(0, "")
    if choice.strategy != "draft" or not choice.draft:
        return FirstStageReserve(0, "stage 0 runs in the frontend")
    try:
        reserved = draft_reserve_bytes(read_draft(choice.draft), dtype=dtype, on_cpu=on_cpu, kv_tokens=kv_tokens)
    except (CheckpointError, PlanError, OSError, ValueError, KeyError) as exc:
        return FirstStageReserve(0, f"stage 0 runs in the frontend; its draft {choice.draft} is unreadable here "
                                    f"({type(exc).__name__}: {exc}), so stage 0's plan holds no room for it", True)
    return FirstStageReserve(reserved, f"stage 0 runs in the frontend, with its draft {choice.draft} "
                                       f"({format_bytes(reserved)})")


def parse_bytes(text: str) -> int:
    """'16GiB', '24G', '512Mi', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGTkmgt]i?)?[Bb]?\s*", text)
    if not match:
        raise PlanError(f"cannot read memory size {text!r} (examples: 16GiB, 24G, 512Mi)")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def plan_stages(
    inputs: PlanInputs,
    num_stages: int,
    stage_memory: list[int] | None = None,
) -> list[StagePlan]:
    """Split the layers into num_stages contiguous ranges.

    With stage_memory (one budget per stage, or one for all), minimise the largest
    used/budget ratio and fail if any stage exceeds its budget. Without, no memory binds, and
    the stages' compute is what a pipeline waits on: balance the layers' own weight bytes (a
    stage's share of every prefill chunk's work; the embedding is a lookup, the first stage's
    reserve no work of its own), as vLLM splits layers evenly, and break ties by memory.
    """
    num_layers = len(inputs.layer_bytes)
    if num_stages < 1:
        raise PlanError("a mesh needs at least one stage")
    if num_stages > num_layers:
        raise PlanError(f"{num_stages} stages requested but the model has only {num_layers} layers")
    budgets = _budgets(stage_memory, num_stages)

    def cost(stage: int, start: int, end: int) -> tuple[float, float]:
        total = inputs.stage_bytes(start, end, num_layers)[2]
        if budgets:
            return total / budgets[stage], 0.0
        return float(inputs.layer_weight_bytes(start, end)), float(total)

    # best[s][j]: the smallest achievable max cost placing layers [0, j) on stages [0, s).
    inf = (float("inf"), float("inf"))
    best = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, num_stages + 1):
        for j in range(s, num_layers - (num_stages - s) + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == inf:
                    continue
                value = max(best[s - 1][i], cost(s - 1, i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    bounds = [num_layers]
    for s in range(num_stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.reverse()
    plan = []
    for index in range(num_stages):
        start, end = bounds[index], bounds[index + 1]
        plan.append(_stage_plan(inputs, index, start, end, budgets))
    if budgets:
        _check_fits(plan)
    return plan


def _stage_plan(inputs: PlanInputs, index: int, start: int, end: int, budgets: list[int] | None) -> StagePlan:
    weights, kv, total = inputs.stage_bytes(start, end, len(inputs.layer_bytes))
    return StagePlan(index, start, end, weights, kv, total, budgets[index] if budgets else None,
                     inputs.reserved_bytes(start))


def plan_auto(inputs: PlanInputs, memory_per_stage: int, max_stages: int = 64) -> list[StagePlan]:
    """The fewest stages of memory_per_stage each that hold the model.

    Counts that cannot fit by total bytes are skipped, so a hostile budget costs little.
    """
    n = len(inputs.layer_bytes)
    limit = min(max_stages, n)
    everything = inputs.stage_bytes(0, n, n)[2] - inputs.overhead_bytes
    biggest_layer = max(inputs.stage_bytes(i, i + 1, n)[2] for i in range(n))
    if biggest_layer > memory_per_stage or everything + limit * inputs.overhead_bytes > limit * memory_per_stage:
        raise PlanError(
            f"the model does not fit in up to {limit} stages of {format_bytes(memory_per_stage)} "
            f"(it needs about {format_bytes(everything)} plus per-stage overhead)"
        )
    start = max(1, math.ceil(everything / max(1, memory_per_stage - inputs.overhead_bytes)))
    last_error = None
    for count in range(start, limit + 1):
        try:
            return plan_stages(inputs, count, [memory_per_stage])
        except PlanError as err:
            last_error = err
    raise PlanError(f"no stage count up to {limit} fits {format_bytes(memory_per_stage)} per stage: {last_error}")


def plan_explicit(
    inputs: PlanInputs, ranges: list[tuple[int, int]], stage_memory: list[int] | None = None
) -> list[StagePlan]:
    """Check user-given ranges (contiguous, covering every layer once) and size them."""
    num_layers = len(inputs.layer_bytes)
    ordered = sorted(ranges)
    expected = 0
    for start, end in ordered:
        if start >= end:
            raise PlanError(f"layer range [{start}, {end}) is empty")
        if start < expected:
            raise PlanError(f"layer ranges overlap at layer {start}")
        if start > expected:
            raise PlanError(f"layers [{expected}, {start}) are not assigned to any stage")
        expected = end
    if expected != num_layers:
        raise PlanError(f"layer ranges end at {expected} but the model has {num_layers} layers")
    budgets = _budgets(stage_memory, len(ordered))
    plan = []
    for index, (start, end) in enumerate(ordered):
        plan.append(_stage_plan(inputs, index, start, end, budgets))
    if budgets:
        _check_fits(plan)
    return plan


def _budgets(stage_memory: list[int] | None, num_stages: int) -> list[int] | None:
    if not stage_memory:
        return None
    if len(stage_memory) == 1:
        return list(stage_memory) * num_stages
    if len(stage_memory) != num_stages:
        raise PlanError(f"{len(stage_memory)} memory sizes given for {num_stages} stages (give one, or one per stage)")
    if any(m <= 0 for m in stage_memory):
        raise PlanError("stage memory sizes must be positive")
    return list(stage_memory)


def _check_fits(plan: list[StagePlan]) -> None:
    for stage in plan:
        if stage.memory_bytes is not None and stage.total_bytes > stage.memory_bytes:
            beside = (f" ({format_bytes(stage.reserved_bytes)} of it the frontend's draft beside the embedded "
                      "first stage)" if stage.reserved_bytes else "")
            raise PlanError(
                f"stage {stage.index} (layers {stage.layer_start}-{stage.layer_end - 1}) needs "
                f"{format_bytes(stage.total_bytes)}{beside} but has {format_bytes(stage.memory_bytes)}: "
                "the model does not fit the given memory; add stages or memory, or lower contextLength/maxSessions"
            )


def render_plan(plan: list[StagePlan]) -> str:
    rows = ["stage  layers        weights      kv reserve   total        budget"]
    for s in plan:
        budget = format_bytes(s.memory_bytes) if s.memory_bytes else "-"
        rows.append(
            f"{s.index:<6} [{s.layer_start:>3}, {s.layer_end:>3})  {format_bytes(s.weight_bytes):<12} "
            f"{format_bytes(s.kv_reserve_bytes):<12} {format_bytes(s.total_bytes):<12} {budget}"
        )
    rows += [f"stage {s.index}'s total includes {format_bytes(s.reserved_bytes)} held beside its layers "
             "(the frontend's draft: the stage runs embedded in the frontend)" for s in plan if s.reserved_bytes]
    return "\n".join(rows)
