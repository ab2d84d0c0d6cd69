"""The stage service: one layer range of the model, one batch in and one batch out.

It loads the layers (downloading -> loading -> ready | failed), and carries out each batch:
RELEASE frames at once, the others in one forward pass over the stage's KV pool, a frame that fails failing
alone (it travels on as a Failure). Its worker (worker.py) holds the sessions and the codec.
Transport is not its business: the gRPC endpoint (server.py) and the in-process stage
(local.py) both feed it batches through a StageStream (stream.py).

Device work runs on the stage's one computing thread (compute.py's ComputeLane).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc
import torch

from inferencemesh.bundled import served_name
from inferencemesh.checkpoint.errors import CheckpointError
from inferencemesh.config import StageConfig, kv_pool_tokens
from inferencemesh.protocol import codec
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol.errors import Fault
from inferencemesh.protocol.transport import COMPUTE_KINDS, KIND_NAMES, KV_BLOCK_TOKENS
from inferencemesh.stage.compute import ComputeLane
from inferencemesh.stage.metrics import StageMetrics
from inferencemesh.stage.sessions import Owner
from inferencemesh.stage.worker import Job, StageWorker

if TYPE_CHECKING:
    from inferencemesh.modeling.runtime import StageRuntime

log = logging.getLogger("inferencemesh.stage")


class StageService:
    """One stage's layer range: its loading, its batches, and its sessions beyond one batch.
    compute: where device work runs (a ThreadPoolExecutor of one thread unless given)."""

    def __init__(self, options: StageConfig, metrics: StageMetrics | None = None, runtime: StageRuntime | None = None,
                 compute: Executor | None = None) -> None:
        self.options = options
        self.metrics = metrics or StageMetrics(served_name(options.model, options.served_model_name),
                                               options.stage_index, host=options.host)
        self.index = options.stage_index
        self.is_first = options.stage_index == 0
        self.is_last = options.stage_index == options.num_stages - 1
        self.debug = options.debug_telemetry
        self.compute = ComputeLane(compute or ThreadPoolExecutor(1, thread_name_prefix="stage-compute"), self.metrics,
                                   self.index)
        # Told on the event loop whether the stage serves: True once the layers are loaded, False
        # when it stops (the gRPC server's health follows).
        self.on_serving: list[Callable[[bool], Awaitable[None]]] = []
        # Told on the event loop, with the one-line reason, when the layers cannot be loaded: the
        # program decides whether to exit (a stage process does, so that `serve` and a pod's
        # status learn why at once; the library stays up, reporting `failed` through Info).
        self.on_failed: list[Callable[[str], None]] = []
        # Called by close(): what its transports hold (a channel to the next stage).
        self.on_close: list[Callable[[], Awaitable[None]]] = []
        self._sweeper: asyncio.Task | None = None
        self.runtime: StageRuntime | None = None
        self.worker: StageWorker | None = None
        self.state, self.reason, self.progress = "downloading", "", 0.0
        self._last_log = 0.0
        if runtime is not None:
            self._adopt(runtime)
        self.metrics.set_state(self.state, self.progress)

    # ---- lifecycle -------------------------------------------------------------------------

    def load(self, loop: asyncio.AbstractEventLoop) -> None:
        """Load the layer range (on a background thread); the stage is ready once it is done."""
        from inferencemesh.bundled import resolve_model
        from inferencemesh.modeling.runtime import StageRuntime

        o = self.options
        try:
            runtime = StageRuntime(
                resolve_model(o.model), o.layer_start, o.layer_end, revision=o.revision, dtype=o.dtype, device=o.device,
                cache_dir=o.cache_dir, max_context=o.max_context, on_progress=self._on_progress,
                quantization=o.quantization,
            )
        except CheckpointError as err:  # the model cannot be had: say so in one line
            log.error("stage %d cannot load its layers: %s", o.stage_index, err)
            self._fail(loop, str(err))
            return
        except Exception as err:  # a bug, or what no check foresaw: the traceback in the log, one line as the reason
            log.exception("stage %d failed to load", o.stage_index)
            self._fail(loop, f"{type(err).__name__}: {err}")
            return
        worker = self._new_worker(runtime)  # here, not on the loop: its graphs' captures take seconds
        asyncio.run_coroutine_threadsafe(self._become_ready(runtime, worker), loop)

    def _fail(self, loop: asyncio.AbstractEventLoop, reason: str) -> None:
        reason = " ".join(reason.split())  # one line, wherever it is shown (Info, a log, a pod's status)
        self._set_state("failed", 0.0, reason)
        for listener in self.on_failed:
            loop.call_soon_threadsafe(listener, reason)

    async def _become_ready(self, runtime: StageRuntime, worker: StageWorker) -> None:
        """On the event loop, so no batch sees a half-ready stage: runtime, worker and state at once."""
        o = self._adopt(runtime, worker).options
        for listener in self.on_serving:
            await listener(True)
        log.info("stage %d ready: layers [%d, %d) of %d on %s (%s, %d threads), weights %d bytes%s", o.stage_index,
                 o.layer_start, o.layer_end, runtime.num_layers, runtime.device, runtime.dtype,
                 torch.get_num_threads(), runtime.weight_bytes,
                 f" ({o.quantization} at load)" if o.quantization else "")

    def _new_worker(self, runtime: StageRuntime) -> StageWorker:
        """The worker over the loaded runtime: its KV pool allocated, its decode graphs captured."""
        o = self.options
        wire_dtype = codec.DTYPE_NAMES[o.wire_dtype] if o.wire_dtype else None
        worker = StageWorker(runtime, is_first=self.is_first, is_last=self.is_last, max_sessions=o.max_sessions,
                             session_ttl=o.session_ttl, kv_blocks=self.kv_blocks, wire_dtype=wire_dtype,
                             metrics=self.metrics)
        # On a GPU, every decode graph its batches can need, captured before the stage says ready.
        captured, seconds = runtime.warm_decode_graphs(o.max_sessions)
        if captured:
            log.info("stage %d: %d decode graphs captured in %.1f s", o.stage_index, captured, seconds)
        return worker

    def _adopt(self, runtime: StageRuntime, worker: StageWorker | None = None) -> StageService:
        self.runtime = runtime
        self.worker = worker or self._new_worker(runtime)
        self.publish_totals()
        self._set_state("ready", 1.0)
        return self

    @property
    def kv_blocks(self) -> int:
        """Blocks in the stage's KV pool: config.kv_pool_tokens positions, in KV_BLOCK_TOKENS each."""
        return max(1, kv_pool_tokens(self.options.kv_cache_tokens, self.options.max_context) // KV_BLOCK_TOKENS)

    @property
    def ready(self) -> bool:
        return self.worker is not None

    def _on_progress(self, state: str, fraction: float) -> None:
        if state == "ready":  # the runtime is built; the stage is ready once _become_ready has run
            state = "loading"
        self._set_state(state, fraction)
        now = time.monotonic()
        if now - self._last_log > 2.0 or fraction >= 1.0:
            self._last_log = now
            log.info("stage %d %s: %3.0f%%", self.index, state, 100 * fraction)

    def _set_state(self, state: str, progress: float, reason: str = "") -> None:
        self.state, self.progress, self.reason = state, progress, reason
        self.metrics.set_state(state, progress)

    @property
    def loaded(self) -> StageWorker:
        """The worker, which exists once the layers are loaded: only a serving stage computes."""
        assert self.worker is not None, "the stage computes before its layers are loaded"
        return self.worker

    def info(self) -> pb.StageInfo:
        o, rt, worker = self.options, self.runtime, self.worker
        sessions = len(worker.sessions) if worker is not None else 0
        return pb.StageInfo(
            model=o.model, stage_index=o.stage_index, num_stages=o.num_stages, layer_start=o.layer_start,
            layer_end=o.layer_end, num_layers=rt.num_layers if rt else 0, is_first=self.is_first,
            is_last=self.is_last, state=self.state, state_reason=self.reason, progress=self.progress,
            hidden_size=rt.hidden_size if rt else 0, vocab_size=rt.vocab_size if rt else 0,
            wire_dtype=codec.WIRE_CODES[worker.wire_dtype] if worker else pb.DTYPE_UNSPECIFIED,
            active_sessions=sessions, max_sessions=o.max_sessions, max_context=o.max_context,
            device=str(rt.device) if rt else "", kv_block_tokens=KV_BLOCK_TOKENS,
            kv_blocks=worker.pool.num_blocks if worker is not None else 0,
        )

    # ---- per batch -------------------------------------------------------------------------

    async def step(self, batch: pb.Batch, owner: Owner) -> pb.Batch | pb.BatchResult:
        """Carry out one batch of `owner`'s stream (its sessions, and the ones it opens here).
        Returns what goes on: the batch for the next stage, or on the last stage the BatchResult."""
        worker = self.worker
        if worker is None:
            raise Fault(grpc.StatusCode.UNAVAILABLE, f"stage is {self.state}, not ready: {self.reason}".rstrip(": "))
        failures = list(batch.failures)
        carried: list[pb.Frame] = []  # RELEASE frames done here
        jobs: list[Job] = []
        rows = worker.unpack(batch)
        seen: set[str] = set()
        for frame in batch.frames:
            hidden = next(rows) if frame.kind in COMPUTE_KINDS else None
            try:
                if frame.session_id in seen:
                    raise Fault(grpc.StatusCode.INVALID_ARGUMENT,
                                f"two frames of session {frame.session_id!r} in one batch")
                seen.add(frame.session_id)
                if frame.kind == pb.RELEASE:
                    worker.release(frame.session_id, owner)
                    carried.append(frame)
                else:
                    session = worker.bind(frame, owner)
                    inputs = worker.inputs(frame, hidden)
                    jobs.append((session, frame, inputs, worker.admit(frame, session, owner)))
            except Fault as fault:
                failures.append(self._failed(frame, fault, owner))
        outs = await self.compute.forward(worker, jobs)
        computed = []
        for (_, frame, _, _), out in zip(jobs, outs, strict=True):
            if isinstance(out, Fault):
                failures.append(self._failed(frame, out, owner))
            else:
                computed.append((frame, out))
            if self.debug:  # per-frame detail only when asked for: nothing is formatted otherwise
                self._trace(frame)
        self.publish_totals()
        return worker.pack(batch.seq, failures, computed, carried)

    def _failed(self, frame: pb.Frame, fault: Fault, owner: Owner) -> pb.Failure:
        self.metrics.error(fault.code.name)
        return self.loaded.failure(frame, fault, self.index, owner)

    def _trace(self, frame: pb.Frame) -> None:
        waited_ms = (time.time_ns() - frame.sent_ns) / 1e6 if frame.sent_ns else float("nan")
        log.debug("session %s %s pos %d x%d: %.2f ms since the frontend sent it", frame.session_id,
                  KIND_NAMES[frame.kind], frame.pos_start, frame.token_count, waited_ms)

    # ---- sessions beyond one batch ---------------------------------------------------------

    def release_all(self, owner: Owner) -> None:
        """A stream ended: free the sessions it opened."""
        if self.worker is not None:
            self.worker.release_all(owner)
        self.publish_totals()

    def publish_totals(self) -> None:
        if self.worker is None:
            return
        worker = self.worker
        self.metrics.sessions_gauge.set(len(worker.sessions))
        self.metrics.blocks_gauge.set(worker.ledger.blocks_used)
        self.metrics.cached_gauge.set(worker.ledger.blocks_used * worker.pool.block_tokens)
        self.metrics.kv_gauge.set(worker.pool.nbytes())

    async def mark_not_serving(self) -> None:
        """The stage is stopping: it says so before its server goes."""
        for listener in self.on_serving:
            await listener(False)

    def start_sweeping(self) -> None:
        """On the serving loop: drop sessions idle past the TTL from now on."""
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        """Drop sessions idle past the TTL (a frontend that died never sends RELEASE)."""
        period = max(0.05, min(5.0, self.options.session_ttl / 4))
        while True:
            await asyncio.sleep(period)
            if self.worker is None:
                continue
            for session_id in self.worker.sessions.expired():
                log.info("dropping idle session %s after %.0fs", session_id, self.options.session_ttl)
                self.worker.sessions.release(session_id)
            self.publish_totals()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for closer in self.on_close:
            await closer()
        if self.metrics.endpoint is not None:
            self.metrics.endpoint.close()
        self.compute.shutdown()
