"""What a stage does with one batch, with no transport in sight.

The worker owns the stage's sessions (bind, release: their sampling state), its KV pool and the
ledger of which stream holds it (sessions.PoolLedger), and the activation codec (unpack a batch's
hidden states, pack its output), and runs the frames through the runtime in one forward pass,
each over its block table. The service (service.py) decides what runs where: the worker's device
work (compute_batch) on the stage's compute thread, the rest on the event loop.
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
from inferencemesh.protocol.transport import COMPUTE_KINDS, KIND_NAMES, KV_BLOCK_TOKENS, expects_ack
from inferencemesh.stage.decide import decide
from inferencemesh.stage.metrics import StageMetrics
from inferencemesh.stage.sessions import Owner, PoolLedger, SessionsFull, SessionTable, StageSession

if TYPE_CHECKING:
    from inferencemesh.modeling.runtime import StageRuntime

log = logging.getLogger("inferencemesh.stage")

# A frame to compute: its session, its input rows and its block table.
Job = tuple[StageSession, pb.Frame, torch.Tensor, list[int]]


class StageWorker:
    """kv_blocks: blocks of KV_BLOCK_TOKENS positions in the stage's pool."""

    def __init__(self, runtime: StageRuntime, *, is_first: bool, is_last: bool, max_sessions: int,
                 session_ttl: float, kv_blocks: int, wire_dtype: torch.dtype | None = None,
                 metrics: StageMetrics | None = None) -> None:
        self.runtime = runtime
        self.is_first, self.is_last = is_first, is_last
        self.sessions = SessionTable(max_sessions, session_ttl)
        self.pool = runtime.new_pool(kv_blocks, KV_BLOCK_TOKENS)
        self.ledger = PoolLedger(kv_blocks, KV_BLOCK_TOKENS)
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
        """The session a computing frame runs in: its stream's own, or a new one (at any position:
        admit checks that its stream wrote the blocks it reads)."""
        if not frame.session_id:
            raise Fault(grpc.StatusCode.INVALID_ARGUMENT, "frame without session_id")
        if frame.kind not in KIND_NAMES:
            raise Fault(grpc.StatusCode.INVALID_ARGUMENT, f"unknown frame kind {frame.kind}")
        self._session_of(frame.session_id, owner)
        try:
            return self.sessions.open(frame.session_id, owner)
        except SessionsFull as err:
            raise Fault(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err)) from err

    def admit(self, frame: pb.Frame, session: StageSession, owner: Owner) -> list[int]:
        """The frame's block table, checked against the pool (sessions.PoolLedger.admit)."""
        return self.ledger.admit(frame, session, owner)

    def release(self, session_id: str, owner: Owner) -> None:
        """RELEASE: forget the stream's session (its blocks are the frontend's to reuse)."""
        if self._session_of(session_id, owner) is not None:
            self.sessions.release(session_id)

    def release_all(self, owner: Owner) -> None:
        """The stream ended: free every session it opened, and the pool if it held it."""
        for session_id in list(owner.sessions):
            self.sessions.release(session_id)
        self.ledger.end(owner)

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
        frame order, then the RELEASE frames carried out here), or on the last stage the
        BatchResult (the predictions, and an Ack for each prompt chunk computed without one and each
        carried frame: every stage has done it then)."""
        if self.is_last:
            result = pb.BatchResult(seq=seq, failures=failures,
                                    predictions=[out for _, out in computed if isinstance(out, pb.Prediction)])
            done = [f for f, _ in computed if expects_ack(f)] + carried
            result.acks.extend(pb.Ack(seq=f.seq, session_id=f.session_id, kind=f.kind) for f in done)
            return result
        down = pb.Batch(seq=seq, failures=failures, frames=[f for f, _ in computed] + carried,
                        dtype=codec.WIRE_CODES[self.wire_dtype], hidden_size=self.runtime.hidden_size)
        if computed:
            hidden = [out for _, out in computed if isinstance(out, torch.Tensor)]  # every one, before the last stage
            down.activations = codec.encode(torch.cat(hidden), self.wire_dtype)
        return down

    # ---- the forward pass ------------------------------------------------------------------

    def compute_batch(self, jobs: list[Job]) -> list:
        """Several sessions' frames in one forward pass, each over its block table. Per job: hidden
        states (stages before the last), a Prediction or None (the last stage: None for a prompt
        chunk that wants no prediction, whose head is skipped), or the Fault that job alone gets."""
        from inferencemesh.modeling.kv_pool import BlockTableKV  # torch-heavy: loaded when first used
        from inferencemesh.modeling.runtime import PositionError, Segment

        rt = self.runtime
        results: list = [None] * len(jobs)
        runnable, segments = [], []
        for index, (session, frame, inputs, table) in enumerate(jobs):
            if frame.HasField("sampling"):
                session.sampling, session.logprobs = params.from_wire(frame.sampling)
            kv = BlockTableKV(self.pool, table, frame.pos_start, frame.token_count)
            try:
                rt.check_positions(kv, frame.pos_start, frame.token_count)
            except PositionError as err:
                results[index] = Fault(grpc.StatusCode.FAILED_PRECONDITION, str(err))
                continue
            if self.is_last:  # the session's token history is its table's slots (the penalties read it)
                self.pool.write_tokens(table, frame.pos_start, frame.token_ids, frame.token_count)
            wants = frame.kind != pb.PREFILL or frame.want_prediction
            every_row = frame.kind == pb.VERIFY or (frame.kind == pb.PREFILL and frame.prompt_logprobs)
            logits = "all" if every_row else "last" if wants else "none"
            runnable.append(index)
            segments.append(Segment(kv, frame.pos_start, inputs, logits))
        if not segments:
            return results
        started = time.perf_counter()
        outs = rt.forward_batch(segments)
        self._count(jobs, runnable, time.perf_counter() - started)
        for index, out in zip(runnable, outs, strict=True):
            session, frame, _, table = jobs[index]
            stop = frame.pos_start + frame.token_count
            if session.owner is not None:
                self.ledger.wrote(session.owner, table, frame.pos_start, stop)
            try:  # a frame that cannot be decided (bad draft_q, penalties without ids) fails alone
                results[index] = self._decide(session, frame, out, table) if self.is_last and out is not None \
                    else out
            except Fault as fault:
                results[index] = fault
            except Exception as err:  # whatever else deciding one frame raises is that frame's alone too
                log.exception("session %s: deciding a %s frame failed", frame.session_id, KIND_NAMES[frame.kind])
                results[index] = Fault(grpc.StatusCode.INTERNAL, f"deciding the frame failed: {type(err).__name__}: "
                                                                 f"{err}")
        return results

    def _decide(self, session: StageSession, frame: pb.Frame, logits: torch.Tensor, table: list[int]) -> pb.Prediction:
        """The last stage's decision; the token history read from the table's slots only when the
        sampling looks at it (penalties, logit_bias, min_tokens)."""
        stop = frame.pos_start + frame.token_count
        context = self.pool.read_tokens(table, stop) if session.sampling.adjusts else None
        return decide(session, frame, logits, self.runtime.vocab_size, context)

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
