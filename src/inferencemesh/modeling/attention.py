"""The attention function the stage's decoder layers call (registered with transformers).

It is transformers' own sdpa attention, with one difference: on CPU, a bfloat16/float16
model keeps its KV cache in float32 and attends in float32. PyTorch's CPU attention kernels
are several times slower in half precision than in float32 (140 us against 18 us per layer
for one query over 64 positions; 3 ms against 0.5 ms over 2000), which would make attention,
not the weights, the cost of a long decode. The cache costs twice the bytes of a
half-precision one; the query and the output are converted, a row at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "inferencemesh_sdpa"


@dataclass
class PackedAttention:
    """Keys, values and mask per segment of a batched pass (several sessions' tokens packed in
    one sequence): what the runtime's packed cache hands attention in place of the keys."""

    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
    counts: list[int]


def stage_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor | PackedAttention,
    value: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if isinstance(key, PackedAttention):  # each session's queries over its own cache
        outs = [stage_attention(module, q, k, v, mask, **kwargs)[0]
                for q, (k, v, mask) in zip(query.split(key.counts, dim=2), key.parts, strict=True)]
        return torch.cat(outs, dim=1), None
    if key.dtype == query.dtype:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out, _ = sdpa_attention_forward(module, query.to(key.dtype), key, value, attention_mask, **kwargs)
    return out.to(query.dtype), None


def kv_cache_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a stage keeps its KV cache in (see the module docstring)."""
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


AttentionInterface.register(NAME, stage_attention)
