"""AWQ and GPTQ layers as QuantizedLinear, and the one entry the loader builds every quantized
module through (build_quantized): compressed-tensors and fp8 by quantized.from_checkpoint, AWQ and
GPTQ converted here, gpt-oss's MXFP4 experts by modeling/mxfp4.py.

AWQ and GPTQ store unsigned values u in [0, 2^bits) and unsigned zero points z, w = (u - z) x s.
QuantizedLinear takes signed values and zeros, w = (q - zero) x scale, so q = u - 2^(bits-1) and
zero = z - 2^(bits-1): the same weights, held as the compressed-tensors INT4/INT8 layers are (AWQ's
and GPTQ's unpacking follows their tools, cited in checkpoint/quant_gptq_awq.py: neither AutoAWQ
nor GPTQModel runs with this torch, so the formats are read by their specification).

GPTQ's desc_act ("act order") quantizes the inputs in an order of their own: g_idx names each
input's group, and a group's inputs are scattered. The layer's inputs are then permuted once per
call (sorted by group, as vLLM's GPTQ Marlin and exllama kernels do), so that its groups are
contiguous for the kernels: PermutedLinear holds that permutation (int32, counted by held_bytes).
"""

from __future__ import annotations

import torch
from torch import nn

from inferencemesh.checkpoint.errors import CheckpointError, shown
from inferencemesh.checkpoint.quantization import QuantizedModule, WeightQuant
from inferencemesh.modeling.quantized import QuantizedLinear, from_checkpoint

AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # the logical column of each nibble of an AWQ word (AutoAWQ's)
_V1_ZERO_OFFSET = {4: 0x11111111, 8: 0x01010101}  # "gptq" (v1) stores every zero minus one, word by word


class PermutedLinear(nn.Module):
    """y = linear(x[..., perm]): a QuantizedLinear whose groups are GPTQ act-order groups sorted."""

    perm: torch.Tensor

    def __init__(self, perm: torch.Tensor, linear: QuantizedLinear) -> None:
        super().__init__()
        self.register_buffer("perm", perm.to(device=linear.weight.device, dtype=torch.int32))
        self.linear = linear
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.index_select(-1, self.perm))

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] in the checkpoint's input order (for checks)."""
        weight = self.linear.dequantized()
        return torch.empty_like(weight).index_copy_(1, self.perm.long(), weight)


def build_quantized(spec: QuantizedModule, tensors: dict[str, torch.Tensor], target: object, dtype: torch.dtype,
                    device: torch.device) -> nn.Module:
    """The module a stage holds for one quantized checkpoint module (`tensors` by suffix), built in
    place of `target` (the float module the family's model has there, on the meta device)."""
    quant = spec.quant
    if quant.layout == "mxfp4":
        from inferencemesh.modeling.mxfp4 import Mxfp4Experts

        return Mxfp4Experts.from_checkpoint(target, tensors, dtype, device)
    if quant.layout in ("awq", "gptq", "gptq_v2"):
        return _integer(spec, tensors, dtype, device)
    return from_checkpoint(quant, spec.out_features, spec.in_features, tensors, dtype, device)


def fits(spec: QuantizedModule, target: object) -> bool:
    """Whether the model's module `target` is what the checkpoint quantizes there."""
    if spec.quant.layout == "mxfp4":
        from inferencemesh.modeling.mxfp4 import fits_experts

        return fits_experts(target)
    return isinstance(target, nn.Linear) and (target.out_features, target.in_features) == \
        (spec.out_features, spec.in_features)


def unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32/bits unsigned values, low bits first, spread along `dim` (0: rows,
    1: columns), as int32."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    if dim == 0:
        values = words[:, None, :].bitwise_right_shift(shifts[None, :, None])
        return values.bitwise_and_((1 << bits) - 1).reshape(-1, words.shape[1])
    values = words[:, :, None].bitwise_right_shift(shifts[None, None, :])
    return values.bitwise_and_((1 << bits) - 1).reshape(words.shape[0], -1)


def awq_values(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ GEMM words -> (values [in, out], zeros [groups, out]), unsigned, in logical order."""
    order = torch.arange(qweight.shape[1] * 8).view(-1, 8)[:, list(AWQ_REVERSE_ORDER)].reshape(-1)
    return unpack(qweight, 4, 1)[:, order], unpack(qzeros, 4, 1)[:, order]


def gptq_values(qweight: torch.Tensor, qzeros: torch.Tensor, bits: int, v1: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ words -> (values [in, out], zeros [groups, out]), unsigned; the classic format's zeros
    get their one back as GPTQModel adds it, on the whole word (a zero of 0 was stored as -1, and
    its borrow from the next value is undone by the carry)."""
    if v1:
        qzeros = (qzeros.to(torch.int64) + _V1_ZERO_OFFSET[bits]) & 0xFFFFFFFF
    return unpack(qweight, bits, 0), unpack(qzeros, bits, 1)


def _integer(spec: QuantizedModule, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
             device: torch.device) -> nn.Module:
    """An AWQ or GPTQ layer as a QuantizedLinear (wrapped in its input permutation with act order)."""
    quant, n, k = spec.quant, spec.out_features, spec.in_features
    if quant.layout == "awq":
        values, zeros = awq_values(tensors["qweight"], tensors["qzeros"])
    else:
        values, zeros = gptq_values(tensors["qweight"], tensors["qzeros"], quant.bits, quant.layout == "gptq")
    groups = zeros.shape[0]
    g_idx = tensors.get("g_idx")
    perm = None
    if g_idx is not None and quant.strategy == "group":
        perm = _group_order(g_idx.to(torch.int64), quant, k, groups)
        if perm is not None:
            values = values[perm]
    mid = 1 << (quant.bits - 1)
    if quant.symmetric and not bool((zeros == mid).all()):
        raise CheckpointError(f"GPTQ layer of {n}x{k}: sym is true, but its qzeros are not all {mid} (after the "
                              f"{quant.layout} format's offset)")
    weight = (values - mid).to(torch.int8).t()
    zero = None if quant.symmetric else (zeros - mid).t()
    linear = QuantizedLinear(quant, weight, tensors["scales"].t().float(), zero, tensors.get("bias"),
                             dtype, device)
    if quant.act_order:
        return PermutedLinear(perm if perm is not None else torch.arange(k), linear)
    return linear


def _group_order(g_idx: torch.Tensor, quant: WeightQuant, k: int, groups: int) -> torch.Tensor | None:
    """The permutation that makes g_idx's groups contiguous (None: they are in order already);
    refuses a g_idx that is not `groups` groups of group_size inputs, or out of order without
    desc_act."""
    in_order = torch.equal(g_idx, torch.arange(k, device=g_idx.device) // quant.group_size)
    if in_order:
        return None
    counts = torch.bincount(g_idx.clamp(0, groups), minlength=groups + 1)
    if int(g_idx.min()) < 0 or counts[groups] or not bool((counts[:groups] == quant.group_size).all()):
        raise CheckpointError(f"GPTQ layer with {k} inputs: g_idx is not {groups} groups of {quant.group_size} inputs")
    if not quant.act_order:
        raise CheckpointError(f"GPTQ layer with {k} inputs: g_idx is out of order, but desc_act is false "
                              f"(or static_groups true): {shown(g_idx[:8].tolist(), 60)}")
    return torch.argsort(g_idx, stable=True)

