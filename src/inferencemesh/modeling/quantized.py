"""Linear layers that keep their weights quantized in memory: INT4, INT8 and FP8 (e4m3).

The loader builds a QuantizedLinear from a quantized checkpoint's tensors (the format is
checkpoint/quantization.py's; compressed-tensors' own unpacking reads its packed words) and
swaps it into transformers' decoder layers where the nn.Linear was, as packed.py swaps
PackedLinear in: the layers' forward code stays theirs. What a layer holds is what
quantization.held_bytes counts, so the plan's bytes are the stage's.

How each format computes, chosen by device and compute dtype. Measured on this machine's CPU (an
AVX-512 EPYC with bfloat16 units, one thread, a [5632, 2048] weight, the best of 5 interleaved
rounds; ms per call, a decode row / a 64-row prefill):

    compute in bfloat16                         decode  prefill    compute in float32      decode  prefill
    16-bit weight, PackedLinear (the baseline)   1.32    7.55      PackedLinear              2.38    21.6
    INT8 per channel (_weight_int8pack_mm)       1.16    14.1      INT8 (scratch)            3.67    23.4
    INT8 grouped (scratch)                       4.86    13.8      INT8 grouped (scratch)    3.63    23.7
    INT4 grouped (_weight_int4pack_mm_for_cpu)   0.62    17.5      INT4 (scratch)            8.15    29.5
    FP8 per channel (scratch)                    5.56    15.8      FP8 (scratch)             5.41    26.4
    FP8 128x128 blocks (scratch)                 6.00    17.6      FP8 blocks (scratch)      6.05    23.9

and the kernels where they lost: _weight_int8pack_mm with float32 activations 9.6 / 674 ms,
_weight_int4pack_mm_for_cpu with float32 activations 20.5 / 1285 ms, torch's own float8 -> float
conversion 57 ms per call. So INT4 runs PyTorch's CPU kernel in 16-bit compute (twice as fast as
the 16-bit weight for a decode row, 2.3x slower for a prefill) and dequantizes otherwise; INT8
per channel runs _weight_int8pack_mm for decode rows (at most INT8_KERNEL_ROWS) in 16-bit
compute; everything else dequantizes ("scratch"): a cache-sized tile of rows at a time
(TILE_ELEMENTS) into a per-thread scratch buffer, then a matmul of that tile, so no layer is
ever held in float, and a few rows multiply in float32 (oneDNN would reorder a 16-bit tile on
every call). FP8 is converted by its bits (fp8_bits_as_float). Weight-only dequantization reads
fewer bytes but does more work per byte, so on a CPU only the INT4 and INT8 kernels beat the
16-bit weight's decode; the others save memory (and stages), not time.

On CUDA: FP8 per tensor or channel runs torch._scaled_mm (activations quantized per token,
dynamically, as vLLM does on H100), FP8 blocks dequantize; INT4 runs tinygemm
(torch._weight_int4pack_mm, bfloat16); INT8 dequantizes into scratch.
"""

from __future__ import annotations

import threading

import torch
from torch import nn
from torch.nn import functional

from inferencemesh.checkpoint.quantization import WeightQuant

INT4_KERNEL_GROUPS = (32, 64, 128, 256)  # group sizes the int4 kernels take
TILE_ELEMENTS = 256 * 1024  # weights dequantized at a time: 1 MiB in float32, within a core's L2
INT8_KERNEL_ROWS = 4  # at most this many rows use _weight_int8pack_mm (it loses to dequantizing above)
SMALL_ROWS = 16  # up to this many rows, a 16-bit layer's dequantized tiles multiply in float32 on a CPU
_FP8_SCALE = 2.0 ** 120  # fp8_bits_as_float's values are the weights times 2^-120
_local = threading.local()


def _scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This thread's scratch buffer of at least numel elements (grown, never shrunk)."""
    key = (dtype, device)
    buffers = _local.__dict__.setdefault("buffers", {})
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: written in place in and out of inference mode
            buffer = buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel]


def fp8_bits_as_float(q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """e4m3fn values x 2^-120, written into `out` (float32 or bfloat16, q's shape) by three in-place
    integer passes: the byte sign-extended to 32 (16) bits and shifted left by 20 (4) puts e4m3's
    exponent and mantissa in float32's (bfloat16's) fields (e4m3's bias 7, theirs 127: the value is
    scaled by 2^-120, normals and subnormals alike), and a mask clears the sign's extension. No
    temporary is allocated (a fresh 46 MB tensor costs more in page faults than the passes);
    torch's own float8 conversion takes ~15x as long on a CPU."""
    wide = out.dtype == torch.float32
    bits = out.view(torch.int32 if wide else torch.int16)
    bits.copy_(q.view(torch.int8))
    if wide:
        bits.bitwise_left_shift_(20).bitwise_and_(0x87F00000 - (1 << 32))
    else:
        bits.bitwise_left_shift_(4).bitwise_and_(0x87FF - (1 << 16))
    return out


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W held quantized (see the module docstring for how it computes)."""

    weight: torch.Tensor
    scale: torch.Tensor
    scale_zeros: torch.Tensor
    offset: torch.Tensor | None

    def __init__(self, quant: WeightQuant, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                 bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> None:
        """weight: [out, in] int8 values (INT4's in [-8, 7]) or float8_e4m3fn; scale: [rows, cols]
        as quant.scale_shape; zero: the integer zero points [rows, cols] of an asymmetric format."""
        super().__init__()
        self.quant = quant
        self.out_features, self.in_features = weight.shape
        self.compute_dtype = dtype
        self.bias = None if bias is None else nn.Parameter(bias.to(device, dtype), requires_grad=False)
        scale = scale.to(torch.float32).reshape(quant.scale_shape(self.out_features, self.in_features))
        if quant.kind == "float":
            self.path = "scaled_mm" if device.type == "cuda" and quant.strategy != "block" else "fp8_dequant"
            self.register_buffer("weight", weight.to(device))
            self.register_buffer("scale", scale.to(device, dtype))
        elif quant.bits == 4:
            self._init_int4(weight, scale, zero, dtype, device)
        else:
            self._init_int8(weight, scale, zero, dtype, device)

    def _init_int4(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, dtype: torch.dtype,
                   device: torch.device) -> None:
        """Unsigned nibbles u = q + 8 and (scale, -zero x scale) pairs: w = (u - 8) x scale + offset,
        the int4 kernels' own formula."""
        groups = scale.shape[1]
        self.group_size = self.in_features // groups
        offset = torch.zeros_like(scale) if zero is None else -zero.to(torch.float32) * scale
        self.register_buffer("scale_zeros", torch.stack([scale.t(), offset.t()], -1).to(device, dtype).contiguous())
        unsigned = (q.to(torch.int32) + 8)
        kernel = self.group_size in INT4_KERNEL_GROUPS and dtype != torch.float32
        if kernel and device.type == "cpu":
            self.path = "int4_cpu"
            self.register_buffer("weight", torch._convert_weight_to_int4pack_for_cpu(unsigned, 1))
        elif kernel and device.type == "cuda" and dtype == torch.bfloat16:
            self.path = "int4_cuda"  # tinygemm: high nibble first
            nibbles = (unsigned[:, ::2] << 4 | unsigned[:, 1::2]).to(torch.uint8).to(device)
            self.register_buffer("weight", torch._convert_weight_to_int4pack(nibbles, 8))
        else:
            self.path = "int4_dequant"  # a row's first half in the low nibbles, its second in the high ones
            half = self.in_features // 2
            self.register_buffer("weight", (unsigned[:, :half] | unsigned[:, half:] << 4).to(torch.uint8).to(device))

    def _init_int8(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, dtype: torch.dtype,
                   device: torch.device) -> None:
        self.register_buffer("weight", q.to(device, torch.int8))
        self.register_buffer("scale", scale.to(device, dtype))
        self.register_buffer("offset", None if zero is None else (-zero.to(torch.float32) * scale).to(device, dtype))
        self.int8_kernel = device.type == "cpu" and dtype != torch.float32 and zero is None and scale.shape[1] == 1
        self.path = "int8"

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features).to(self.compute_dtype)
        if self.path == "int4_cpu":
            y = torch._weight_int4pack_mm_for_cpu(rows, self.weight, self.group_size, self.scale_zeros)
        elif self.path == "int4_cuda":
            y = torch._weight_int4pack_mm(rows, self.weight, self.group_size, self.scale_zeros)
        elif self.path == "int8" and self.int8_kernel and rows.shape[0] <= INT8_KERNEL_ROWS:
            y = torch._weight_int8pack_mm(rows, self.weight, self.scale.reshape(-1))
        elif self.path == "scaled_mm":
            y = self._scaled_mm(rows)
        else:
            y = self._dequantized_matmul(rows).to(self.compute_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The whole weight in the compute dtype, [out, in] (a new tensor: for checks, never per call)."""
        k = self.in_features
        if self.path in ("int4_cpu", "int4_cuda"):  # the kernel's own layout: its product with I
            eye = torch.eye(k, dtype=self.compute_dtype, device=self.weight.device)
            if self.path == "int4_cpu":
                return torch._weight_int4pack_mm_for_cpu(eye, self.weight, self.group_size, self.scale_zeros).t()
            return torch._weight_int4pack_mm(eye, self.weight, self.group_size, self.scale_zeros).t()
        return torch.cat([self._dequantize_rows(a, b, self.compute_dtype).clone() for a, b in self._tiles()])

    def _tiles(self) -> list[tuple[int, int]]:
        """Row ranges of about TILE_ELEMENTS weights (whole scale blocks), dequantized one at a time."""
        tile = max(1, TILE_ELEMENTS // self.in_features)
        if self.quant.strategy == "block":
            tile = max(self.quant.block[0], tile // self.quant.block[0] * self.quant.block[0])
        return [(a, min(a + tile, self.out_features)) for a in range(0, self.out_features, tile)]

    def _dequantized_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """x W^T a tile of W's rows at a time: each tile dequantized into a scratch buffer that stays
        in the CPU's cache while the matmul reads it (the whole weight's passes would go to memory)."""
        # A few 16-bit rows multiply faster in float32 on a CPU: oneDNN reorders a plain 16-bit weight
        # on every call (packed.py), which a tile dequantized per call cannot avoid.
        dtype = torch.float32 if rows.device.type == "cpu" and rows.shape[0] <= SMALL_ROWS else self.compute_dtype
        rows = rows.to(dtype)
        tiles = self._tiles()
        if len(tiles) == 1:
            return functional.linear(rows, self._dequantize_rows(0, self.out_features, dtype))
        out = torch.empty(rows.shape[0], self.out_features, dtype=dtype, device=rows.device)
        for a, b in tiles:
            out[:, a:b] = functional.linear(rows, self._dequantize_rows(a, b, dtype))
        return out

    def _dequantize_rows(self, a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [a, b) of the weight in `dtype`, in this thread's scratch buffer (valid until the
        next call)."""
        n, k = b - a, self.in_features
        device = self.weight.device
        out = _scratch(n * k, dtype, device).view(n, k)
        if self.quant.kind == "float":
            if dtype in (torch.float32, torch.bfloat16):
                fp8_bits_as_float(self.weight[a:b], out)
            else:  # float16: through bfloat16's fields
                out.copy_(fp8_bits_as_float(self.weight[a:b], _scratch(n * k, torch.bfloat16, device).view(n, k)))
            scale = self.scale
            if self.quant.strategy == "block":
                scale = scale[a // self.quant.block[0]:-(-b // self.quant.block[0])]
            elif self.quant.strategy == "channel":
                scale = scale[a:b]
            return self._scaled(out, scale * _FP8_SCALE)
        if self.quant.bits == 4:
            nibbles = _scratch(n * k, torch.uint8, device).view(n, 2, k // 2)
            torch.bitwise_and(self.weight[a:b], 0x0F, out=nibbles[:, 0])
            torch.bitwise_right_shift(self.weight[a:b], 4, out=nibbles[:, 1])
            out.copy_(nibbles.view(n, k))
            out.sub_(8)
            pairs = self.scale_zeros[:, a:b]
            out.view(n, -1, self.group_size).mul_(pairs[..., 0].t()[..., None]).add_(pairs[..., 1].t()[..., None])
            return out
        out.copy_(self.weight[a:b])
        groups = out.view(n, self.scale.shape[1], -1)
        groups.mul_(self.scale[a:b, :, None])
        if self.offset is not None:
            groups.add_(self.offset[a:b, :, None])
        return out

    def _scaled(self, out: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """out x scale, in place, scale broadcast over its blocks (a block at an edge may be partial)."""
        n, k = out.shape
        rows, cols = scale.shape
        b0, b1 = self.quant.block if self.quant.strategy == "block" else (n // rows, k // cols)
        if rows * b0 == n and cols * b1 == k:
            return out.view(rows, b0, cols, b1).mul_(scale[:, None, :, None]).view(n, k)
        return out.mul_(scale.repeat_interleave(b0, 0)[:n].repeat_interleave(b1, 1)[:, :k])

    def _scaled_mm(self, rows: torch.Tensor) -> torch.Tensor:
        """FP8 on CUDA: activations quantized per row (dynamic), both scales applied by the GEMM."""
        finfo = torch.finfo(torch.float8_e4m3fn)
        x_scale = rows.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / finfo.max
        x_fp8 = (rows / x_scale).clamp(finfo.min, finfo.max).to(torch.float8_e4m3fn)
        w_scale = self.scale.float().expand(self.out_features, 1).reshape(1, -1)
        return torch._scaled_mm(x_fp8, self.weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=self.compute_dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the quantized weight and its scales (the bias is counted as the float tensor it is)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        q = self.quant
        return (f"in_features={self.in_features}, out_features={self.out_features}, {q.name} {q.strategy}, "
                f"bias={self.bias is not None}, {self.path}")


def from_checkpoint(quant: WeightQuant, out_features: int, in_features: int, tensors: dict[str, torch.Tensor],
                    dtype: torch.dtype, device: torch.device) -> QuantizedLinear:
    """A QuantizedLinear from one module's checkpoint tensors, by suffix (weight or weight_packed,
    the scale, the zero point, the bias): packed words unpacked by compressed-tensors' own
    unpack_from_int32, the format's owner."""
    scale = tensors[quant.scale_name]
    rows, cols = quant.scale_shape(out_features, in_features)
    zero = tensors.get("weight_zero_point")
    if quant.packed:
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        weight = unpack_from_int32(tensors["weight_packed"], quant.bits, torch.Size([out_features, in_features]))
        if zero is not None and not quant.symmetric:
            zero = unpack_from_int32(zero, quant.bits, torch.Size([rows, cols]), packed_dim=0)
    else:
        weight = tensors["weight"]
    if quant.symmetric:
        zero = None
    elif zero is not None:
        zero = zero.reshape(rows, cols)
    return QuantizedLinear(quant, weight, scale, zero, tensors.get("bias"), dtype, device)


def quantize(quant: WeightQuant, weight: torch.Tensor, dtype: torch.dtype, device: torch.device) -> QuantizedLinear:
    """A 16-bit (or float32) weight [out, in] quantized weight-only, symmetric, round to nearest:
    the scales of compressed-tensors' calculate_qparams (the largest magnitude over 7.5 for INT4,
    127.5 for INT8, 448 for FP8), per channel or per group as `quant` says."""
    w = weight.to(torch.float32)
    groups = w.view(w.shape[0], -1, quant.group_size) if quant.strategy == "group" else w.unsqueeze(1)
    top = {"float": torch.finfo(torch.float8_e4m3fn).max, "int": (2 ** quant.bits - 1) / 2}[quant.kind]
    scale = (groups.abs().amax(-1) / top).clamp(min=torch.finfo(torch.float32).tiny)
    scaled = groups / scale[..., None]
    if quant.kind == "float":
        q = scaled.clamp(-top, top).to(torch.float8_e4m3fn).view(w.shape)
    else:
        q = scaled.round().clamp(-(2 ** (quant.bits - 1)), 2 ** (quant.bits - 1) - 1).to(torch.int8).view(w.shape)
    return QuantizedLinear(quant, q, scale, None, None, dtype, device)
