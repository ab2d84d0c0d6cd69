"""Activation payloads on the wire: raw little-endian bytes with an explicit dtype allow-list.

Nothing here deserialises objects: a payload is only ever reinterpreted as an array of one
of three float types, after its size has been checked against the frame header.
"""

from __future__ import annotations

import warnings

import torch

from inferencemesh.protocol import stage_pb2 as pb

WIRE_DTYPES: dict[pb.DType, torch.dtype] = {pb.F32: torch.float32, pb.F16: torch.float16, pb.BF16: torch.bfloat16}
WIRE_CODES: dict[torch.dtype, pb.DType] = {v: k for k, v in WIRE_DTYPES.items()}
DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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


def decode_probs(payload: bytes, rows: int, vocab: int) -> torch.Tensor:
    """The draft's f32 [rows, vocab] distributions of a VERIFY frame."""
    if len(payload) != rows * vocab * 4:
        raise PayloadError(f"draft_probs is {len(payload)} bytes; expected {rows} x {vocab} x 4")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        probs = torch.frombuffer(payload, dtype=torch.float32).view(rows, vocab)
    if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()):
        raise PayloadError("draft_probs holds a negative or non-finite probability")
    return probs
