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


def compute_threads(requested: int) -> int | None:
    """Threads for a stage's compute: an explicit request, else None where OMP_NUM_THREADS
    already says (torch reads it), else the usable CPUs."""
    if requested > 0:
        return requested
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return usable_cpus()


def share_of_cpus(processes: int) -> int:
    """Threads for each of `processes` compute processes sharing this machine."""
    return max(1, usable_cpus() // max(1, processes))
