"""The pipelines a benchmark sends to: the whole model in this process, or a mesh of stage
processes on loopback as `inferencemesh serve` plans and starts them (its first stage a
process of its own, or embedded in this process as the frontend embeds it).

The in-process pipeline is built in one place, `in_process_pipeline`, so that a change of the
in-process stage link is a change here only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from inferencemesh.config import (
    DEFAULT_DRAFT_THREADS,
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_SESSIONS,
    FrontendConfig,
    kv_pool_tokens,
)
from inferencemesh.cpus import share_of_cpus
from inferencemesh.planner import PlanInputs, plan_stages
from inferencemesh.programs.bench.models import BenchModel
from inferencemesh.programs.local_stages import LocalStages, stage_template
from inferencemesh.programs.mesh import frontend_pipeline
from inferencemesh.programs.mesh import in_process_pipeline as in_process_mesh_pipeline
from inferencemesh.protocol.transport import message_limit

if TYPE_CHECKING:
    from inferencemesh.frontend.engine.pipeline import HopPipeline

# How a mesh's first stage runs: its own process ("process") or inside the frontend, here the
# bench process ("embedded", what `serve` runs by default); and the label each form's results carry.
FIRST_STAGE_LABELS = {"embedded": "embedded", "process": "grpc"}


def in_process_pipeline(model: BenchModel, max_context: int) -> HopPipeline:
    """The whole model as one stage in this process: no network, no other process."""
    from inferencemesh.modeling.runtime import StageRuntime

    return in_process_mesh_pipeline([StageRuntime(model.model_dir, 0, model.facts.num_layers, dtype=model.dtype_name,
                                                  max_context=max_context, quantization=model.quantization)])


@dataclass
class BenchMesh:
    """Stage processes on loopback, as `inferencemesh serve` plans and starts them, and the
    pipeline this process (the frontend) sends to; `threads`: this process's torch threads."""

    stages: LocalStages
    pipeline: HopPipeline  # a frontend.pipeline.GrpcPipeline
    threads: int
    label: str


def start_mesh(model_dir: Path, dtype_name: str, count: int, max_context: int, env: dict[str, str] | None = None,
               first_stage: str = "process", quantization: str | None = None) -> BenchMesh:
    from inferencemesh.checkpoint.read import read_local
    from inferencemesh.modeling.runtime import StageRuntime

    facts = read_local(model_dir)
    plan = plan_stages(PlanInputs.from_checkpoint(facts, dtype=dtype_name, kv_tokens=kv_pool_tokens(0, max_context),
                                                  quantization=quantization), count)
    limit = message_limit(hidden_size=facts.hidden_size, vocab_size=facts.vocab_size,
                          max_batch_tokens=DEFAULT_MAX_BATCH_TOKENS, max_sessions=DEFAULT_MAX_SESSIONS,
                          max_context=max_context)
    # serve's threads rule (each stage its share of the cores) unless the variant sets OMP_NUM_THREADS
    share = share_of_cpus(len(plan))
    threads = 0 if env and "OMP_NUM_THREADS" in env else share
    embed = first_stage == "embedded"
    stages = LocalStages(stage_template(str(model_dir), dtype=dtype_name, max_context=max_context, threads=threads,
                                        max_message_bytes=limit, quantization=quantization),
                         plan, env=env, embed_first=embed)
    stages.start()
    try:
        stages.wait_ready(600)
    except BaseException:
        stages.stop()
        raise
    frontend = FrontendConfig(model=str(model_dir), stage_addresses=tuple(stages.addresses), dtype=dtype_name,
                              max_context=max_context, first_stage_layers=stages.first_stage_layers,
                              max_message_bytes=limit, quantization=quantization).check()
    runtime = None
    if embed:  # loaded here, before the clock runs (the frontend loads it in the background)
        assert stages.first_stage_layers is not None  # started with embed_first
        runtime = StageRuntime(model_dir, *stages.first_stage_layers, dtype=dtype_name, max_context=max_context,
                               quantization=quantization)
    own_threads = int(env["OMP_NUM_THREADS"]) if env and "OMP_NUM_THREADS" in env else share
    label = f"{FIRST_STAGE_LABELS[first_stage]}-{count}-stage" + ("s" if count > 1 else "")
    return BenchMesh(stages, frontend_pipeline(frontend, first_stage_runtime=runtime),
                     own_threads if embed else DEFAULT_DRAFT_THREADS, label)


@contextmanager
def meshes() -> Iterator[list[BenchMesh]]:
    """A list to put started meshes in; every one is stopped on the way out, whatever happened."""
    started: list[BenchMesh] = []
    try:
        yield started
    finally:
        for mesh in started:
            mesh.stages.stop()
