"""Every stage in this process, no network: the same StageWorkers the gRPC server runs.

LocalPipeline has the interface of the frontend's GrpcPipeline (open / send / close), so the
engine, the benchmarks and the tests can run a whole pipeline in one process.
"""

from __future__ import annotations

import uuid

from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol.errors import Fault, PipelineError
from inferencemesh.stage.sessions import StageSession
from inferencemesh.stage.worker import StageWorker


class LocalSession:
    def __init__(self, pipeline: LocalPipeline, session_id: str) -> None:
        self.pipeline = pipeline
        self.session_id = session_id
        self.states = [StageSession(session_id) for _ in pipeline.workers]

    def _run(self, frame: pb.Frame) -> pb.Prediction | None:
        workers = self.pipeline.workers
        try:
            x = workers[0].inputs(frame)
            for worker, state in zip(workers, self.states, strict=True):
                x = worker.compute(state, frame, x)
        except Fault as fault:
            raise PipelineError(fault.code, fault.message) from fault
        return x

    async def send(self, frame: pb.Frame) -> pb.Prediction | None:
        return self._run(frame)  # on the event loop's own thread: see LocalPipeline

    async def close(self) -> None:
        for state in self.states:
            if state.kv is not None:
                state.kv.release()
                state.kv = None


class LocalPipeline:
    """All stages in this process: frames pass from worker to worker as tensors.

    It computes on the calling (event-loop) thread, blocking it: in one process there is
    nothing else to serve meanwhile, and one computing thread means one OpenMP team (see
    stage.server.MainThreadExecutor).
    """

    computes_inline = True

    def __init__(self, runtimes: list) -> None:
        last = len(runtimes) - 1
        self.workers = [StageWorker(rt, is_first=i == 0, is_last=i == last) for i, rt in enumerate(runtimes)]

    def open(self) -> LocalSession:
        return LocalSession(self, uuid.uuid4().hex)

    async def is_ready(self) -> bool:
        return True

    async def close(self) -> None:
        pass
