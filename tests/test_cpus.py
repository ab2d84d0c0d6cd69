"""Compute threads: explicit > OMP_NUM_THREADS > one on a GPU, else the CPUs this process may use
(cgroup quota)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from inferencemesh import cpus
from inferencemesh.config import ServeConfig, StageConfig
from inferencemesh.flags import ConfigError


def test_a_cgroup_quota_bounds_the_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu_max = tmp_path / "cpu.max"
    monkeypatch.setattr(cpus, "CGROUP_V2_CPU_MAX", cpu_max)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(64)))
    cpu_max.write_text("150000 100000\n")  # a pod limited to 1.5 CPUs on a 64-core node
    assert cpus.usable_cpus() == 2
    cpu_max.write_text("max 100000\n")
    assert cpus.usable_cpus() == 64
    assert cpus.share_of_cpus(4) == 16 and cpus.share_of_cpus(128) == 1


def test_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpus, "usable_cpus", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpus.compute_threads(3) == 3 and cpus.compute_threads(0) == 8
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cpus.compute_threads(0) is None  # torch already reads it
    assert cpus.compute_threads(5) == 5


def test_a_process_on_a_gpu_computes_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its tensor work is on the GPU: the CPU team stays at GPU_PROCESS_THREADS unless a request or
    OMP_NUM_THREADS says otherwise; --device auto follows whether CUDA is there."""
    monkeypatch.setattr(cpus, "usable_cpus", lambda: 16)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpus.compute_threads(0, "cuda") == cpus.GPU_PROCESS_THREADS == 1
    assert cpus.compute_threads(0, "cpu") == 16 and cpus.compute_threads(6, "cuda") == 6
    assert cpus.share_of_cpus(2, "cuda") == 1 and cpus.share_of_cpus(2, "cpu") == 8
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpus.compute_threads(0, "auto") == 1 and cpus.share_of_cpus(4) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cpus.compute_threads(0, "auto") == 16 and cpus.share_of_cpus(4) == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpus.compute_threads(0, "cuda") is None


def test_negative_threads_are_refused() -> None:
    with pytest.raises(ConfigError, match="--threads"):
        StageConfig(model="m", layers=(0, 1), stage_index=0, num_stages=1, threads=-1).check()
    with pytest.raises(ConfigError, match="--stage-threads"):
        ServeConfig(stage_threads=-2).check()
