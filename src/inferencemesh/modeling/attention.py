"""The attention function the stage's decoder layers call (registered with transformers).

It is transformers' own sdpa attention, with one difference: on CPU, a bfloat16/float16
model keeps its KV cache in float32 and attends in float32. PyTorch's CPU attention kernels
are several times slower in half precision than in float32 (140 us against 18 us per layer
for one query over 64 positions; 3 ms against 0.5 ms over 2000), which would make attention,
not the weights, the cost of a long decode. The cache costs twice the bytes of a
half-precision one; the query and the output are converted, a row at a time.

A batched pass (several sessions' frames packed in one sequence, see the stage runtime)
reaches attention as PackedAttention: each session's queries over its own keys and values (a
view of the stage's KV pool, or one gather of its blocks: modeling/kv_pool.py), one sdpa call per
session, so attention's work grows with the tokens each session has, never with the longest
session of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "inferencemesh_sdpa"


@dataclass
class KVSpans:
    """One session's keys and values as a few spans (views of the pool's runs of blocks), span i
    holding positions [starts[i], starts[i] + len): attended where they lie (split_kv_attention),
    never copied into one tensor."""

    keys: list[torch.Tensor]  # [1, kv_heads, len, head_dim] each
    values: list[torch.Tensor]
    starts: list[int]


# What a cache gives a layer's attention: the session's keys and values, whole or in spans.
KeysValues = tuple[torch.Tensor, torch.Tensor] | tuple[KVSpans, None]


@dataclass
class PackedAttention:
    """Keys, values and mask per segment of a batched pass (several sessions' tokens packed in
    one sequence): what the runtime's packed cache hands attention in place of the keys."""

    parts: list[tuple[torch.Tensor | KVSpans, torch.Tensor | None, torch.Tensor | None]]
    counts: list[int]


def stage_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor | PackedAttention | KVSpans,
    value: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    if isinstance(key, PackedAttention):  # each session's queries over its own cache
        cache_dtype = _dtype_of(key.parts[0][0])  # converted once for the pass, not per session
        queries = query.to(cache_dtype).split(key.counts, dim=2)
        if _needs_eager(kwargs) or kwargs.get("position_bias") is not None:
            attend = eager_attention if _needs_eager(kwargs) else sdpa_attention_forward
            outs = [attend(module, q, *_joined(k, v), mask, **kwargs)[0]
                    for q, (k, v, mask) in zip(queries, key.parts, strict=True)]
            return torch.cat(outs, dim=1).to(query.dtype), None
        return _packed_sdpa(module, queries, key.parts, kwargs.get("scaling")).to(query.dtype), None
    if isinstance(key, KVSpans):
        if _needs_eager(kwargs) or kwargs.get("position_bias") is not None:
            key, value = _joined(key, value)
        else:
            q = query.to(key.keys[0].dtype)
            out = split_kv_attention(q, key, attention_mask, kwargs.get("scaling"))
            return out.transpose(1, 2).to(query.dtype), None
    if _needs_eager(kwargs):
        return eager_attention(module, query.to(key.dtype), key, value, attention_mask,
                               **kwargs)[0].to(query.dtype), None
    # (transformers annotates attention_mask as a Tensor; None, which it takes, means causal.)
    if key.dtype == query.dtype:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)  # type: ignore[arg-type]
    out, _ = sdpa_attention_forward(module, query.to(key.dtype), key, value, attention_mask,  # type: ignore[arg-type]
                                    **kwargs)
    return out.to(query.dtype), None


def _packed_sdpa(module: torch.nn.Module, queries: Sequence[torch.Tensor],
                 parts: list[tuple[torch.Tensor | KVSpans, torch.Tensor | None, torch.Tensor | None]],
                 scaling: float | None) -> torch.Tensor:
    """Each session's queries [1, heads, T, D] over its keys and values, straight to torch's sdpa:
    what transformers' sdpa_attention_forward does for these inputs, less its per-call work (at 48
    sessions a batched pass calls it 48 times a layer), and grouped-query attention through sdpa's
    enable_gqa even under a mask (transformers copies the keys per group there: 1.8x slower).
    A mask of None means causal for several queries (a prefill from position 0: keys = queries)."""
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    outs = [attend(q, k, v, mask, scaling, gqa) for q, (k, v, mask) in zip(queries, parts, strict=True)]
    return torch.cat(outs, dim=2).transpose(1, 2)  # [1, T, heads, D], as transformers' attention returns


def attend(query: torch.Tensor, keys: torch.Tensor | KVSpans, values: torch.Tensor | None, mask: torch.Tensor | None,
           scaling: float | None, gqa: bool) -> torch.Tensor:
    """One session's queries [1, heads, T, D] over its keys and values (whole, or in spans), in the
    keys' dtype: [1, heads, T, D]. A mask of None means causal for several queries."""
    if isinstance(keys, KVSpans):
        return split_kv_attention(query, keys, mask, scaling)
    assert values is not None
    return torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, scale=scaling, is_causal=mask is None and query.shape[2] > 1,
        enable_gqa=gqa)


def split_kv_attention(query: torch.Tensor, spans: KVSpans, mask: torch.Tensor | None,
                       scaling: float | None) -> torch.Tensor:
    """Queries [1, heads, T, D] (the last T positions) over keys and values in spans, computed out
    (sdpa's math form) over the spans where they lie: the scores of every span side by side (T x
    positions per head: small beside the keys), one softmax, then each span's values weighted by
    its share. Equal to one pass over the joined keys up to float rounding (about 1e-7). Grouped
    queries are packed per key head (rows g T + t), so no key is copied per group. The flash
    kernel with its log-sum-exp per span was tried: 3x slower for a 4-token window over 1,500
    positions (it is slow for few queries under a mask). Returns [1, heads, T, D]."""
    _, heads, count, dim = query.shape
    kv_heads = spans.keys[0].shape[1]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else dim ** -0.5
    packed = (query * scale).reshape(1, kv_heads, groups * count, dim)
    scores = torch.cat([torch.matmul(packed, keys.transpose(-1, -2)) for keys in spans.keys], dim=-1)
    stop = scores.shape[-1]
    if mask is None and count > 1:  # causal, spelled out: a prefill from position 0
        mask = (torch.arange(stop, device=query.device)[None, :]
                <= torch.arange(stop - count, stop, device=query.device)[:, None])[None, None]
    if mask is not None:  # [1, 1, T, stop] -> the packed rows g T + t; a query always sees itself
        # A plain causal window masks only within its own last T columns: fill just those.
        edge = 0 if count == stop or not bool(mask[..., : stop - count].all()) else stop - count
        allowed = mask[..., edge:].expand(1, 1, count, stop - edge).repeat(1, 1, groups, 1)
        scores[..., edge:].masked_fill_(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = None
    for values, start in zip(spans.values, spans.starts, strict=True):
        part = torch.matmul(probs[..., start:start + values.shape[2]], values)
        out = part if out is None else out.add_(part)
    assert out is not None
    return out.reshape(1, heads, count, dim)


def _dtype_of(keys: torch.Tensor | KVSpans) -> torch.dtype:
    return keys.keys[0].dtype if isinstance(keys, KVSpans) else keys.dtype


def _joined(keys: torch.Tensor | KVSpans, values: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values as one tensor each (spans concatenated: the eager path needs them whole)."""
    if isinstance(keys, KVSpans):
        return torch.cat(keys.keys, dim=2), torch.cat(keys.values, dim=2)
    assert values is not None
    return keys, values


def _needs_eager(kwargs: dict[str, Any]) -> bool:
    """Whether a layer's attention does what sdpa cannot: capped scores (Gemma2) or sinks (gpt-oss)."""
    return bool(kwargs.get("softcap")) or kwargs.get("s_aux") is not None


def eager_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
                    attention_mask: torch.Tensor | None, *, softcap: float | None = None,
                    s_aux: torch.Tensor | None = None, scaling: float | None = None,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention computed out, for what sdpa cannot do, at the layer's own scaling:
    - softcap: scores capped as tanh(s / softcap) * softcap (Gemma2's attn_logit_softcapping);
    - s_aux: one learned sink logit per head, a column beside the keys in the softmax that takes
      its share of the probability and is then dropped (gpt-oss, granite-swa: `sinks`).
    The masks are the sdpa-style ones the rest of this module takes (boolean, True = attend;
    None = causal for several queries)."""
    assert value is not None
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is None and query.shape[2] > 1:  # sdpa's is_causal, aligned top-left
        q_len, k_len = query.shape[2], key.shape[2]
        attention_mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril()
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    if s_aux is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    else:
        sinks = s_aux.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
        probs = probs.to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


def kv_cache_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a stage keeps its KV cache in (see the module docstring)."""
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


AttentionInterface.register(NAME, stage_attention)
