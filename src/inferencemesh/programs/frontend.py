"""`inferencemesh frontend`: the OpenAI endpoint in front of a pipeline of stage servers."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from inferencemesh.bundled import resolve_model, served_name
from inferencemesh.checkpoint import fetch_config_dir
from inferencemesh.config import FrontendConfig
from inferencemesh.cpus import compute_threads
from inferencemesh.programs.mesh import frontend_pipeline

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from inferencemesh.frontend.engine import PipelineEngine
    from inferencemesh.frontend.metrics import FrontendMetrics
    from inferencemesh.frontend.proposers.build import Speculation

log = logging.getLogger("inferencemesh.frontend")


def build_engine(config: FrontendConfig, model_dir: Path, tokenizer: PreTrainedTokenizerBase,
                 metrics: FrontendMetrics) -> tuple[PipelineEngine, Speculation]:
    from inferencemesh.frontend.engine import EngineOptions, PipelineEngine
    from inferencemesh.frontend.proposers.build import resolve_speculation

    speculation = resolve_speculation(config, model_dir, tokenizer, metrics, dtype=config.dtype,
                                      device=config.device, max_context=config.max_context)
    pipeline = frontend_pipeline(config, metrics=metrics)
    options = EngineOptions(model_name=metrics.model, max_context=config.max_context,
                            max_sessions=config.max_sessions, debug_telemetry=config.debug_telemetry,
                            recovery_timeout_s=config.recovery_timeout,
                            speculative_disable_by_batch_size=config.speculative_disable_by_batch_size,
                            prefix_cache=config.prefix_cache, prefix_cache_tokens=config.prefix_cache_tokens)
    return PipelineEngine(pipeline, options, proposer_for=speculation.proposer_for,
                          describe={"speculative": speculation.describe()}, metrics=metrics), speculation


def compute_threads_of(config: FrontendConfig) -> int | None:
    """This process's torch threads: the embedded first stage's (the draft shares its thread and
    team), else the draft's, its only tensor work. None: leave OMP_NUM_THREADS in charge."""
    if config.first_stage_layers is not None:
        return compute_threads(config.threads)
    return max(1, config.draft_threads)


def run_frontend(config: FrontendConfig) -> int:
    import uvicorn
    from transformers import AutoTokenizer

    from inferencemesh.frontend.app import create_app
    from inferencemesh.frontend.http_server import server_config
    from inferencemesh.frontend.metrics import FrontendMetrics

    # Logging, grad mode and threads were set by the CLI (programs.process.set_up_process).
    model_dir = fetch_config_dir(resolve_model(config.model), revision=config.revision, cache_dir=config.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    metrics = FrontendMetrics(served_name(config.model, config.served_model_name))
    engine, speculation = build_engine(config, model_dir, tokenizer, metrics)
    log.info("speculative decoding: %s (%s: %s)", speculation.strategy, speculation.choice.reason,
             speculation.choice.message)
    app = create_app(
        engine, tokenizer, served_model_name=engine.model_name,
        api_key=os.environ.get(config.api_key_env) or None, max_body_bytes=config.max_body_bytes, metrics=metrics,
    )
    # header timeout, connection limit, keep-alive: frontend.http_server
    server = uvicorn.Server(server_config(app, host=config.host, port=config.port, log_level="info",
                                          timeout_graceful_shutdown=5))

    async def serve() -> None:
        engine.pipeline.connect()  # on the serving loop: an embedded first stage starts loading now
        if engine.pipeline.embedded is not None:
            metrics.include(engine.pipeline.embedded.metrics_registry)  # stage 0's series on this /metrics
            o = config.first_stage()
            assert o is not None  # an embedded stage is configured by first_stage_layers
            log.info("first stage embedded: layers [%d, %d) of the pipeline's %d stages, then %s", o.layer_start,
                     o.layer_end, o.num_stages, ", ".join(config.stage_addresses) or "no stage process")
        await server.serve()

    asyncio.run(serve())
    return 0
