"""Container resources: a stage's compute threads from its CPU request or limit, its resources with
the GPU limit, and the sum of several containers' resources (an embedded first stage's pod)."""

from __future__ import annotations

import copy
import math
from decimal import Decimal

from kubernetes.utils.quantity import parse_quantity

from inferencemesh.operator.spec import MeshSpec

GPU_RESOURCE = "nvidia.com/gpu"


def stage_threads(spec: MeshSpec, *, shares_pod: bool = False) -> int:
    """A stage's compute threads. With a CPU limit, 0: the stage reads its cgroup quota, unless it
    shares its pod (the embedded first stage: the pod's quota is the stage's plus the frontend's),
    then the limit rounded up. Without one, its CPU request rounded up: torch would otherwise size
    its team by the node's cores, and stage pods sharing a node would preempt each other mid-kernel."""
    resources = spec.stages.resources or {}
    limit = (resources.get("limits") or {}).get("cpu")
    if limit:
        return max(1, math.ceil(parse_quantity(str(limit)))) if shares_pod else 0
    request = (resources.get("requests") or {}).get("cpu")
    return max(1, math.ceil(parse_quantity(str(request)))) if request else 0

def stage_resources(spec: MeshSpec) -> dict:
    """The container resources of a stage: stages.resources with the stages.gpus GPU limit."""
    resources = copy.deepcopy(spec.stages.resources)
    if spec.stages.gpus:
        resources.setdefault("limits", {})[GPU_RESOURCE] = spec.stages.gpus
    return resources

def _format_quantity(value: Decimal) -> str:
    if value == value.to_integral_value():
        n = int(value)
        for suffix, size in (("Ti", 1024**4), ("Gi", 1024**3), ("Mi", 1024**2), ("Ki", 1024)):
            if n >= size and n % size == 0:
                return f"{n // size}{suffix}"
        return str(n)
    millis = value * 1000
    return f"{int(millis)}m" if millis == millis.to_integral_value() else str(value)

def sum_resources(*parts: dict) -> dict:
    """Container resources of one container doing the work of several: each requests/limits entry
    summed over the parts that set it (a limit only one part sets is that part's)."""
    total: dict = {}
    for part in parts:
        for section, amounts in (part or {}).items():
            if not isinstance(amounts, dict):  # e.g. `claims`: not a quantity map, kept as given
                total.setdefault(section, copy.deepcopy(amounts))
                continue
            into = total.setdefault(section, {})
            for name, amount in amounts.items():
                into[name] = (parse_quantity(str(into[name])) if name in into else Decimal(0)) \
                    + parse_quantity(str(amount))
    return {section: {k: _format_quantity(v) for k, v in amounts.items()} if isinstance(amounts, dict) else amounts
            for section, amounts in total.items()}
