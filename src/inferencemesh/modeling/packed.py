"""CPU linear layers with their weights laid out once for the matmul kernel, not on every call.

Decoding runs every linear layer on a single row, so on CPU the weight layout decides the
speed. nn.Linear in bfloat16/float16 hands oneDNN a plain weight that it reorders into its
blocked layout on every call; prepacking once (what inductor's weight freezing does) makes the
same kernel about twice as fast, with bit-identical results. In float32, MKL streams a
[in, out] weight for one row markedly faster than nn.Linear's [out, in] (about 1.3x on
a 150M-parameter Llama); results differ from nn.Linear only by summation order.

A 16-bit weight that oneDNN cannot pack (a CPU without AVX-512 BF16/FP16 support) stays an
nn.Linear: the transposed layout would send its matmul to a kernel 15-20x slower than
nn.Linear's (measured on an AVX2 EPYC, bfloat16 [500, 896] x [896, 4864]: 4.1 s against 0.22 s;
that was the stage's bfloat16 prefill running 10x slower than transformers' forward).

pack_linears() swaps these modules in place inside transformers' own decoder layers, so the
layers' forward code (norms, rotary, attention, MLP) stays theirs.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs a CPU weight of this 16-bit dtype here (float32: never; MKL takes it)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def packs(linear: nn.Linear) -> bool:
    """Whether a PackedLinear is faster than `linear` here: a CPU weight in float32, or in a
    16-bit type oneDNN packs on this CPU."""
    weight = linear.weight
    return weight.device.type == "cpu" and (weight.dtype == torch.float32 or onednn_packs(weight.dtype))


class PackedLinear(nn.Module):
    """y = x W^T + b with W stored as the CPU kernel wants it (see the module docstring)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.bias = linear.bias
        self._mkldnn = onednn_packs(weight.dtype)
        if self._mkldnn:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        else:
            self.packed = weight.t().contiguous()  # [in, out]
        self.nbytes = weight.numel() * weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        y = torch.matmul(x, self.packed)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        kind = "mkldnn" if self._mkldnn else "transposed"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {kind}"


def pack_linears(module: nn.Module) -> int:
    """Replace every nn.Linear under `module` that packs() with a PackedLinear, except one whose
    parent's forward reads its weight (a MoE router reading `self.wg.weight.dtype`, Hunyuan).
    Returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear and packs(child) and not _reads_weight(type(module), name):
            setattr(module, name, PackedLinear(child))
            count += 1
        else:
            count += pack_linears(child)
    return count


_READS_WEIGHT: dict[tuple[type, str], bool] = {}


def _reads_weight(parent: type[nn.Module], name: str) -> bool:
    """Whether the forward of module class `parent` reads its child `name`'s weight."""
    key = (parent, name)
    if key not in _READS_WEIGHT:
        try:
            source = inspect.getsource(parent.forward)
        except (OSError, TypeError):  # no source to read: assume it may
            source = f"self.{name}.weight"
        _READS_WEIGHT[key] = f"self.{name}.weight" in source
    return _READS_WEIGHT[key]
