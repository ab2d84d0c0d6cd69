"""Payloads on the wire: activations as raw little-endian bytes with an explicit dtype allow-list,
and a VERIFY frame's sparse draft distributions.

Nothing here deserialises objects: a payload is only ever reinterpreted as an array of one
of three float types, after its size has been checked against the frame header.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol.transport import MAX_DRAFT_TOKENS
from inferencemesh.sampling import DraftRow

WIRE_DTYPES: dict[pb.DType, torch.dtype] = {pb.F32: torch.float32, pb.F16: torch.float16, pb.BF16: torch.bfloat16}
WIRE_CODES: dict[torch.dtype, pb.DType] = {v: k for k, v in WIRE_DTYPES.items()}
DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# How far a draft row's probabilities and remainder may add up from 1: float32 rounding of up to
# MAX_DRAFT_TOKENS terms stays far below it, a row that is no distribution far above.
SUM_TOLERANCE = 1e-3


class PayloadError(ValueError):
    """The frame's payload does not match its header."""


def encode(hidden: torch.Tensor, wire_dtype: torch.dtype) -> bytes:
    """[T, H] hidden states as raw bytes in wire_dtype (little-endian; all our hosts are)."""
    return hidden.detach().to("cpu", wire_dtype).contiguous().view(torch.uint8).numpy().tobytes()


def decode(payload: bytes, dtype_code: pb.DType, shape: tuple[int, ...], token_count: int) -> torch.Tensor:
    """Raw bytes -> tensor of `shape`, after checking dtype and size against the header."""
    dtype = WIRE_DTYPES.get(dtype_code)
    if dtype is None:
        raise PayloadError(f"activation dtype {dtype_code} is not one of f32, f16, bf16")
    if len(shape) != 2 or shape[0] != token_count:
        raise PayloadError(f"activation shape {list(shape)} must be [token_count={token_count}, hidden]")
    expected = shape[0] * shape[1] * torch.finfo(dtype).bits // 8
    if len(payload) != expected:
        raise PayloadError(
            f"activation payload is {len(payload)} bytes; header says {list(shape)} x {dtype} = {expected}"
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # frombuffer warns that bytes are read-only; we never write to it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(payload, dtype=dtype).view(shape)


def encode_draft_q(rows: Sequence[DraftRow]) -> pb.DraftDistributions:
    """A window's draft rows (sampling.draft_row) as Frame.draft_q."""
    ids = torch.cat([row.ids for row in rows]) if rows else torch.empty(0, dtype=torch.int64)
    probs = torch.cat([row.probs for row in rows]) if rows else torch.empty(0)
    return pb.DraftDistributions(sizes=[row.ids.numel() for row in rows], remainders=[row.remainder for row in rows],
                                 token_ids=ids.numpy().astype("<i4").tobytes(),
                                 probs=probs.numpy().astype("<f4").tobytes())


def decode_draft_q(message: pb.DraftDistributions, rows: int, vocab: int) -> list[DraftRow]:
    """Frame.draft_q -> its `rows` DraftRows over a vocabulary of `vocab`, after checking that each is a
    distribution the draft could have drawn from: distinct ids in the vocabulary, finite non-negative
    probabilities and remainder that add up to 1, at most MAX_DRAFT_TOKENS listed."""
    sizes = list(message.sizes)
    if len(sizes) != rows or len(message.remainders) != rows:
        raise PayloadError(f"draft_q has {len(sizes)} sizes and {len(message.remainders)} remainders "
                           f"for {rows} drafts")
    if any(not 0 < n <= min(vocab, MAX_DRAFT_TOKENS) for n in sizes):
        raise PayloadError(f"draft_q lists 1..{min(vocab, MAX_DRAFT_TOKENS)} tokens a row, got sizes {sizes}")
    if not len(message.token_ids) == len(message.probs) == 4 * sum(sizes):
        raise PayloadError(f"draft_q has {len(message.token_ids)} bytes of ids and {len(message.probs)} of "
                           f"probabilities for sizes adding up to {sum(sizes)} (4 bytes each)")
    ids = np.frombuffer(message.token_ids, dtype="<i4").astype(np.int64)
    probs = np.frombuffer(message.probs, dtype="<f4").astype(np.float32)
    remainders = np.array(message.remainders, dtype=np.float32)
    if ((ids < 0) | (ids >= vocab)).any():
        raise PayloadError(f"draft_q names a token outside the vocabulary of {vocab}")
    if not (np.isfinite(probs).all() and np.isfinite(remainders).all()) or (probs < 0).any() or (remainders < 0).any():
        raise PayloadError("draft_q holds a negative or non-finite probability")
    row_of = np.repeat(np.arange(rows), sizes)
    keys = np.sort(row_of * vocab + ids)
    if (keys[1:] == keys[:-1]).any():
        raise PayloadError("draft_q names a token twice in a row")
    totals = np.bincount(row_of, weights=probs.astype(np.float64), minlength=rows) + remainders
    if (np.abs(totals - 1.0) > SUM_TOLERANCE).any():
        raise PayloadError(f"draft_q rows add up to {[round(t, 6) for t in totals.tolist()]}, not 1")
    if any(remainders[i] > 0 and n == vocab for i, n in enumerate(sizes)):
        raise PayloadError("draft_q has a row that lists every token and has a remainder")
    return [DraftRow(i, p, float(r), vocab) for i, p, r in zip(torch.from_numpy(ids).split(sizes),
                                                                 torch.from_numpy(probs).split(sizes),
                                                                 remainders.tolist(), strict=True)]
