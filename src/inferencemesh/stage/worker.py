"""What a stage does with one batch, with no transport in sight.

The worker owns the stage's sessions (bind, fork, release: their KV caches, sampling and token
history) and the activation codec (unpack a batch's hidden states, pack its output), and runs
the frames through the runtime in one forward pass. The service (service.py) decides what runs
where: the worker's device work (compute_batch, finish_fork) on the stage's compute thread, the
rest on the event loop.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc
import torch

from inferencemesh.protocol import codec, params
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol.errors import Fault
from inferencemesh.protocol.transport import COMPUTE_KINDS, KIND_NAMES
from inferencemesh.stage.decide import decide
from inferencemesh.stage.metrics import StageMetrics
from inferencemesh.stage.sessions import Owner, SessionsFull, SessionTable, StageSession, fork, fork_refusal

if TYPE_CHECKING:
    from inferencemesh.modeling.runtime import StageRuntime

log = logging.getLogger("inferencemesh.stage")

Job = tuple[StageSession, pb.Frame, torch.Tensor]  # a frame to compute, with its session and input rows


class StageWorker:
    def __init__(self, runtime: StageRuntime, *, is_first: bool, is_last: bool, max_sessions: int,
                 session_ttl: float, prefix_cache_tokens: int = 0, wire_dtype: torch.dtype | None = None,
                 metrics: StageMetrics | None = None) -> None:
        self.runtime = runtime
        self.is_first, self.is_last = is_first, is_last
        self.sessions = SessionTable(max_sessions, session_ttl, max_context=runtime.max_context,
                                     cache_tokens=prefix_cache_tokens,
                                     on_evict=metrics.evictions.inc if metrics is not None else None)
        self.wire_dtype = wire_dtype or runtime.dtype
        self.metrics = metrics

    # ---- sessions --------------------------------------------------------------------------

    def _session_of(self, session_id: str, owner: Owner) -> StageSession | None:
        """The session of this id if `owner` opened it, None if there is none; another stream's
        is a Fault (and stays as it is)."""
        session = self.sessions.get(session_id)
        if session is not None and session.owner is not owner:
            raise Fault(grpc.StatusCode.PERMISSION_DENIED, f"session {session_id!r} belongs to another stream")
        return session

    def bind(self, frame: pb.Frame, owner: Owner) -> StageSession:
        """The session a computing frame runs in: its stream's own, or a new one at position 0."""
        if not frame.session_id:
            raise Fault(grpc.StatusCode.INVALID_ARGUMENT, "frame without session_id")
        if frame.kind not in KIND_NAMES:
            raise Fault(grpc.StatusCode.INVALID_ARGUMENT, f"unknown frame kind {frame.kind}")
        existing = self._session_of(frame.session_id, owner)
        if existing is not None and existing.retained:
            raise Fault(grpc.StatusCode.FAILED_PRECONDITION,
                        f"session {frame.session_id!r} is a prefix-cache entry: it is forked from, not computed in")
        if (existing is None or existing.kv is None) and frame.pos_start != 0:
            raise Fault(grpc.StatusCode.FAILED_PRECONDITION,
                        f"unknown session {frame.session_id!r} at position {frame.pos_start} (expired, released or "
                        "the stage restarted): prefill it again from position 0")
        try:
            return self.sessions.open(frame.session_id, owner)
        except SessionsFull as err:
            raise Fault(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err)) from err

    def begin_fork(self, frame: pb.Frame, owner: Owner) -> tuple[StageSession, StageSession]:
        """(parent, new child) of a FORK frame, both the stream's; a refused fork creates nothing
        (and leaves the parent and any session of that id alone). finish_fork copies the parent."""
        self.check_payload(frame)
        target = self._session_of(frame.session_id, owner)
        parent = self._session_of(frame.parent_session_id, owner) if frame.parent_session_id else None
        refusal = fork_refusal(frame, parent, target)
        if refusal is not None:
            raise refusal
        assert parent is not None  # fork_refusal refuses a FORK whose parent is missing
        parent.last_used = time.monotonic()  # a prefix-cache entry forked from is a recently used one
        try:
            return parent, self.sessions.open(frame.session_id, owner, keep=parent)
        except SessionsFull as err:
            raise Fault(grpc.StatusCode.RESOURCE_EXHAUSTED, f"FORK refused: {err}") from err

    def finish_fork(self, parent: StageSession, child: StageSession, frame: pb.Frame) -> None:
        """The copy (device work); a fork that fails leaves no child behind."""
        try:
            fork(parent, child, frame, self.runtime.new_session)
        except BaseException:
            self.sessions.release(child.session_id)
            raise
        finally:
            self.sessions.fit_cache()  # the parent, kept for the copy, may be beyond the entries' room

    def release(self, session_id: str, owner: Owner, retain: bool = False) -> None:
        """RELEASE: free the stream's session, or with `retain` keep it as a prefix-cache entry
        (one it does not hold: nothing to do)."""
        session = self._session_of(session_id, owner)
        if session is None:
            return
        if retain and session.kv is not None:
            self.sessions.retain(session)
        else:
            self.sessions.release(session_id)

    def release_all(self, owner: Owner) -> None:
        """The stream ended: free every session it opened."""
        for session_id in list(owner.sessions):
            self.sessions.release(session_id)

    def failure(self, frame: pb.Frame, fault: Fault, stage_index: int, owner: Owner) -> pb.Failure:
        """A frame's failure. Its session is dropped here (the frontend replays it as a new one),
        unless the stage only had no room for it yet (the frontend then waits and retries) or the
        session is another stream's."""
        session = self.sessions.get(frame.session_id)
        if fault.code != grpc.StatusCode.RESOURCE_EXHAUSTED and session is not None and session.owner is owner:
            self.sessions.release(frame.session_id)
        return pb.Failure(session_id=frame.session_id, seq=frame.seq, kind=frame.kind, code=fault.code.value[0],
                          message=fault.message, stage_index=stage_index)

    # ---- the codec -------------------------------------------------------------------------

    def unpack(self, batch: pb.Batch) -> Iterator[torch.Tensor | Fault | None]:
        """Each computing frame's rows of the batch's packed hidden states, in frame order (None
        for stage 0, which takes token ids); a Fault for every one of them when the payload does
        not match the frames."""
        if self.is_first:
            return itertools.repeat(None)
        counts = [f.token_count for f in batch.frames if f.kind in COMPUTE_KINDS]
        total = sum(counts)
        try:
            if batch.hidden_size != self.runtime.hidden_size:
                raise codec.PayloadError(f"activation shape [{total}, {batch.hidden_size}] must be "
                                         f"[{total}, {self.runtime.hidden_size}]")
            if not all(counts):
                raise codec.PayloadError("token_count must be at least 1")
            packed = codec.decode(batch.activations, batch.dtype, (total, batch.hidden_size), total)
        except codec.PayloadError as err:
            return itertools.repeat(Fault(grpc.StatusCode.INVALID_ARGUMENT, str(err)))
        return iter(packed.split(counts))

    def inputs(self, frame: pb.Frame, hidden: torch.Tensor | Fault | None) -> torch.Tensor:
        """Validate the frame header; its input: token ids (stage 0) or its rows of the batch's
        hidden states (see unpack)."""
        rt, n = self.runtime, frame.token_count
        if isinstance(hidden, Fault):
            raise hidden
        if frame.kind not in COMPUTE_KINDS:
            raise Fault(grpc.StatusCode.INVALID_ARGUMENT, f"frame kind {frame.kind} carries no tokens to compute")
        if n < 1:
            raise Fault(grpc.StatusCode.INVALID_ARGUMENT, "token_count must be at least 1")
        if frame.pos_start + n > rt.max_context:
            raise Fault(grpc.StatusCode.OUT_OF_RANGE,
                        f"positions [{frame.pos_start}, {frame.pos_start + n}) exceed max_context {rt.max_context}")
        needs_ids = self.is_first or (self.is_last and frame.kind == pb.VERIFY)
        if needs_ids and len(frame.token_ids) != n:
            raise Fault(grpc.StatusCode.INVALID_ARGUMENT,
                        f"frame has {len(frame.token_ids)} token ids but token_count {n}")
        if frame.kind == pb.VERIFY and n < 2:
            raise Fault(grpc.StatusCode.INVALID_ARGUMENT, "a VERIFY frame holds the last token and at least one draft")
        self.check_payload(frame)
        if self.is_first:
            return torch.tensor(frame.token_ids, dtype=torch.long)
        if hidden is None:
            raise Fault(grpc.StatusCode.INVALID_ARGUMENT, "a stage after the first needs the frame's hidden states")
        return hidden

    def check_payload(self, frame: pb.Frame) -> None:
        """A stage trusts no sender: every id a frame carries indexes the vocabulary (the embedding,
        the penalties' counts, the verified drafts) and its sampling is one the kernels can take.
        Checked before the pass, so that no frame's values can make the pass itself raise."""
        vocab = self.runtime.vocab_size
        if frame.token_ids and (min(frame.token_ids) < 0 or max(frame.token_ids) >= vocab):
            raise Fault(grpc.StatusCode.INVALID_ARGUMENT, f"token id outside the vocabulary [0, {vocab})")
        if frame.HasField("sampling"):
            refusal = params.refusal(frame.sampling, vocab)
            if refusal is not None:
                raise Fault(grpc.StatusCode.INVALID_ARGUMENT, refusal)

    def pack(self, seq: int, failures: list[pb.Failure], computed: list[tuple[pb.Frame, object]],
             carried: list[pb.Frame]) -> pb.Batch | pb.BatchResult:
        """What goes on: the batch for the next stage (the computed frames' hidden states packed in
        frame order, then the RELEASE / FORK frames carried out here), or on the last stage the
        BatchResult (the predictions, and an Ack for each carried frame)."""
        if self.is_last:
            result = pb.BatchResult(seq=seq, failures=failures,
                                    predictions=[out for _, out in computed if isinstance(out, pb.Prediction)])
            result.acks.extend(pb.Ack(seq=f.seq, session_id=f.session_id, kind=f.kind) for f in carried)
            return result
        down = pb.Batch(seq=seq, failures=failures, frames=[f for f, _ in computed] + carried,
                        dtype=codec.WIRE_CODES[self.wire_dtype], hidden_size=self.runtime.hidden_size)
        if computed:
            hidden = [out for _, out in computed if isinstance(out, torch.Tensor)]  # every one, before the last stage
            down.activations = codec.encode(torch.cat(hidden), self.wire_dtype)
        return down

    # ---- the forward pass ------------------------------------------------------------------

    def compute_batch(self, jobs: list[Job]) -> list:
        """Several sessions' frames in one forward pass. Per job: hidden states (stages before
        the last), a Prediction or None (the last stage: None for a prompt chunk that wants no
        prediction, whose head is skipped), or the Fault that job alone gets."""
        from inferencemesh.modeling.runtime import PositionError, Segment  # torch-heavy: loaded when first used

        rt = self.runtime
        results: list = [None] * len(jobs)
        runnable, segments = [], []
        for index, (session, frame, inputs) in enumerate(jobs):
            if frame.HasField("sampling"):
                session.sampling, session.logprobs = params.from_wire(frame.sampling)
            if session.kv is None:
                session.kv = rt.new_session()
            try:
                rt.check_positions(session.kv, frame.pos_start, frame.token_count)
            except PositionError as err:
                results[index] = Fault(grpc.StatusCode.FAILED_PRECONDITION, str(err))
                continue
            if self.is_last:  # pos_start is authoritative for the token history as for the cache
                del session.tokens[frame.pos_start:]
                session.tokens.extend(frame.token_ids)
            wants = frame.kind != pb.PREFILL or frame.want_prediction
            every_row = frame.kind == pb.VERIFY or (frame.kind == pb.PREFILL and frame.prompt_logprobs)
            logits = "all" if every_row else "last" if wants else "none"
            runnable.append(index)
            segments.append(Segment(session.kv, frame.pos_start, inputs, logits))
        if not segments:
            return results
        started = time.perf_counter()
        outs = rt.forward_batch(segments)
        self._count(jobs, runnable, time.perf_counter() - started)
        for index, out in zip(runnable, outs, strict=True):
            session, frame, _ = jobs[index]
            try:  # a frame that cannot be decided (bad draft_probs, penalties without ids) fails alone
                results[index] = decide(session, frame, out, rt.vocab_size) if self.is_last and out is not None else out
            except Fault as fault:
                results[index] = fault
            except Exception as err:  # whatever else deciding one frame raises is that frame's alone too
                log.exception("session %s: deciding a %s frame failed", frame.session_id, KIND_NAMES[frame.kind])
                results[index] = Fault(grpc.StatusCode.INTERNAL, f"deciding the frame failed: {type(err).__name__}: "
                                                                 f"{err}")
        return results

    def _count(self, jobs: list[Job], runnable: list[int], seconds: float) -> None:
        if self.metrics is None:
            return
        first = jobs[runnable[0]][1]
        self.metrics.forward_by_kind[KIND_NAMES[first.kind]].observe(seconds)
        self.metrics.batch_frames.observe(len(runnable))
        for index in runnable:
            frame = jobs[index][1]
            self.metrics.frames_by_kind[KIND_NAMES[frame.kind]].inc()
            self.metrics.tokens.inc(frame.token_count)
