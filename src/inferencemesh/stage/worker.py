"""What a stage does with one frame, with no transport in sight.

The gRPC server and the in-process pipeline (one process, no network: `bench`, tests) both
run frames through a StageWorker, so validation, position handling and the last stage's
sampling / verification exist once.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import grpc
import torch

from inferencemesh.protocol import codec, params
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol.errors import Fault
from inferencemesh.protocol.transport import COMPUTE_KINDS, KIND_NAMES
from inferencemesh.sampling import logprobs, next_token, verify
from inferencemesh.stage.metrics import StageMetrics
from inferencemesh.stage.sessions import StageSession


class StageWorker:
    def __init__(self, runtime, *, is_first: bool, is_last: bool, metrics: StageMetrics | None = None) -> None:
        self.runtime = runtime
        self.is_first, self.is_last = is_first, is_last
        self.metrics = metrics

    def inputs(self, frame: pb.Frame, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Validate the frame header; its input: token ids (stage 0) or its rows of the batch's
        hidden states (see unpack)."""
        rt, n = self.runtime, frame.token_count
        if frame.kind not in KIND_NAMES or frame.kind == pb.RELEASE:
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
        if self.is_first:
            ids = torch.tensor(frame.token_ids, dtype=torch.long)
            if int(ids.min()) < 0 or int(ids.max()) >= rt.vocab_size:
                raise Fault(grpc.StatusCode.INVALID_ARGUMENT, f"token id outside the vocabulary [0, {rt.vocab_size})")
            return ids
        if hidden is None:
            raise Fault(grpc.StatusCode.INVALID_ARGUMENT, "a stage after the first needs the frame's hidden states")
        return hidden

    def unpack(self, batch: pb.Batch) -> Iterator[torch.Tensor | Fault]:
        """Each computing frame's rows of the batch's packed hidden states, in frame order; a
        Fault for every one of them when the payload does not match the frames (stage 0: none)."""
        if self.is_first:
            return iter(())
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

    def compute(self, session: StageSession, frame: pb.Frame, inputs: torch.Tensor):
        """Run the layers for one frame. Non-last stages return hidden states; the last stage
        returns a Prediction (or None for a prompt chunk that wants none: its head is skipped)."""
        result = self.compute_batch([(session, frame, inputs)])[0]
        if isinstance(result, Fault):
            raise result
        return result

    def compute_batch(self, jobs: list[tuple[StageSession, pb.Frame, torch.Tensor]]) -> list:
        """Several sessions' frames in one forward pass. Per job, what compute() returns, or the
        Fault that job alone gets (a frame at a position its session cannot take)."""
        from inferencemesh.stage.runtime import PositionError, Segment

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
        if self.metrics is not None:
            first = jobs[runnable[0]][1]
            self.metrics.forward_by_kind[KIND_NAMES[first.kind]].observe(time.perf_counter() - started)
            self.metrics.batch_frames.observe(len(segments))
            for index in runnable:
                frame = jobs[index][1]
                self.metrics.frames_by_kind[KIND_NAMES[frame.kind]].inc()
                self.metrics.tokens.inc(frame.token_count)
        for index, out in zip(runnable, outs, strict=True):
            session, frame, _ = jobs[index]
            try:  # a frame that cannot be decided (bad draft_probs, penalties without ids) fails alone
                results[index] = self._decide(session, frame, out) if self.is_last and out is not None else out
            except Fault as fault:
                results[index] = fault
        return results

    def _decide(self, session: StageSession, frame: pb.Frame, logits: torch.Tensor) -> pb.Prediction | None:
        """Last stage: sample the next token, or verify a speculative window; with the raw
        logprobs of what was decided (and of the prompt) when the session asks for them."""
        sampling = session.sampling
        context = session.tokens
        if len(context) != frame.pos_start + frame.token_count and sampling.adjusts:
            raise Fault(grpc.StatusCode.INVALID_ARGUMENT,
                        "penalties, logit_bias and min_tokens need every frame's token_ids at the last stage")
        if frame.kind == pb.VERIFY:
            drafts = list(frame.token_ids[1:])
            probs = None
            if frame.draft_probs and not sampling.greedy:
                try:
                    probs = codec.decode_probs(frame.draft_probs, len(drafts), self.runtime.vocab_size)
                except codec.PayloadError as err:
                    raise Fault(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from err
            accepted, tokens = verify(logits, drafts, sampling, frame.pos_start, probs, context)
            prediction = pb.Prediction(session_id=session.session_id, seq=frame.seq, pos_start=frame.pos_start + 1,
                                       tokens=tokens, accepted=accepted)
            rows = logits[: len(tokens)]  # row i decided tokens[i]: the target's own logprobs, never the draft's
        else:
            position = frame.pos_start + frame.token_count
            tokens = [next_token(logits[-1], sampling, position, context)]
            prediction = pb.Prediction(session_id=session.session_id, seq=frame.seq, pos_start=position,
                                       tokens=tokens)
            rows = logits[-1:]
        if session.logprobs is not None:
            prediction.logprobs.extend(_entries(rows, tokens, session.logprobs))
        if frame.kind == pb.PREFILL and frame.prompt_logprobs:
            prediction.prompt_logprobs.extend(self._prompt_logprobs(session, frame, logits))
        return prediction

    def _prompt_logprobs(self, session: StageSession, frame: pb.Frame, logits: torch.Tensor) -> list[pb.TokenLogprobs]:
        """Each prompt token of the frame under the logits of the position before it: this
        frame's rows, and for its first token the previous chunk's last row (position 0 has none)."""
        ids = list(frame.token_ids)
        if len(ids) != frame.token_count:
            raise Fault(grpc.StatusCode.INVALID_ARGUMENT, "prompt_logprobs needs the frame's token_ids")
        rows, scored = logits[:-1], ids[1:]
        if frame.pos_start > 0:
            if session.prompt_tail is None or session.prompt_tail[0] != frame.pos_start:
                raise Fault(grpc.StatusCode.FAILED_PRECONDITION,
                            "prompt_logprobs of a chunk needs the previous chunk with prompt_logprobs")
            rows, scored = torch.cat([session.prompt_tail[1], rows]), ids
        session.prompt_tail = (frame.pos_start + frame.token_count, logits[-1:].clone())
        return _entries(rows, scored, session.logprobs or 0)


def _entries(rows: torch.Tensor, tokens: list[int], top: int) -> list[pb.TokenLogprobs]:
    return [pb.TokenLogprobs(token=token, logprob=lp, top_tokens=ids, top_logprobs=lps)
            for token, lp, ids, lps in logprobs(rows, tokens, top)]
