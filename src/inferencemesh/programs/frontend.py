"""`inferencemesh frontend`: the OpenAI endpoint in front of a pipeline of stage servers."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from inferencemesh.bundled import resolve_model, served_name
from inferencemesh.checkpoint.read import fetch_config_dir
from inferencemesh.checkpoint.tokenizer import load_tokenizer
from inferencemesh.config import FrontendConfig, kv_pool_tokens
from inferencemesh.cpus import compute_threads
from inferencemesh.programs.mesh import frontend_pipeline
from inferencemesh.programs.process import LoadFailed
from inferencemesh.protocol.transport import KV_BLOCK_TOKENS

if TYPE_CHECKING:
    import socket
    from types import FrameType

    from transformers import PreTrainedTokenizerBase

    from inferencemesh.frontend.engine.engine import PipelineEngine
    from inferencemesh.frontend.engine.metrics import FrontendMetrics
    from inferencemesh.frontend.engine.proposers.build import Speculation
    from inferencemesh.frontend.openai.drain import Drain

log = logging.getLogger("inferencemesh.frontend")

# The last shutdown's grace, after a drain: the drain waited for the requests in flight, so only
# those it gave up on (its timeout), and a probe that came in at the end, are left; they are cut
# after this (uvicorn cancels their tasks), as a stop cuts them.
FINAL_GRACE_S = 1  # seconds (uvicorn's timeout_graceful_shutdown)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which drains on SIGTERM and SIGINT instead of stopping at once
    (frontend/openai/drain.py): /ready and new requests get 503, the socket stays open, and the server
    stops when nothing is in flight or drain_timeout_s has passed. A second signal stops it at
    once; drain_timeout_s 0 stops at the first. The process then exits 0: the signals are not
    re-raised after serving (uvicorn's own handle_exit records them for that)."""

    def __init__(self, config: uvicorn.Config, drain: Drain, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.drain, self.drain_timeout_s = drain, drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signalled = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: between two bytecodes of the loop's thread. The drain starts on the
        # loop (its log line and gauge take locks the interrupted code may hold).
        if self._signalled or self.drain_timeout_s <= 0 or not self.started or self._loop is None:
            if self._signalled and self._loop is not None:
                self._loop.call_soon_threadsafe(log.warning, "%s during the drain: stopping now",
                                                signal.Signals(sig).name)
                self.force_exit = True  # no wait for the connections: the requests are cut (end_requests)
            self.should_exit = True
            return
        self._signalled = True
        self._loop.call_soon_threadsafe(self.drain.start, self.drain_timeout_s)

    async def end_requests(self) -> None:
        """After serving: cancel the requests still running (those a drain's timeout or a second
        signal cut; uvicorn cancels the first kind already) and wait until they have unwound
        (their sessions released), FINAL_GRACE_S at most."""
        tasks = [task for task in self.server_state.tasks if not task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=FINAL_GRACE_S)

    async def on_tick(self, counter: int) -> bool:
        if not self.should_exit and self.drain.finished():
            self.should_exit = True
        return await super().on_tick(counter)


def build_engine(config: FrontendConfig, model_dir: Path, tokenizer: PreTrainedTokenizerBase,
                 metrics: FrontendMetrics,
                 on_failed: Callable[[str], None] | None = None) -> tuple[PipelineEngine, Speculation]:
    """The engine over the pipeline; `on_failed`: told why if an embedded first stage cannot load."""
    from inferencemesh.frontend.engine.engine import EngineOptions, PipelineEngine
    from inferencemesh.frontend.engine.proposers.build import resolve_speculation

    speculation = resolve_speculation(config, model_dir, tokenizer, metrics, dtype=config.dtype,
                                      device=config.device, max_context=config.max_context)
    pipeline = frontend_pipeline(config, metrics=metrics, on_failed=on_failed)
    options = EngineOptions(model_name=metrics.model, max_context=config.max_context,
                            max_sessions=config.max_sessions, debug_telemetry=config.debug_telemetry,
                            recovery_timeout_s=config.recovery_timeout,
                            speculative_disable_by_batch_size=config.speculative_disable_by_batch_size,
                            prefix_cache=config.prefix_cache,
                            kv_blocks=kv_pool_tokens(config.kv_cache_tokens, config.max_context) // KV_BLOCK_TOKENS)
    return PipelineEngine(pipeline, options, proposer_for=speculation.proposer_for,
                          describe={"speculative": speculation.describe()}, metrics=metrics), speculation


def compute_threads_of(config: FrontendConfig) -> int | None:
    """This process's torch threads: the embedded first stage's (the draft shares its thread and
    team), else the draft's, its only tensor work. None: leave OMP_NUM_THREADS in charge."""
    if config.first_stage_layers is not None:
        return compute_threads(config.threads, config.device)
    return max(1, config.draft_threads)


def run_frontend(config: FrontendConfig) -> int:
    from inferencemesh.frontend.engine.metrics import FrontendMetrics
    from inferencemesh.frontend.openai.app import create_app
    from inferencemesh.frontend.openai.drain import Drain
    from inferencemesh.frontend.openai.http_server import server_config

    # Logging, grad mode and threads were set by the CLI (programs.process.set_up_process).
    model_dir = fetch_config_dir(resolve_model(config.model), revision=config.revision, cache_dir=config.cache_dir)
    tokenizer = load_tokenizer(model_dir)
    metrics = FrontendMetrics(served_name(config.model, config.served_model_name))
    failure: list[str] = []

    def first_stage_failed(reason: str) -> None:
        # A frontend whose own first stage cannot load would never be ready: it stops at once and
        # exits with why (LoadFailed), so that `serve` and a pod's status say it without waiting.
        failure.append(reason)
        server.should_exit = True

    engine, speculation = build_engine(config, model_dir, tokenizer, metrics, on_failed=first_stage_failed)
    log.info("speculative decoding: %s (%s: %s)", speculation.strategy, speculation.choice.reason,
             speculation.choice.message)
    drain = Drain(metrics)
    app = create_app(
        engine, tokenizer, served_model_name=engine.model_name,
        api_key=os.environ.get(config.api_key_env) or None, max_body_bytes=config.max_body_bytes, metrics=metrics,
        drain=drain, body_timeout_s=config.body_timeout,
    )
    # header timeout, connection limit, keep-alive: frontend/openai/http_server.py
    server = DrainingServer(server_config(app, host=config.host, port=config.port, log_level="info",
                                          header_timeout_s=config.header_timeout,
                                          timeout_graceful_shutdown=FINAL_GRACE_S), drain, config.drain_timeout)

    async def serve() -> None:
        engine.pipeline.connect()  # on the serving loop: an embedded first stage starts loading now
        if engine.pipeline.embedded is not None:
            metrics.include(engine.pipeline.embedded.metrics_registry)  # stage 0's series on this /metrics
            o = config.first_stage()
            assert o is not None  # an embedded stage is configured by first_stage_layers
            log.info("first stage embedded: layers [%d, %d) of the pipeline's %d stages, then %s", o.layer_start,
                     o.layer_end, o.num_stages, ", ".join(config.stage_addresses) or "no stage process")
        try:
            await server.serve()
        finally:
            await server.end_requests()  # before the pipeline closes: a request under it would recover
            await engine.close()  # the pipeline's streams and sessions (an embedded stage's thread) end here

    asyncio.run(serve())
    # The interpreter's last collections walk every object torch and transformers made: 1.7 s of a
    # 2 s exit on 2 cores, measured. Frozen, they are skipped, and a drained pod is gone at once.
    gc.freeze()
    if failure:
        o = config.first_stage()
        assert o is not None  # only an embedded first stage reports a failure
        raise LoadFailed(f"stage 0 (in the frontend) cannot load layers {o.layer_start}:{o.layer_end}: {failure[0]}")
    return 0
