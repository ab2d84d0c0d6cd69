"""Every stage in this process, no network: the same StageWorkers the gRPC server runs.

LocalPipeline has the interface of the frontend's GrpcPipeline (open / send / close), so the
engine, the benchmarks and the tests can run a whole pipeline in one process.
"""

from __future__ import annotations

import uuid

from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol.errors import Fault, PipelineError
from inferencemesh.stage.sessions import StageSession, fork, fork_refusal
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

    def _fork(self, frame: pb.Frame) -> None:
        """Every stage's state of this session becomes a copy of the parent's (as the stages do)."""
        parent = self.pipeline.sessions.get(frame.parent_session_id)
        for i, (worker, state) in enumerate(zip(self.pipeline.workers, self.states, strict=True)):
            parent_state = parent.states[i] if parent is not None else None
            fault = fork_refusal(frame, parent_state, state)
            if fault is None:
                try:
                    fork(parent_state, state, frame, worker.runtime.new_session)
                except Fault as err:
                    fault = err
            if fault is not None:
                raise PipelineError(fault.code, fault.message)

    async def send(self, frame: pb.Frame) -> pb.Prediction | None:
        if frame.kind == pb.FORK:
            return self._fork(frame)
        return self._run(frame)  # on the event loop's own thread: see LocalPipeline

    async def close(self) -> None:
        self.pipeline.sessions.pop(self.session_id, None)
        for state in self.states:
            if state.kv is not None:
                state.kv.release()
                state.kv = None


class LocalPipeline:
    """All stages in this process: frames pass from worker to worker as tensors.

    It computes on the calling (event-loop) thread, blocking it: in one process there is
    nothing else to serve meanwhile, and one computing thread means one OpenMP team (see
    programs.stage.MainThreadExecutor).
    """

    computes_inline = True

    def __init__(self, runtimes: list) -> None:
        last = len(runtimes) - 1
        self.workers = [StageWorker(rt, is_first=i == 0, is_last=i == last) for i, rt in enumerate(runtimes)]
        self.sessions: dict[str, LocalSession] = {}  # open ones, by id: what a FORK names

    def open(self) -> LocalSession:
        session = LocalSession(self, uuid.uuid4().hex)
        self.sessions[session.session_id] = session
        return session

    async def is_ready(self) -> bool:
        return True

    async def close(self) -> None:
        pass
