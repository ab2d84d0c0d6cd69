"""The last stage's decision for one frame: sample the next token, or verify a speculative window,
with the raw logprobs of what was decided (and of the prompt) when the session asks for them."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import torch

from inferencemesh.modeling.kv_pool import NO_TOKEN
from inferencemesh.protocol import codec
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol.errors import Fault
from inferencemesh.sampling import logprobs, next_token, verify
from inferencemesh.stage.sessions import StageSession
from inferencemesh.token_masks import apply_token_masks, unpack_token_masks


def decide(session: StageSession, frame: pb.Frame, logits: torch.Tensor, vocab_size: int,
           context: Sequence[int] | None = None) -> pb.Prediction:
    """The Prediction for `frame` from its logits rows (every row for VERIFY, else the last).
    context: the session's token ids by position through the frame's last (the pool's token slots,
    kv_pool.NO_TOKEN where a frame carried none); needed only when the sampling adjusts the logits."""
    sampling = session.sampling
    if sampling.adjusts and (context is None or len(context) != frame.pos_start + frame.token_count
                             or NO_TOKEN in context):
        raise Fault(grpc.StatusCode.INVALID_ARGUMENT,
                    "penalties, logit_bias and min_tokens need every frame's token_ids at the last stage")
    context = context or ()
    if frame.kind == pb.VERIFY:
        drafts = list(frame.token_ids[1:])
        draft_q = None
        if frame.HasField("draft_q") and not sampling.greedy:
            try:
                draft_q = codec.decode_draft_q(frame.draft_q, len(drafts), vocab_size)
            except codec.PayloadError as err:
                raise Fault(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from err
        accepted, tokens = verify(_masked(frame, logits[: len(drafts) + 1]), drafts, sampling, frame.pos_start,
                                  draft_q, context)
        prediction = pb.Prediction(session_id=session.session_id, seq=frame.seq, pos_start=frame.pos_start + 1,
                                   tokens=tokens, accepted=accepted)
        rows = logits[: len(tokens)]  # row i decided tokens[i]: the target's own logprobs, never the draft's
    else:
        position = frame.pos_start + frame.token_count
        tokens = [next_token(_masked(frame, logits[-1:])[0], sampling, position, context)]
        prediction = pb.Prediction(session_id=session.session_id, seq=frame.seq, pos_start=position, tokens=tokens)
        rows = logits[-1:]
    if session.logprobs is not None:
        prediction.logprobs.extend(_entries(rows, tokens, session.logprobs))
    if frame.kind == pb.PREFILL and frame.prompt_logprobs:
        prediction.prompt_logprobs.extend(_prompt_logprobs(session, frame, logits))
    return prediction


def _masked(frame: pb.Frame, rows: torch.Tensor) -> torch.Tensor:
    """The rows a frame decides from, with its token masks applied (a copy: the logprobs stay the
    model's own), or the rows themselves when it carries none."""
    if not frame.token_masks:
        return rows
    try:
        masks = unpack_token_masks(frame.token_masks)
        if masks.shape[0] != rows.shape[0]:
            raise ValueError(f"{masks.shape[0]} mask rows for the {rows.shape[0]} rows the frame decides from")
        return apply_token_masks(rows.clone(), masks)
    except ValueError as err:
        raise Fault(grpc.StatusCode.INVALID_ARGUMENT, f"token_masks: {err}") from err


def _prompt_logprobs(session: StageSession, frame: pb.Frame, logits: torch.Tensor) -> list[pb.TokenLogprobs]:
    """Each prompt token of the frame under the logits of the position before it: this frame's
    rows, and for its first token the previous chunk's last row (position 0 has none)."""
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
