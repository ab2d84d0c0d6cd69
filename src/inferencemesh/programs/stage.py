"""`inferencemesh stage`: one stage server as a process (what a stage pod runs).

The process's compute runs on its main thread (MainThreadExecutor) and the gRPC event loop on a
second thread that never computes.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from types import FrameType
from typing import Any

from inferencemesh.bundled import resolve_model
from inferencemesh.checkpoint.read import check_source
from inferencemesh.config import StageConfig
from inferencemesh.programs.process import LoadFailed, PortInUse, on_stop_signals
from inferencemesh.stage.server import start_stage_server

log = logging.getLogger("inferencemesh.stage")
# A stopping stage lets its streams run this long (a request about to end ends; the others are
# replayed by their frontend on the stage that replaces it), then cancels them.
GRACEFUL_STOP_S = 2.0


class MainThreadExecutor(Executor):
    """Runs submitted work on the thread that calls run(): the process's main thread.

    Every thread that runs PyTorch CPU kernels gets an OpenMP team of its own, and an idle
    team's workers spin against the busy one: a decode step measured 20-30% slower once a
    second thread had computed. So all of a stage process's device work runs on one thread,
    its main thread, and the event loop on a second one that never computes.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
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
    """Serve until `stop` is set; LoadFailed once the layers cannot be loaded: a stage that cannot
    serve exits at once with why, so that `serve` stops waiting for it and a pod's status says why
    (the kubelet's restarts retry what may pass, an unreachable hub; the operator's restart budget
    ends a loop)."""
    failure: list[str] = []

    def failed(reason: str) -> None:
        failure.append(reason)
        stop.set()

    server, service, port = await start_stage_server(options, compute=compute, on_failed=failed)
    if options.metrics_port:
        try:
            service.metrics.serve(options.metrics_port)
        except OSError as err:  # taken since the CLI checked it: the same one line, after a clean stop
            await server.stop(grace=None)
            await service.close()
            raise PortInUse(f"stage metrics (--metrics-port) port {options.metrics_port} is not available "
                            f"({err.strerror})") from err
    log.info("stage %d/%d serving gRPC on %s:%d (layers [%d, %d), downstream %s)", options.stage_index,
             options.num_stages, options.host, port, options.layer_start, options.layer_end,
             options.downstream or "none: last stage")
    await stop.wait()
    await service.mark_not_serving()
    await server.stop(grace=None if failure else GRACEFUL_STOP_S)
    await service.close()
    if failure:
        raise LoadFailed(f"stage {options.stage_index} cannot load layers {options.layer_start}:{options.layer_end}: "
                         f"{failure[0]}")


def run_stage(config: StageConfig) -> int:
    """The process is set up by the CLI (process.set_up_process): logging, grad mode, threads."""
    check_source(resolve_model(config.model))  # a path that names nothing: refuse before serving
    compute = MainThreadExecutor()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    failed: list[PortInUse | LoadFailed] = []

    def serve() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(serve_stage(config, compute, stop))
        except (PortInUse, LoadFailed) as err:  # raised again on the main thread, where the CLI makes it one line
            failed.append(err)
        finally:
            compute.shutdown()

    def request_stop(signum: int, _frame: FrameType | None) -> None:
        loop.call_soon_threadsafe(stop.set)

    on_stop_signals(request_stop)
    server_thread = threading.Thread(target=serve, name="stage-io")
    server_thread.start()
    compute.run()  # until the server shuts down
    server_thread.join()
    if failed:
        raise failed[0]
    return 0
