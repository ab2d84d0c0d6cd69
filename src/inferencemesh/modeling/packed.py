"""CPU linear layers with their weights laid out once for the matmul kernel, not on every call.

Decoding runs every linear layer on a single row, so on CPU the weight layout decides the
speed. nn.Linear in bfloat16/float16 hands oneDNN a plain weight that it reorders into its
blocked layout on every call; prepacking once (what inductor's weight freezing does) makes the
same kernel about twice as fast, with bit-identical results. float32 weights are prepacked for
oneDNN too: on this project's AVX-512 EPYC, a decode token's matmuls of the bundled model (one
thread, interleaved) took 1.74 ms against 1.98 ms through MKL's [in, out] layout (the best of
MKL's: nn.Linear's [out, in] 3.4 ms, MKL's own packed GEMM 2.2 ms), 2.3x less at 8 rows and at
prefill, and with two threads 1.9x less for one row, which MKL does not split. oneDNN's fixed
cost a call is higher, so small float32 matrices keep MKL's layout (ONEDNN_FLOAT32_MIN_WEIGHTS).
Results differ from nn.Linear's only by summation order.

The exception is a float32 LM head tied to the stage's embedding: it keeps MKL's [in, out]
layout, whose columns the embedding reads (ColumnEmbedding), so the largest matrix is held once.

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

# oneDNN's call costs ~10 us whatever the size (MKL's ~1-3 us): a float32 matrix smaller than this
# (llama-tiny's 64 x 128) is faster through MKL's [in, out] layout; from about 384 x 384 up,
# streamed from memory as a decode step reads it, oneDNN's is faster.
ONEDNN_FLOAT32_MIN_WEIGHTS = 128 * 1024


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs a CPU weight of this dtype here (float32 wherever oneDNN is built in;
    16-bit where the CPU has its units)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def packs(linear: nn.Linear) -> bool:
    """Whether a PackedLinear is faster than `linear` here (packs_weight of its weight)."""
    return packs_weight(linear.weight)


def packs_weight(weight: torch.Tensor) -> bool:
    """Whether a PackedLinear of this weight is faster than nn.Linear's: a CPU weight in float32,
    or in a 16-bit type oneDNN packs on this CPU."""
    return weight.device.type == "cpu" and (weight.dtype == torch.float32 or onednn_packs(weight.dtype))


class PackedLinear(nn.Module):
    """y = x W^T + b with W stored as the CPU kernel wants it (see the module docstring).
    transposed: MKL's [in, out] matrix (`packed`, readable by column) in place of oneDNN's layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, transposed: bool = False) -> None:
        super().__init__()
        weight = weight.detach()
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self._mkldnn = not transposed and onednn_packs(weight.dtype) and (
            weight.dtype != torch.float32 or weight.numel() >= ONEDNN_FLOAT32_MIN_WEIGHTS)
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
            setattr(module, name, PackedLinear(child.weight, child.bias))
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
