"""The stage server: one layer range of the model behind the gRPC Stage service.

Per session it keeps one inbound stream (from the frontend or the previous stage) and opens
one outbound stream to the next stage. The last stage samples or verifies and posts its
predictions on the session's Results stream, straight to the frontend. Device work runs on
one compute thread, frames of sessions that wait together batched into one pass (batcher.py);
the event loop only moves frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import queue
import signal
import threading
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from inferencemesh import tls
from inferencemesh.bundled import served_name
from inferencemesh.checkpoint import CheckpointError, check_source
from inferencemesh.config import StageConfig
from inferencemesh.cpus import compute_threads
from inferencemesh.protocol import codec
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol import stage_pb2_grpc as pb_grpc
from inferencemesh.protocol.errors import Fault
from inferencemesh.protocol.transport import (
    FORK_ACK_TIMEOUT_S,
    GRPC_OPTIONS,
    KIND_NAMES,
    RELEASE_ACK_TIMEOUT_S,
    SERVICE_NAME,
)
from inferencemesh.stage.batcher import Batcher
from inferencemesh.stage.metrics import StageMetrics
from inferencemesh.stage.sessions import SessionsFull, SessionTable, StageSession, fork, fork_refusal
from inferencemesh.stage.worker import StageWorker

log = logging.getLogger("inferencemesh.stage")



_END = object()  # the inbound stream closed


async def _pump(frames, inbox: asyncio.Queue) -> None:
    """Move inbound frames into the session's inbox, where downstream faults also land."""
    try:
        async for frame in frames:
            inbox.put_nowait(frame)
    except asyncio.CancelledError:
        raise
    except Exception:  # the sender went away: same as a closed stream
        pass
    inbox.put_nowait(_END)


class DownstreamHop:
    """This session's stream to the next stage; one envelope, mutated per frame."""

    def __init__(self, stub: pb_grpc.StageStub, address: str, session_id: str, inbox: asyncio.Queue,
                 wire_dtype: torch.dtype) -> None:
        self.address = address
        self.wire_dtype = wire_dtype
        self.wire_code = codec.WIRE_CODES[wire_dtype]
        self.call = stub.Session()
        self.envelope = pb.Frame(session_id=session_id, dtype=self.wire_code)
        self.released = asyncio.Event()  # the downstream acknowledged RELEASE: it and all after it let go
        self.forked = asyncio.Event()  # the downstream acknowledged FORK (or the stream ended: see fork_done)
        self.fork_done = False
        self.failure: Fault | None = None
        self.reader = asyncio.create_task(self._watch(inbox))

    async def _watch(self, inbox: asyncio.Queue) -> None:
        try:
            async for ack in self.call:  # a stage acknowledges only RELEASE and FORK
                if ack.kind == pb.FORK:
                    self.fork_done = True
                    self.forked.set()
                else:
                    self.released.set()
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.CANCELLED:
                self.failure = Fault(err.code(), f"downstream stage {self.address}: {err.details()}")
                inbox.put_nowait(self.failure)
        finally:
            self.released.set()  # a stream that ended holds nothing downstream (its handler released)
            self.forked.set()

    async def fork(self, frame: pb.Frame) -> None:
        """Forward FORK and wait until every stage downstream has copied the parent, so that the
        acknowledgement upstream means the whole pipeline holds the new session."""
        await self.forward(frame, None)
        try:
            await asyncio.wait_for(self.forked.wait(), FORK_ACK_TIMEOUT_S)
        except asyncio.TimeoutError as err:
            raise Fault(grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"downstream stage {self.address} did not acknowledge FORK within {FORK_ACK_TIMEOUT_S:.0f}s"
                        ) from err
        if not self.fork_done:
            raise self.failure or Fault(grpc.StatusCode.UNAVAILABLE, f"downstream stage {self.address} went away")

    async def release(self, frame: pb.Frame) -> None:
        """Forward RELEASE and wait until every stage downstream has freed the session, so that
        the acknowledgement upstream means the whole pipeline has room for a new one."""
        await self.forward(frame, None)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.released.wait(), RELEASE_ACK_TIMEOUT_S)

    async def forward(self, frame: pb.Frame, hidden: torch.Tensor | None) -> int:
        env = self.envelope
        env.request_id = frame.request_id
        env.kind = frame.kind
        env.pos_start = frame.pos_start
        env.token_count = frame.token_count
        env.want_prediction = frame.want_prediction
        env.prompt_logprobs = frame.prompt_logprobs
        env.parent_session_id = frame.parent_session_id
        env.seq = frame.seq
        env.sent_ns = frame.sent_ns
        env.draft_probs = frame.draft_probs
        del env.token_ids[:]
        env.token_ids.extend(frame.token_ids)
        if frame.HasField("sampling"):
            env.sampling.CopyFrom(frame.sampling)
        else:
            env.ClearField("sampling")
        if hidden is None:
            env.activations = b""
            del env.shape[:]
        else:
            env.activations = codec.encode(hidden, self.wire_dtype)
            env.shape[:] = hidden.shape
        try:
            await self.call.write(env)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as err:
            raise Fault(grpc.StatusCode.UNAVAILABLE, f"downstream stage {self.address} unreachable: {err}") from err
        return len(env.activations)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.call.done_writing()
        self.reader.cancel()
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
        # One compute thread: device work is serialised, frames of several sessions batched
        # into one pass when they wait together; the event loop only moves frames.
        self.compute = compute or ThreadPoolExecutor(1, thread_name_prefix="stage-compute")
        self.batcher = Batcher(lambda jobs: self.worker.compute_batch(jobs), self.compute, options.max_batch_tokens,
                               metrics=self.metrics)
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

    async def Results(self, request: pb.ResultsRequest, context):
        if not self.is_last:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"stage {self.options.stage_index} is not the last stage; subscribe there")
        if not request.session_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session_id is required")
        try:
            session = self.sessions.open(request.session_id)
        except SessionsFull as err:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        try:
            while True:
                prediction = await session.results.get()
                if prediction is None:
                    return
                yield prediction
        finally:
            if not session.released:  # the subscriber left: nobody can read this session's predictions
                self._release(session.session_id)

    async def Session(self, request_iterator, context) -> None:
        inbox: asyncio.Queue = asyncio.Queue()
        pump = asyncio.create_task(_pump(request_iterator, inbox))
        session: StageSession | None = None
        hop: DownstreamHop | None = None
        try:
            while True:
                item = await inbox.get()
                if item is _END:
                    return
                if isinstance(item, Fault):
                    raise item
                frame: pb.Frame = item
                if frame.kind == pb.FORK:
                    session = await self._fork(frame, session)
                    if not self.is_last:
                        if hop is None:
                            hop = DownstreamHop(self._downstream, self.options.downstream, frame.session_id, inbox,
                                                self.wire_dtype)
                        await hop.fork(frame)
                    await context.write(pb.Ack(seq=frame.seq, session_id=frame.session_id, kind=pb.FORK))
                    continue
                session = self._bind(frame, session)
                if frame.kind not in KIND_NAMES:
                    raise Fault(grpc.StatusCode.INVALID_ARGUMENT, f"unknown frame kind {frame.kind}")
                if frame.kind == pb.RELEASE:
                    if hop is not None:
                        await hop.release(frame)
                    self._release(session.session_id)
                    session = None
                    await context.write(pb.Ack(seq=frame.seq, session_id=frame.session_id, kind=pb.RELEASE))
                    continue
                inputs = self.worker.inputs(frame)
                session.last_used = time.monotonic()
                out = await self.batcher.submit(session, frame, inputs)
                if self.debug:  # per-frame detail only when asked for: nothing is formatted otherwise
                    self._trace(frame)
                if self.is_last:
                    if out is not None:
                        session.results.put_nowait(out)
                else:
                    if hop is None:
                        hop = DownstreamHop(self._downstream, self.options.downstream, frame.session_id, inbox,
                                            self.wire_dtype)
                    sending = time.perf_counter()
                    self.metrics.bytes_sent.inc(await hop.forward(frame, out))
                    self.metrics.send.observe(time.perf_counter() - sending)
        except Fault as fault:
            self.metrics.error(fault.code.name)
            if session is not None and fault.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                self._release(session.session_id)
                session = None
            await context.abort(fault.code, f"stage {self.options.stage_index}: {fault.message}")
        finally:
            pump.cancel()
            if session is not None:  # the sender went away without RELEASE: free the KV now
                self._release(session.session_id)  # (before any await: a cancelled handler may not get past one)
            if hop is not None:
                await hop.close()

    # ---- per frame -------------------------------------------------------------------------

    def _check_stream(self, frame: pb.Frame, current: StageSession | None) -> None:
        if self.runtime is None:
            raise Fault(grpc.StatusCode.UNAVAILABLE, f"stage is {self.state}, not ready: {self.reason}".rstrip(": "))
        if not frame.session_id:
            raise Fault(grpc.StatusCode.INVALID_ARGUMENT, "frame without session_id")
        if current is not None and frame.session_id != current.session_id:
            raise Fault(grpc.StatusCode.INVALID_ARGUMENT,
                        f"frame for session {frame.session_id!r} on the stream of {current.session_id!r}")

    def _bind(self, frame: pb.Frame, current: StageSession | None) -> StageSession:
        self._check_stream(frame, current)
        if current is not None:
            return current
        existing = self.sessions.get(frame.session_id)
        if (existing is None or existing.kv is None) and frame.kind != pb.RELEASE and frame.pos_start != 0:
            raise Fault(grpc.StatusCode.FAILED_PRECONDITION,
                        f"unknown session {frame.session_id!r} at position {frame.pos_start} (expired, released or "
                        "the stage restarted): prefill it again from position 0")
        try:
            return self.sessions.open(frame.session_id)
        except SessionsFull as err:
            raise Fault(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err)) from err

    async def _fork(self, frame: pb.Frame, current: StageSession | None) -> StageSession:
        """The new session of a FORK frame, holding its parent's first pos_start positions. A
        refused fork creates nothing (and leaves the parent and any session of that id alone)."""
        self._check_stream(frame, current)
        parent = self.sessions.get(frame.parent_session_id)
        refusal = fork_refusal(frame, parent, self.sessions.get(frame.session_id))
        if refusal is not None:
            raise refusal
        try:
            child = self.sessions.open(frame.session_id)
        except SessionsFull as err:
            raise Fault(grpc.StatusCode.RESOURCE_EXHAUSTED, f"FORK refused: {err}") from err
        try:  # a copy is device work: on the compute thread, between passes
            await asyncio.get_running_loop().run_in_executor(self.compute, fork, parent, child, frame,
                                                             self.runtime.new_session)
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


class MainThreadExecutor(Executor):
    """Runs submitted work on the thread that calls run(): the process's main thread.

    Every thread that runs PyTorch CPU kernels gets an OpenMP team of its own, and an idle
    team's workers spin against the busy one: a decode step measured 20-30% slower once a
    second thread had computed. So all of a stage process's device work runs on one thread,
    its main thread, and the event loop on a second one that never computes.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def run(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=0.5)  # wake up now and then so signals are handled
            except queue.Empty:
                continue
            if job is None:
                return
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as err:  # delivered to the awaiting coroutine
                future.set_exception(err)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._jobs.put(None)


async def serve_stage(options: StageConfig, compute: Executor, stop: asyncio.Event) -> None:
    server, service, port = await start_stage_server(options, compute=compute)
    if options.metrics_port:
        service.metrics.serve(options.metrics_port)
    log.info("stage %d/%d serving gRPC on %s:%d (layers [%d, %d), downstream %s)", options.stage_index,
             options.num_stages, options.host, port, options.layer_start, options.layer_end,
             options.downstream or "none: last stage")
    await stop.wait()
    await service.mark_not_serving()
    await server.stop(grace=2.0)
    await service.close()


def run_stage(config: StageConfig) -> int:
    from inferencemesh.bundled import resolve_model

    check_source(resolve_model(config.model))  # a path that names nothing: refuse before serving
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if config.debug_telemetry:
        logging.getLogger("inferencemesh").setLevel(logging.DEBUG)
    torch.set_grad_enabled(False)
    threads = compute_threads(config.threads)
    if threads is not None:
        torch.set_num_threads(threads)
    compute = MainThreadExecutor()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(serve_stage(config, compute, stop))
        finally:
            compute.shutdown()

    def request_stop(signum, _frame) -> None:
        loop.call_soon_threadsafe(stop.set)

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    server_thread = threading.Thread(target=serve, name="stage-io")
    server_thread.start()
    compute.run()  # until the server shuts down
    server_thread.join()
    return 0
