"""Where the stage meets the frontend: the pipelines whose hops are stages in this process.

The frontend library defines the hop (inferencemesh.frontend.engine.hops.Hop); the stage library
implements one over a StageService called directly (inferencemesh.stage.local.LocalStage); this
program joins them, as the libraries may not import each other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from inferencemesh import tls
from inferencemesh.config import DEFAULT_MAX_BATCH_TOKENS, DEFAULT_MAX_SESSIONS, FrontendConfig, StageConfig
from inferencemesh.frontend.engine.pipeline import GrpcPipeline, HopPipeline
from inferencemesh.stage.local import LocalStage

if TYPE_CHECKING:
    from inferencemesh.frontend.engine.metrics import FrontendMetrics
    from inferencemesh.modeling.runtime import StageRuntime


def frontend_pipeline(config: FrontendConfig, first_stage_runtime: StageRuntime | None = None,
                      metrics: FrontendMetrics | None = None,
                      on_failed: Callable[[str], None] | None = None) -> GrpcPipeline:
    """The stages a frontend sends to: the stage processes at --stage-addresses, after the embedded
    first stage when --first-stage-layers says this process runs one (its layers loaded in the
    background once the pipeline connects, unless given loaded: benchmarks; `on_failed` is told why
    if they cannot be)."""
    first_stage = config.first_stage()
    embedded = LocalStage(first_stage, runtime=first_stage_runtime, on_failed=on_failed) \
        if first_stage is not None else None
    return GrpcPipeline(list(config.stage_addresses), tls=tls.load(config.tls_dir), embedded=embedded,
                        max_batch_tokens=config.max_batch_tokens, max_message_bytes=config.max_message_bytes,
                        metrics=metrics)


def in_process_pipeline(runtimes: Sequence[StageRuntime], *, max_sessions: int = DEFAULT_MAX_SESSIONS,
                        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, step_timeout: float = 30.0,
                        kv_cache_tokens: int = 0) -> HopPipeline:
    """Every stage in this process, in pipeline order (loaded runtimes: benchmarks, tests), each
    sending to the next directly, behind the same step scheduler as a mesh of processes. Their KV
    pools: config.kv_pool_tokens(kv_cache_tokens, the runtimes' max_context), as the engine's must be."""
    stages: list[LocalStage] = []
    for index in reversed(range(len(runtimes))):  # the last first: each stage is given its next
        runtime = runtimes[index]
        config = StageConfig(model=str(runtime.model_dir), layers=(runtime.layer_start, runtime.layer_end),
                             stage_index=index, num_stages=len(runtimes), max_context=runtime.max_context,
                             max_sessions=max_sessions, kv_cache_tokens=kv_cache_tokens, host="127.0.0.1", port=0,
                             metrics_port=0)
        stages.insert(0, LocalStage(config, runtime=runtime, next_stage=stages[0] if stages else None))
    return HopPipeline(stages, step_timeout=step_timeout, max_batch_tokens=max_batch_tokens)
