"""`inferencemesh frontend`: the OpenAI endpoint in front of a pipeline of stage servers."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from inferencemesh.bundled import resolve_model, served_name
from inferencemesh.checkpoint import fetch_config_dir
from inferencemesh.config import FrontendConfig

log = logging.getLogger("inferencemesh.frontend")


def build_engine(config: FrontendConfig, model_dir: Path, tokenizer, metrics):
    from inferencemesh import tls
    from inferencemesh.frontend.engine import EngineOptions, PipelineEngine
    from inferencemesh.frontend.pipeline import GrpcPipeline
    from inferencemesh.frontend.speculative import resolve_speculation

    speculation = resolve_speculation(config, model_dir, tokenizer, metrics, dtype=config.dtype,
                                      device=config.device, max_context=config.max_context)
    pipeline = GrpcPipeline(list(config.stage_addresses), tls=tls.load(config.tls_dir))
    options = EngineOptions(model_name=metrics.model, max_context=config.max_context,
                            max_sessions=config.max_sessions, debug_telemetry=config.debug_telemetry,
                            recovery_timeout_s=config.recovery_timeout,
                            speculative_disable_by_batch_size=config.speculative_disable_by_batch_size)
    return PipelineEngine(pipeline, options, proposer_for=speculation.proposer_for,
                          describe={"speculative": speculation.describe()}, metrics=metrics), speculation


def run_frontend(config: FrontendConfig) -> int:
    import torch
    import uvicorn
    from transformers import AutoTokenizer

    from inferencemesh.frontend.app import create_app
    from inferencemesh.frontend.metrics import FrontendMetrics

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(max(1, config.draft_threads))  # the draft is this process's only tensor work
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
    uvicorn.run(app, host=config.host, port=config.port, log_level="info", timeout_graceful_shutdown=5)
    return 0
