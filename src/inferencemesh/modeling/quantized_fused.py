"""Quantized linear layers of one input as one: a layer's queries, keys and values (or gate and up)
computed by one QuantizedLinear whose output features are theirs one after the other.

The lean layers fuse 16-bit and float32 projections by concatenating their weights (lean_layers.py);
a quantized layer's weight is held in its kernel's layout, so it is concatenated in that layout:
every buffer that runs along the output features (the values, their scales, zero offsets, bias)
is joined on that axis. That is the same layer where each part's output features are whole units
of the layout: the CPU INT4 kernel's blocks of 64 rows, an FP8 scale block's rows. Per-tensor
scales (one number a part) and act-order layers (an input permutation each) do not fuse, nor does
tinygemm's layout (untested on a GPU so far): those compute part by part.

One call instead of two or three saves the calls' fixed costs (on a CPU a few microseconds each;
on a GPU a kernel launch each), and a GEMV-shaped kernel streams one matrix instead of three.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from inferencemesh.modeling.quantized import INT4_BLOCK, QuantizedLinear

# Buffers along the output features, and the axis they are joined on.
_OUTPUT_AXIS = {"weight": 0, "scale": 0, "offset": 0, "scale_zeros": 1}


def _rows_per_unit(linear: QuantizedLinear) -> int | None:
    """Output features a unit of the layer's layout holds (None: the layer cannot be joined)."""
    quant = linear.quant
    if quant.strategy == "tensor" or quant.kind not in ("int", "float"):
        return None
    if linear.path == "int4_cpu":
        return INT4_BLOCK
    if linear.path == "int4_cuda":  # tinygemm's tiles of 8 would join on dim 0; not yet run on a GPU
        return None
    return quant.block[0] if quant.strategy == "block" else 1


def fused_outputs(modules: Sequence[nn.Module]) -> QuantizedLinear | None:
    """One QuantizedLinear computing what `modules` compute, their outputs concatenated, where they
    are QuantizedLinears of one format, input, path and dtype, each a whole number of the layout's
    units; else None."""
    if len(modules) < 2 or any(type(m) is not QuantizedLinear for m in modules):
        return None
    parts: list[QuantizedLinear] = list(modules)  # type: ignore[arg-type]
    first = parts[0]
    unit = _rows_per_unit(first)
    alike = all(p.quant == first.quant and p.path == first.path and p.in_features == first.in_features
                and p.compute_dtype == first.compute_dtype and p.kernel_rows == first.kernel_rows
                and (p.bias is None) == (first.bias is None) for p in parts)
    if unit is None or not alike or any(p.out_features % unit for p in parts):
        return None
    fused = copy.copy(first)  # the same format and path; its tensors replaced below
    fused._buffers = {name: None if first._buffers[name] is None else
                      torch.cat([p._buffers[name] for p in parts], dim=_OUTPUT_AXIS[name])  # type: ignore[misc]
                      for name in first._buffers}
    fused._parameters, fused._modules = {}, {}
    fused.bias = None if first.bias is None else nn.Parameter(torch.cat([p.bias for p in parts]),  # type: ignore[misc]
                                                               requires_grad=False)
    fused.out_features = sum(p.out_features for p in parts)
    return fused
