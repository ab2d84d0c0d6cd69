"""The stage server: one layer range of the model behind the gRPC Stage service.

Per upstream connection (the frontend's, or the previous stage's) it keeps one stream, and
opens one stream to the next stage for it, whatever the number of sessions: batches go down,
each computed here in one forward pass (its frames' sessions keep their own KV caches), and
the last stage's answers come back up the same streams. A frame that fails (a bad position, a
stale session, a bad payload) fails alone, and travels on as a Failure. Device work runs on
one compute thread; the event loop only moves batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from inferencemesh import tls
from inferencemesh.bundled import served_name
from inferencemesh.checkpoint import CheckpointError
from inferencemesh.config import StageConfig
from inferencemesh.protocol import codec
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol import stage_pb2_grpc as pb_grpc
from inferencemesh.protocol.errors import Fault
from inferencemesh.protocol.transport import COMPUTE_KINDS, GRPC_OPTIONS, KIND_NAMES, SERVICE_NAME
from inferencemesh.stage.metrics import StageMetrics
from inferencemesh.stage.sessions import SessionsFull, SessionTable, StageSession, fork, fork_refusal
from inferencemesh.stage.worker import StageWorker

log = logging.getLogger("inferencemesh.stage")



_END = object()  # the inbound stream closed


async def _pump(batches, inbox: asyncio.Queue) -> None:
    """Move inbound batches into the stream's inbox, where downstream faults also land."""
    try:
        async for batch in batches:
            inbox.put_nowait(batch)
    except asyncio.CancelledError:
        raise
    except Exception:  # the sender went away: same as a closed stream
        pass
    inbox.put_nowait(_END)


class DownstreamLink:
    """One upstream stream's stream to the next stage: batches go down it, and the results that
    come back up are relayed to the upstream as they are. If it breaks, a Fault lands in the
    upstream stream's inbox, which then ends with the same status: the frontend replays."""

    def __init__(self, stub: pb_grpc.StageStub, address: str, upstream, inbox: asyncio.Queue) -> None:
        self.address = address
        self.call = stub.Pipeline()
        self.finishing = False
        self.relay = asyncio.create_task(self._relay(upstream, inbox))

    async def _relay(self, upstream, inbox: asyncio.Queue) -> None:
        try:
            async for result in self.call:
                await upstream.write(result)
            if not self.finishing:
                inbox.put_nowait(Fault(grpc.StatusCode.UNAVAILABLE,
                                       f"downstream stage {self.address} ended the stream"))
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.CANCELLED:
                inbox.put_nowait(Fault(err.code(), f"downstream stage {self.address}: {err.details()}"))
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the upstream went away while a result was relayed
            inbox.put_nowait(Fault(grpc.StatusCode.CANCELLED, f"upstream gone: {err}"))

    async def send(self, batch: pb.Batch) -> None:
        try:
            await self.call.write(batch)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as err:
            raise Fault(grpc.StatusCode.UNAVAILABLE, f"downstream stage {self.address} unreachable: {err}") from err

    async def finish(self) -> None:
        """No more batches: wait until the next stage has answered those it has (it ends its
        stream once it has), so that every result reaches the upstream."""
        self.finishing = True
        with contextlib.suppress(Exception):
            await self.call.done_writing()
        with contextlib.suppress(Exception):
            await self.relay

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.call.done_writing()
        self.relay.cancel()
        self.call.cancel()


class StageService(pb_grpc.StageServicer):
    def __init__(self, options: StageConfig, metrics: StageMetrics | None = None, runtime=None,
                 compute: Executor | None = None) -> None:
        self.options = options
        self.metrics = metrics or StageMetrics(served_name(options.model, options.served_model_name),
                                                        options.stage_index)
        self.runtime = runtime
        self.state, self.reason, self.progress = ("ready", "", 1.0) if runtime else ("downloading", "", 0.0)
        self.sessions = SessionTable(options.max_sessions, options.session_ttl)
        # One compute thread: device work is serialised, one pass per batch; the event loop
        # only moves batches.
        self.compute = compute or ThreadPoolExecutor(1, thread_name_prefix="stage-compute")
        self.health = health.aio.HealthServicer()
        self.is_last = options.stage_index == options.num_stages - 1
        self.debug = options.debug_telemetry
        self.is_first = options.stage_index == 0
        self.worker = self._worker(runtime) if runtime else None
        self.tls = tls.load(options.tls_dir)
        self._downstream_channel: grpc.aio.Channel | None = None  # made on first use, on the serving loop
        self._wire_dtype: torch.dtype | None = None
        self._last_log = 0.0
        self.metrics.set_state(self.state, self.progress)

    @property
    def _downstream(self) -> pb_grpc.StageStub:
        """The stub of the next stage. A channel belongs to the event loop that makes it, so it
        is made on first use (a stage embedded in the frontend is built before its loop runs)."""
        if self._downstream_channel is None:
            self._downstream_channel = tls.aio_channel(self.options.downstream, self.tls, GRPC_OPTIONS)
            self._downstream_stub = pb_grpc.StageStub(self._downstream_channel)
        return self._downstream_stub

    def _worker(self, runtime) -> StageWorker:
        return StageWorker(runtime, is_first=self.is_first, is_last=self.is_last, metrics=self.metrics)

    # ---- lifecycle -------------------------------------------------------------------------

    def load(self, loop: asyncio.AbstractEventLoop) -> None:
        """Load the layer range on a background thread; flip health to SERVING when done."""
        from inferencemesh.bundled import resolve_model
        from inferencemesh.stage.runtime import StageRuntime

        o = self.options
        try:
            runtime = StageRuntime(
                resolve_model(o.model), o.layer_start, o.layer_end, revision=o.revision, dtype=o.dtype, device=o.device,
                cache_dir=o.cache_dir, max_context=o.max_context, on_progress=self._on_progress,
            )
        except CheckpointError as err:  # the model cannot be had: say so in one line, stay up, no crash loop
            log.error("stage %d cannot load its layers: %s", o.stage_index, err)
            self._set_state("failed", 0.0, str(err))
            return
        except Exception as err:  # a stage that cannot load reports why and stays up: no crash loop
            log.exception("stage %d failed to load", o.stage_index)
            self._set_state("failed", 0.0, f"{type(err).__name__}: {err}")
            return
        asyncio.run_coroutine_threadsafe(self._become_ready(runtime), loop)

    async def _become_ready(self, runtime) -> None:
        """On the event loop, so no RPC sees a half-ready stage: runtime, state and health at once."""
        o = self.options
        self.runtime = runtime
        self.worker = self._worker(runtime)
        self._set_state("ready", 1.0)
        await self.mark_serving()
        log.info("stage %d ready: layers [%d, %d) of %d on %s (%s, %d threads)", o.stage_index, o.layer_start,
                 o.layer_end, runtime.num_layers, runtime.device, runtime.dtype, torch.get_num_threads())

    def _on_progress(self, state: str, fraction: float) -> None:
        if state == "ready":  # the runtime is built; the stage is ready once _become_ready has run
            state = "loading"
        self._set_state(state, fraction)
        now = time.monotonic()
        if now - self._last_log > 2.0 or fraction >= 1.0:
            self._last_log = now
            log.info("stage %d %s: %3.0f%%", self.options.stage_index, state, 100 * fraction)

    def _set_state(self, state: str, progress: float, reason: str = "") -> None:
        self.state, self.progress, self.reason = state, progress, reason
        self.metrics.set_state(state, progress)

    async def mark_serving(self) -> None:
        for service in ("", SERVICE_NAME):
            await _maybe_await(self.health.set(service, health_pb2.HealthCheckResponse.SERVING))

    async def mark_not_serving(self) -> None:
        for service in ("", SERVICE_NAME):
            await _maybe_await(self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING))

    @property
    def wire_dtype(self) -> torch.dtype:
        if self._wire_dtype is None:
            name = self.options.wire_dtype
            self._wire_dtype = codec.DTYPE_NAMES[name] if name else self.runtime.dtype
        return self._wire_dtype

    # ---- RPCs ------------------------------------------------------------------------------

    async def Info(self, request: pb.InfoRequest, context) -> pb.StageInfo:
        o, rt = self.options, self.runtime
        sessions, _, _ = self.sessions.totals()
        return pb.StageInfo(
            model=o.model, stage_index=o.stage_index, num_stages=o.num_stages, layer_start=o.layer_start,
            layer_end=o.layer_end, num_layers=rt.num_layers if rt else 0, is_first=self.is_first,
            is_last=self.is_last, state=self.state, state_reason=self.reason, progress=self.progress,
            hidden_size=rt.hidden_size if rt else 0, vocab_size=rt.vocab_size if rt else 0,
            wire_dtype=codec.WIRE_CODES[self.wire_dtype] if rt else pb.DTYPE_UNSPECIFIED,
            active_sessions=sessions, max_sessions=o.max_sessions, max_context=o.max_context,
            device=str(rt.device) if rt else "",
        )

    async def Pipeline(self, request_iterator, context) -> None:
        """One upstream connection: its batches in order, each computed in one pass and sent on
        (or, on the last stage, answered); the sessions it opened are freed when it ends."""
        inbox: asyncio.Queue = asyncio.Queue()
        pump = asyncio.create_task(_pump(request_iterator, inbox))
        owned: set[str] = set()
        link: DownstreamLink | None = None
        try:
            while True:
                item = await inbox.get()
                if item is _END:  # the upstream is done sending: finish what is in flight below
                    if link is not None:
                        await link.finish()
                    return
                if isinstance(item, Fault):
                    raise item
                if self.runtime is None:
                    raise Fault(grpc.StatusCode.UNAVAILABLE,
                                f"stage is {self.state}, not ready: {self.reason}".rstrip(": "))
                out = await self._step(item, owned)
                if self.is_last:
                    await context.write(out)
                    continue
                if link is None:
                    link = DownstreamLink(self._downstream, self.options.downstream, context, inbox)
                sending = time.perf_counter()
                await link.send(out)
                self.metrics.send.observe(time.perf_counter() - sending)
                self.metrics.bytes_sent.inc(len(out.activations))
        except Fault as fault:
            self.metrics.error(fault.code.name)
            await context.abort(fault.code, f"stage {self.options.stage_index}: {fault.message}")
        finally:
            pump.cancel()
            for session_id in owned:  # the sender went away: free what it held (before any await:
                self._release(session_id)  # a cancelled handler may not get past one)
            if link is not None:
                await link.close()

    # ---- per batch -------------------------------------------------------------------------

    async def _step(self, batch: pb.Batch, owned: set[str]) -> pb.Batch | pb.BatchResult:
        """Carry out one batch: RELEASE and FORK frames at once, the others in one forward pass.
        A frame that fails becomes a Failure and fails alone. Returns what goes on: the batch
        for the next stage, or on the last stage the BatchResult."""
        failures = list(batch.failures)
        carried: list[pb.Frame] = []  # RELEASE and FORK frames done here
        jobs: list[tuple[StageSession, pb.Frame, torch.Tensor]] = []
        rows = self.worker.unpack(batch)
        seen: set[str] = set()
        for frame in batch.frames:
            hidden = next(rows) if frame.kind in COMPUTE_KINDS and not self.is_first else None
            try:
                if frame.session_id in seen:
                    raise Fault(grpc.StatusCode.INVALID_ARGUMENT,
                                f"two frames of session {frame.session_id!r} in one batch")
                seen.add(frame.session_id)
                if frame.kind == pb.RELEASE:
                    self._release(frame.session_id)
                    owned.discard(frame.session_id)
                    carried.append(frame)
                elif frame.kind == pb.FORK:
                    await self._fork(frame)
                    owned.add(frame.session_id)
                    carried.append(frame)
                else:
                    session = self._bind(frame)
                    owned.add(frame.session_id)
                    if isinstance(hidden, Fault):
                        raise hidden
                    jobs.append((session, frame, self.worker.inputs(frame, hidden)))
            except Fault as fault:
                failures.append(self._failed(frame, fault, owned))
        outs = await self._compute(jobs)
        computed = []
        for (_, frame, _), out in zip(jobs, outs, strict=True):
            if isinstance(out, Fault):
                failures.append(self._failed(frame, out, owned))
            else:
                computed.append((frame, out))
            if self.debug:  # per-frame detail only when asked for: nothing is formatted otherwise
                self._trace(frame)
        if self.is_last:
            result = pb.BatchResult(seq=batch.seq, failures=failures,
                                    predictions=[out for _, out in computed if out is not None])
            result.acks.extend(pb.Ack(seq=f.seq, session_id=f.session_id, kind=f.kind) for f in carried)
            return result
        down = pb.Batch(seq=batch.seq, failures=failures, frames=[f for f, _ in computed] + carried,
                        dtype=codec.WIRE_CODES[self.wire_dtype], hidden_size=self.runtime.hidden_size)
        if computed:
            down.activations = codec.encode(torch.cat([out for _, out in computed]), self.wire_dtype)
        return down

    async def _compute(self, jobs: list) -> list:
        """One forward pass over the jobs, on the compute thread; per job its output or Fault."""
        if not jobs:
            return []
        queued = time.perf_counter()

        def run() -> list:  # timed on the compute thread: event-loop delays count as neither
            started = time.perf_counter()
            try:
                return self.worker.compute_batch(jobs)
            finally:
                for _ in jobs:
                    self.metrics.queue_wait.observe(started - queued)
                self.metrics.observe_pass(time.perf_counter() - started)

        try:
            return await self._on_compute_thread(run)
        except Fault as fault:
            return [fault] * len(jobs)
        except Exception as err:  # the pass itself failed: every frame in it fails, the stage goes on
            log.exception("stage %d: a forward pass failed", self.options.stage_index)
            return [Fault(grpc.StatusCode.INTERNAL, f"forward pass failed: {type(err).__name__}: {err}")] * len(jobs)

    async def _on_compute_thread(self, fn, *args):
        """fn(*args) where this stage computes. An embedded stage computes inline, on the event
        loop's own thread (InlineExecutor): called directly, without a future's cross-thread wake-up."""
        if getattr(self.compute, "inline", False):
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.compute, fn, *args)

    def _failed(self, frame: pb.Frame, fault: Fault, owned: set[str]) -> pb.Failure:
        """A frame's failure. Its session is dropped here (the frontend replays it as a new one),
        unless the stage only had no room for it yet: the frontend then waits and retries."""
        self.metrics.error(fault.code.name)
        if fault.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            self._release(frame.session_id)
            owned.discard(frame.session_id)
        return pb.Failure(session_id=frame.session_id, seq=frame.seq, kind=frame.kind, code=fault.code.value[0],
                          message=fault.message, stage_index=self.options.stage_index)

    def _bind(self, frame: pb.Frame) -> StageSession:
        if not frame.session_id:
            raise Fault(grpc.StatusCode.INVALID_ARGUMENT, "frame without session_id")
        if frame.kind not in KIND_NAMES:
            raise Fault(grpc.StatusCode.INVALID_ARGUMENT, f"unknown frame kind {frame.kind}")
        existing = self.sessions.get(frame.session_id)
        if (existing is None or existing.kv is None) and frame.pos_start != 0:
            raise Fault(grpc.StatusCode.FAILED_PRECONDITION,
                        f"unknown session {frame.session_id!r} at position {frame.pos_start} (expired, released or "
                        "the stage restarted): prefill it again from position 0")
        try:
            session = self.sessions.open(frame.session_id)
        except SessionsFull as err:
            raise Fault(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err)) from err
        session.last_used = time.monotonic()
        return session

    async def _fork(self, frame: pb.Frame) -> StageSession:
        """The new session of a FORK frame, holding its parent's first pos_start positions. A
        refused fork creates nothing (and leaves the parent and any session of that id alone)."""
        parent = self.sessions.get(frame.parent_session_id)
        refusal = fork_refusal(frame, parent, self.sessions.get(frame.session_id))
        if refusal is not None:
            raise refusal
        try:
            child = self.sessions.open(frame.session_id)
        except SessionsFull as err:
            raise Fault(grpc.StatusCode.RESOURCE_EXHAUSTED, f"FORK refused: {err}") from err
        try:  # a copy is device work: on the compute thread, between passes
            await self._on_compute_thread(fork, parent, child, frame, self.runtime.new_session)
        except BaseException:
            self._release(child.session_id)
            raise
        self.metrics.frames_by_kind[KIND_NAMES[pb.FORK]].inc()
        self._publish_totals()
        return child

    def _trace(self, frame: pb.Frame) -> None:
        waited_ms = (time.time_ns() - frame.sent_ns) / 1e6 if frame.sent_ns else float("nan")
        log.debug("session %s %s pos %d x%d: %.2f ms since the frontend sent it", frame.session_id,
                  KIND_NAMES[frame.kind], frame.pos_start, frame.token_count, waited_ms)

    def _release(self, session_id: str) -> None:
        self.sessions.release(session_id)
        self._publish_totals()

    def _publish_totals(self) -> None:
        sessions, cached, kv_bytes = self.sessions.totals()
        self.metrics.sessions_gauge.set(sessions)
        self.metrics.cached_gauge.set(cached)
        self.metrics.kv_gauge.set(kv_bytes)

    async def sweep_forever(self) -> None:
        """Drop sessions idle past the TTL (a frontend that died never sends RELEASE)."""
        period = max(0.05, min(5.0, self.options.session_ttl / 4))
        while True:
            await asyncio.sleep(period)
            for session_id in self.sessions.expired():
                log.info("dropping idle session %s after %.0fs", session_id, self.options.session_ttl)
                self._release(session_id)
            self._publish_totals()

    async def close(self) -> None:
        if self._downstream_channel is not None:
            await self._downstream_channel.close()
        self.compute.shutdown(wait=False, cancel_futures=True)


async def _maybe_await(value) -> None:
    if inspect.isawaitable(value):
        await value


async def start_stage_server(options: StageConfig, *, runtime=None,
                             compute: Executor | None = None) -> tuple[grpc.aio.Server, StageService, int]:
    """Start the gRPC server (stage service + health) and begin loading; returns the bound port."""
    service = StageService(options, runtime=runtime, compute=compute)
    server = grpc.aio.server(options=GRPC_OPTIONS)
    pb_grpc.add_StageServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(service.health, server)
    address = f"{options.host}:{options.port}"
    if service.tls is not None:
        port = server.add_secure_port(address, service.tls.server_credentials())
    else:
        port = server.add_insecure_port(address)
    await server.start()
    await service.mark_not_serving()
    loop = asyncio.get_running_loop()
    if runtime is None:
        threading.Thread(target=service.load, args=(loop,), name="stage-load", daemon=True).start()
    else:
        await service.mark_serving()
    service.sweeper = asyncio.create_task(service.sweep_forever())
    return server, service, port
