"""Position handling shared by the stage runtime and the frontend's draft model.

Both run decoder layers of the same families over their own KV caches, so both need the
rotary table and each layer's sliding window exactly as transformers defines them.
"""

from __future__ import annotations

from typing import Any

import torch

# Rotary types whose frequencies do not depend on the sequence length, so a table of cos/sin
# per position can be computed once. Others (dynamic NTK, longrope) are computed per forward.
STATIC_ROPE = {"default", "linear", "llama3", "yarn"}


def rope_table(config: Any, rotary: torch.nn.Module, max_context: int, dtype: torch.dtype,
               device: torch.device, layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos, sin [1, max_context, head_dim] from the model's rotary module, or None when the
    rotary type depends on the sequence length and must be computed per forward. layer_type:
    the layer type whose table it is, for a family with rotary parameters per type (Gemma3)."""
    # transformers 5 names it rope_parameters, 4.x rope_scaling (None for the default rope).
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if layer_type is not None:
        rope = rope.get(layer_type) or {}
    if rope.get("rope_type", rope.get("type", "default")) not in STATIC_ROPE:
        return None
    positions = torch.arange(max_context, device=device)[None]
    probe = torch.empty(0, dtype=dtype, device=device)
    with torch.inference_mode():
        if layer_type is not None:
            return rotary(probe, positions, layer_type)
        return rotary(probe, positions)


def sliding_window(config: Any, layer: int) -> int | None:
    """Layer `layer`'s sliding window, as transformers applies it for this family."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:  # Mistral: every layer slides when a window is set
        return int(window)
    return int(window) if layer_types[layer] == "sliding_attention" else None


def attention_mask(start: int, count: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Boolean sdpa mask [1, 1, count, start + count] (True = attend) for queries at positions
    [start, start + count) over keys [0, start + count); None where sdpa needs none.

    A single query attends to everything cached, and a prefill from position 0 uses sdpa's
    causal mode. Any other window needs an explicit mask: sdpa's is_causal is aligned top-left,
    which is wrong once the cache holds earlier positions.
    """
    stop = start + count
    slides = window is not None and stop > window
    if (count == 1 or start == 0) and not slides:
        return None
    q = torch.arange(start, stop, device=device)[:, None]
    k = torch.arange(stop, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    return allowed[None, None]
