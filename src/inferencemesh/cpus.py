"""How many CPU threads a process's tensor work should use.

torch sizes its OpenMP team by the machine's cores, not by what the process may use: a pod
limited to 2 CPUs on a 64-core node would run 64 threads, and two local stage processes on a
2-core machine run 4 threads that preempt each other mid-kernel (measured: 2 stages, 8
streams, llama-150m: 54 tok/s with the default, 167 with 1 thread per stage).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_V2_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def usable_cpus() -> int:
    """The CPUs this process may run on, bounded by its cgroup's CPU quota (a container's limit)."""
    cpus = len(os.sched_getaffinity(0))
    quota = _cgroup_quota()
    return max(1, min(cpus, math.ceil(quota))) if quota else max(1, cpus)


def _cgroup_quota() -> float | None:
    try:
        quota, period = CGROUP_V2_CPU_MAX.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int(CGROUP_V1_QUOTA.read_text())
        return None if quota_us <= 0 else quota_us / int(CGROUP_V1_PERIOD.read_text())
    except (OSError, ValueError):
        return None


# A process whose tensors live on a GPU does little CPU work (token ids, masks, a sampled row), and
# an OpenMP team the size of the machine only contends with the CUDA driver's threads and the event
# loop (vLLM sets OMP_NUM_THREADS=1 for the same reason). Measured on an H200 with 16 cores
# (docs/benchmarks/gpu-h200-2026-11-27.json): one stage at 16 threads against 8, TTFT 53 -> 7 ms,
# and with the draft 33.8 -> 4.1 ms a token.
GPU_PROCESS_THREADS = 1


def on_gpu(device: str) -> bool:
    """Whether a process given --device `device` computes on a GPU (auto: where CUDA is)."""
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device == "cuda"


def compute_threads(requested: int, device: str = "auto") -> int | None:
    """Threads for a stage's compute: an explicit request, else None where OMP_NUM_THREADS
    already says (torch reads it), else GPU_PROCESS_THREADS on a GPU, else the usable CPUs."""
    if requested > 0:
        return requested
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return GPU_PROCESS_THREADS if on_gpu(device) else usable_cpus()


def share_of_cpus(processes: int, device: str = "auto") -> int:
    """Threads for each of `processes` compute processes sharing this machine (on a GPU, each
    GPU_PROCESS_THREADS)."""
    if on_gpu(device):
        return GPU_PROCESS_THREADS
    return max(1, usable_cpus() // max(1, processes))
