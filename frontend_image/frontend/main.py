"""`inferencemesh frontend`: the OpenAI endpoint in front of a pipeline of stage servers."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from inferencemesh.bundled import resolve_model
from inferencemesh.checkpoint import CONFIG_FILES, is_local

log = logging.getLogger("inferencemesh.frontend")


def local_model_dir(source: str, *, revision: str | None = None, cache_dir: str | None = None) -> Path:
    """A directory with the model's config and tokenizer files; hub ids fetch only those."""
    if is_local(source):
        return Path(source)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(source, revision=revision, cache_dir=cache_dir, allow_patterns=CONFIG_FILES))


def build_engine(args: argparse.Namespace, model_dir: Path, tokenizer, metrics):
    from inferencemesh.frontend.engine import EngineOptions, PipelineEngine
    from inferencemesh.frontend.pipeline import GrpcPipeline
    from inferencemesh.frontend.speculative import resolve_speculation

    name = metrics.model
    speculation = resolve_speculation(args, model_dir, tokenizer, metrics)
    from inferencemesh import tls

    addresses = [a.strip() for a in args.stage_addresses.split(",") if a.strip()]
    pipeline = GrpcPipeline(addresses, tls=tls.load(args.tls_dir))
    options = EngineOptions(model_name=name, max_context=args.max_context, max_sessions=args.max_sessions,
                            debug_telemetry=args.debug_telemetry)
    return PipelineEngine(pipeline, options, proposer_for=speculation.proposer_for,
                          describe={"speculative": speculation.describe()}), speculation


def run_frontend(args: argparse.Namespace) -> int:
    import torch
    import uvicorn
    from transformers import AutoTokenizer

    from inferencemesh.frontend.app import create_app
    from inferencemesh.frontend.metrics import FrontendMetrics

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(max(1, args.draft_threads))  # the draft is this process's only tensor work
    source = resolve_model(args.model)
    model_dir = local_model_dir(source, revision=args.revision, cache_dir=args.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    metrics = FrontendMetrics(args.served_model_name or model_dir.name)
    engine, speculation = build_engine(args, model_dir, tokenizer, metrics)
    log.info("speculative decoding: %s (%s)", speculation.strategy, speculation.reason)
    app = create_app(
        engine, tokenizer, served_model_name=engine.model_name,
        api_key=os.environ.get(args.api_key_env) or None, max_body_bytes=args.max_body_bytes, metrics=metrics,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5)
    return 0
