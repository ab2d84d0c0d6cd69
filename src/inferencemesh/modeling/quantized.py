"""Linear layers that keep their weights quantized in memory: INT4, INT8 and FP8 (e4m3).

The loader builds a QuantizedLinear from a quantized checkpoint's tensors (the format is
checkpoint/quantization.py's; compressed-tensors' own unpacking reads its packed words) and
swaps it into transformers' decoder layers where the nn.Linear was, as packed.py swaps
PackedLinear in: the layers' forward code stays theirs. What a layer holds is what
quantization.held_bytes counts, so the plan's bytes are the stage's.

How each format computes, chosen by device, compute dtype and the number of rows (measured on
this machine's CPU, an AVX-512 EPYC with bfloat16 units, one thread; docs/benchmarks/quantized-*.json
and docs/design/quantized-weights.md have the numbers):

- INT8 and FP8, any scale layout, decode rows: the native kernels (native_kernels.py, compiled
  at first use): bfloat16 rows up to 16 with bfloat16 dot products where the CPU has them, else
  float32 products up to 8 (per-channel INT8 in bfloat16: 4, then _weight_int8pack_mm up to
  INT8_KERNEL_ROWS).
- INT4 (groups of 32-256), 16-bit compute: up to INT4_KERNEL_ROWS rows PyTorch's CPU kernel
  (_weight_int4pack_mm_for_cpu, GEMV-shaped: its time grows with the rows); more rows (prefill)
  dequantize the kernel's own packed blocks (_int4_cpu_tile) into a 16-bit scratch tile and run
  the 16-bit GEMM, so the weight is held once, in the kernel's layout.
- Everything else (prefill rows; a machine without the native kernels) dequantizes:
  TILE_ELEMENTS weights at a time into this thread's scratch buffer, then a GEMM of that tile, so
  no layer is ever held in float beside its quantized form. Per-channel (and per-tensor) INT8
  and FP8 tiles are not scaled: their scales multiply the product's columns, one pass fewer per
  weight. FP8 is converted by its bits (fp8_bits_as_float; torch's own float8 conversion is ~5x
  slower on a CPU).
- float32 compute (a CPU without bfloat16 units): PyTorch's kernels lose there
  (_weight_int8pack_mm and _weight_int4pack_mm_for_cpu with float32 activations are 5-40x slower
  than dequantizing), so every format but the native kernels' rows dequantizes; INT4 is then
  kept in row halves for cheap unpacking.

Weight-only formats read fewer bytes per token: on this CPU every format decodes faster than the
16-bit weight at batch 1 and 8 (docs/benchmarks/quantized-native-*.json).

On CUDA: FP8 per tensor or channel runs torch._scaled_mm (activations quantized per token,
dynamically, as vLLM does on H100) where _scaled_mm_takes says it can (bfloat16, sizes of 16,
sm89+), else dequantizes, as FP8 blocks do; INT4 runs tinygemm (torch._weight_int4pack_mm,
bfloat16, _int4_cuda_takes); INT8 dequantizes into scratch.
"""

from __future__ import annotations

import functools
import threading

import torch
from torch import nn
from torch.nn import functional

from inferencemesh.checkpoint.quantization import WeightQuant
from inferencemesh.modeling import native_kernels
from inferencemesh.modeling.packed import onednn_packs

INT4_KERNEL_GROUPS = (32, 64, 128, 256)  # group sizes the int4 kernels take
INT4_BLOCK = 64  # the CPU int4 kernel's layout: blocks of 64 output rows, each [in, 32] bytes (_int4_cpu_tile)
# Weights dequantized at a time (8 MiB in bfloat16): a whole layer of a model of a few billion
# parameters. Smaller, cache-sized tiles lost: each costs a few op dispatches and a smaller GEMM,
# which outweighed their passes staying in L2 (llama-150m decode, fp8: 256K elements 0.28x bf16,
# 1M 0.22x, 4M 0.39x; prefill 0.40x, 0.46x, 1.05x).
TILE_ELEMENTS = 4 * 1024 * 1024
LOAD_TILE_ELEMENTS = 256 * 1024  # rows quantized at a time at load (1 MiB of float32: L2)
INT8_KERNEL_ROWS = 8  # at most this many rows use _weight_int8pack_mm (its time grows with the rows)
INT4_KERNEL_ROWS = 16  # at most this many rows use _weight_int4pack_mm_for_cpu (likewise)
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


def unsigned_nibbles(q: torch.Tensor) -> torch.Tensor:
    """INT4 values q (int8 in [-8, 7]) as uint8 whose low nibble is the kernels' u = q + 8 (q's
    4-bit two's complement with its sign bit flipped; the high nibble is left as it falls)."""
    return q.view(torch.uint8) ^ 8


@functools.cache
def _int4_cpu_layout_known() -> bool:
    """Whether _int4_cpu_packed writes what torch's own converter writes (checked once, on a small
    matrix: a torch whose layout moved gets its converter, never a wrong weight)."""
    q = torch.randint(-8, 8, (2 * INT4_BLOCK, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    theirs = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32) + 8, 1)
    return torch.equal(_int4_cpu_packed(q, check=False), theirs)


def _int4_cpu_packed(q: torch.Tensor, check: bool = True) -> torch.Tensor:
    """q [n, k] (int8 in [-8, 7]) in the CPU int4 kernel's layout, [n, k / 2] uint8: each block of
    INT4_BLOCK rows as [k, 32] bytes, rows j and j + 32 in byte j's low and high nibbles. Written
    here in three byte passes (torch's converter takes ~10x as long: the load's largest cost);
    a last partial block, laid out otherwise, goes through torch's converter."""
    n, k = q.shape
    if n % INT4_BLOCK or (check and not _int4_cpu_layout_known()):
        return torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32) + 8, 1)
    u = unsigned_nibbles(q).view(n // INT4_BLOCK, 2, INT4_BLOCK // 2, k)
    return (u[:, 0] & 0x0F | u[:, 1] << 4).transpose(1, 2).contiguous().view(n, k // 2)


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)


def _scaled_mm_takes(quant: WeightQuant, n: int, k: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether FP8 [n, k] runs torch._scaled_mm on this device: per tensor or channel (one row-wise
    scale per output), both sizes multiples of 16 (cuBLASLt's FP8 GEMM), bfloat16 out (the
    row-wise output every torch since 2.5 takes), on a GPU with FP8 units (compute capability 8.9+)."""
    return device.type == "cuda" and quant.strategy in ("tensor", "channel") and n % 16 == 0 and k % 16 == 0 \
        and dtype == torch.bfloat16 and _capability(device) >= (8, 9)


def _int4_cuda_takes(n: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether INT4 [n, k] runs tinygemm (torch._weight_int4pack_mm) here: bfloat16 activations,
    whole tiles of 8 outputs (its scales must have exactly n rows, n rounded up to 8), sm80+."""
    return device.type == "cuda" and dtype == torch.bfloat16 and n % 8 == 0 and _capability(device) >= (8, 0)


def _inner_k_tiles(k: int) -> int:
    """tinygemm's k-tiles (16 inputs each) packed together: 8, 4 or 2, whichever divides k's tiles
    (_convert_weight_to_int4pack refuses k not a multiple of 16 x innerKTiles; a group size of 32
    or more divides k, so 2 always does)."""
    return next(t for t in (8, 4, 2) if k % (16 * t) == 0)


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
        # a 16-bit tile multiplies in float32 on a CPU without oneDNN's 16-bit units (packed.py)
        native = device.type != "cpu" or dtype == torch.float32 or onednn_packs(dtype)
        self.tile_dtype = dtype if native else torch.float32
        self.bias = None if bias is None else nn.Parameter(bias.to(device, dtype), requires_grad=False)
        scale = scale.to(torch.float32).reshape(quant.scale_shape(self.out_features, self.in_features))
        self.kernel_rows = 0  # a CPU kernel's path computes up to this many rows; more are dequantized
        # per channel or tensor: the scale multiplies the product's columns, not each weight
        self.scaled_after = quant.strategy in ("channel", "tensor") and zero is None and quant.bits == 8
        if quant.kind == "float":
            self.path = "scaled_mm" if _scaled_mm_takes(quant, self.out_features, self.in_features, dtype, device) \
                else "fp8_dequant"
            self.register_buffer("weight", weight.to(device).contiguous())
            self.register_buffer("scale", scale.to(device, dtype).contiguous())
            self.register_buffer("offset", None)
        elif quant.bits == 4:
            self._init_int4(weight, scale, zero, dtype, device)
        else:
            self._init_int8(weight, scale, zero, dtype, device)
        # INT8 and FP8 decode rows: the native kernel where it builds (native_kernels.py)
        self.native_rows, self.native_group = 0, (0, 0)  # the group fixed at load: no per-call work
        if self.path in ("int8", "fp8_dequant"):
            self.native_group = self._scale_group()
        if self.native_group[0] and native_kernels.takes(self.weight, dtype, self.in_features, self.native_group[0]):
            self.native_rows = native_kernels.rows_for(dtype, beside_pytorch_kernel=self.kernel_rows > 0)

    def _init_int4(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, dtype: torch.dtype,
                   device: torch.device) -> None:
        """Unsigned nibbles u = q + 8 and (scale, -zero x scale) pairs: w = (u - 8) x scale + offset,
        the int4 kernels' own formula."""
        groups = scale.shape[1]
        self.group_size = self.in_features // groups
        offset = torch.zeros_like(scale) if zero is None else -zero.to(torch.float32) * scale
        self.register_buffer("scale_zeros", torch.stack([scale.t(), offset.t()], -1).to(device, dtype).contiguous())
        kernel = self.group_size in INT4_KERNEL_GROUPS and dtype != torch.float32
        if kernel and device.type == "cpu":
            self.path = "int4_cpu"
            self.register_buffer("weight", _int4_cpu_packed(q).to(device))
            # more rows dequantize its blocks (whole ones only: a last partial block is laid out otherwise)
            self.kernel_rows = INT4_KERNEL_ROWS if self.out_features % INT4_BLOCK == 0 else 1 << 62
        elif kernel and _int4_cuda_takes(self.out_features, dtype, device):
            self.path = "int4_cuda"  # tinygemm: high nibble first
            unsigned = q.to(torch.int32) + 8
            nibbles = (unsigned[:, ::2] << 4 | unsigned[:, 1::2]).to(torch.uint8).to(device)
            self.register_buffer("weight", torch._convert_weight_to_int4pack(nibbles, _inner_k_tiles(self.in_features)))
        else:
            self.path = "int4_dequant"  # a row's first half in the low nibbles, its second in the high ones
            unsigned = unsigned_nibbles(q)
            half = self.in_features // 2
            self.register_buffer("weight", (unsigned[:, :half] & 0x0F | unsigned[:, half:] << 4).to(device))

    def _init_int8(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, dtype: torch.dtype,
                   device: torch.device) -> None:
        self.register_buffer("weight", q.to(device, torch.int8).contiguous())
        self.register_buffer("scale", scale.to(device, dtype).contiguous())
        offset = None if zero is None else (-zero.to(torch.float32) * scale).to(device, dtype).contiguous()
        self.register_buffer("offset", offset)
        if device.type == "cpu" and dtype != torch.float32 and zero is None and self.quant.strategy == "channel":
            self.kernel_rows = INT8_KERNEL_ROWS
        self.path = "int8"

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features).to(self.compute_dtype)
        if rows.shape[0] <= self.native_rows:
            y = native_kernels.woq_matmul(rows, self.weight, self.scale, self.offset, *self.native_group)
        elif self.path == "int4_cpu" and rows.shape[0] <= self.kernel_rows:
            y = torch._weight_int4pack_mm_for_cpu(rows, self.weight, self.group_size, self.scale_zeros)
        elif self.path == "int8" and rows.shape[0] <= self.kernel_rows:
            y = torch._weight_int8pack_mm(rows, self.weight, self.scale.reshape(-1))
        elif self.path == "int4_cuda":
            y = torch._weight_int4pack_mm(rows, self.weight, self.group_size, self.scale_zeros)
        elif self.path == "scaled_mm":
            y = self._scaled_mm(rows)
        else:
            y = self._dequantized_matmul(rows).to(self.compute_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The whole weight in the compute dtype, [out, in] (a new tensor: for checks, never per call)."""
        if self.path == "int4_cuda":  # the kernel's own layout: its product with I
            eye = torch.eye(self.in_features, dtype=self.compute_dtype, device=self.weight.device)
            return torch._weight_int4pack_mm(eye, self.weight, self.group_size, self.scale_zeros).t()
        if self.path == "int4_cpu" and self.kernel_rows > self.out_features:
            eye = torch.eye(self.in_features, dtype=self.compute_dtype, device=self.weight.device)
            return torch._weight_int4pack_mm_for_cpu(eye, self.weight, self.group_size, self.scale_zeros).t()
        tiles = [self._dequantize_rows(a, b, self.compute_dtype).clone() for a, b in self._tiles()]
        weight = torch.cat(tiles)
        return weight * self._column_scale(self.compute_dtype)[:, None] if self.scaled_after else weight

    def _tiles(self) -> list[tuple[int, int]]:
        """Row ranges of about TILE_ELEMENTS weights (whole scale blocks, whole int4 kernel blocks),
        dequantized one at a time."""
        tile = max(1, TILE_ELEMENTS // self.in_features)
        unit = {"block": self.quant.block[0]}.get(self.quant.strategy, 1)
        unit = INT4_BLOCK if self.path == "int4_cpu" else unit
        tile = max(unit, tile // unit * unit)
        return [(a, min(a + tile, self.out_features)) for a in range(0, self.out_features, tile)]

    def _scale_group(self) -> tuple[int, int]:
        """(inputs, outputs) one scale covers: a group or block's, a channel's (all inputs, one
        output), a tensor's (everything)."""
        k, n = self.in_features, self.out_features
        return {"group": (k // max(1, self.scale.shape[-1]), 1), "block": self.quant.block[::-1],
                "tensor": (k, n)}.get(self.quant.strategy, (k, 1))

    def _column_scale(self, dtype: torch.dtype) -> torch.Tensor:
        """A per-channel (or per-tensor) format's scales, as the product's columns take them."""
        scale = self.scale.reshape(-1).to(dtype)
        return scale * _FP8_SCALE if self.quant.kind == "float" else scale

    def _dequantized_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """x W^T a tile of W's rows at a time: each tile dequantized into a scratch buffer that stays
        in the CPU's cache while the matmul reads it (the whole weight's passes would go to memory)."""
        dtype = self.tile_dtype
        rows = rows.to(dtype)
        tiles = self._tiles()
        if len(tiles) == 1:
            out = functional.linear(rows, self._dequantize_rows(0, self.out_features, dtype))
        else:
            out = torch.empty(rows.shape[0], self.out_features, dtype=dtype, device=rows.device)
            for a, b in tiles:
                out[:, a:b] = functional.linear(rows, self._dequantize_rows(a, b, dtype))
        return out.mul_(self._column_scale(dtype)) if self.scaled_after else out

    def _dequantize_rows(self, a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [a, b) of the weight in `dtype`, in this thread's scratch buffer (valid until the
        next call); a per-channel format's without their scales (scaled_after)."""
        n, k = b - a, self.in_features
        device = self.weight.device
        if self.path == "int4_cpu":
            return self._int4_cpu_tile(a, b, dtype)
        out = _scratch(n * k, dtype, device).view(n, k)
        if self.quant.kind == "float":
            if dtype in (torch.float32, torch.bfloat16):
                fp8_bits_as_float(self.weight[a:b], out)
            else:  # float16: through bfloat16's fields
                out.copy_(fp8_bits_as_float(self.weight[a:b], _scratch(n * k, torch.bfloat16, device).view(n, k)))
            if self.scaled_after:
                return out
            per = self.quant.block[0] if self.quant.strategy == "block" else 1  # rows a scale row covers
            return self._scaled(out, self.scale[a // per:-(-b // per)] * _FP8_SCALE)
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
        if self.scaled_after:
            return out
        groups = out.view(n, self.scale.shape[1], -1)
        groups.mul_(self.scale[a:b, :, None])
        if self.offset is not None:
            groups.add_(self.offset[a:b, :, None])
        return out

    def _int4_cpu_tile(self, a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [a, b) (whole INT4_BLOCKs) read from the CPU kernel's own layout, as a [b - a, in]
        view of a transposed scratch tile: the kernel keeps each block of 64 output rows as [in, 32]
        bytes, rows j and j + 32 in byte j's low and high nibbles."""
        n, k, group = b - a, self.in_features, self.group_size
        device = self.weight.device
        blocks = self.weight.view(-1, k, INT4_BLOCK // 2)[a // INT4_BLOCK:b // INT4_BLOCK].transpose(0, 1)
        nibbles = _scratch(n * k, torch.uint8, device).view(k, n // INT4_BLOCK, 2, INT4_BLOCK // 2)
        torch.bitwise_and(blocks, 0x0F, out=nibbles[:, :, 0])
        torch.bitwise_right_shift(blocks, 4, out=nibbles[:, :, 1])
        out = _scratch(n * k, dtype, device).view(k // group, group, n)
        out.copy_(nibbles.view(k // group, group, n))
        pairs = self.scale_zeros[:, a:b]  # [groups, n, 2]: (scale, offset) per group and row, made
        scale, offset = (pairs[..., i].contiguous()[:, None] for i in (0, 1))  # contiguous (10x faster)
        torch.addcmul(offset, out.sub_(8), scale, out=out)
        return out.view(k, n).t()

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
        # [1, out], contiguous: a per-tensor scale expanded has stride 0, which CUDA's row-wise check refuses
        w_scale = self.scale.float().expand(self.out_features, 1).reshape(1, -1).contiguous()
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
    """A 16-bit (or float32) weight [out, in] quantized weight-only (quantized_values)."""
    q, scale = quantized_values(quant, weight)
    return QuantizedLinear(quant, q, scale, None, None, dtype, device)


def quantized_values(quant: WeightQuant, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] quantized symmetric, round to nearest: (values, float32 scales [out,
    groups]), the scales of compressed-tensors' calculate_qparams (the largest magnitude over 7.5
    for INT4, 127.5 for INT8, 448 for FP8), per channel or per group as `quant` says. The weight is
    read once, a cache-sized tile of rows at a time, and divided by its scales in float32 (as
    compressed-tensors divides) in place: loading never holds a float copy of a layer. The native
    kernel (native_kernels.quantize) computes the same bits in one pass where it can."""
    n, k = weight.shape
    size = quant.group_size if quant.strategy == "group" else k
    native = native_kernels.quantize(weight, quant.kind, quant.bits, size)
    return native if native is not None else _quantized_values_torch(quant, weight, size)


def _quantized_values_torch(quant: WeightQuant, weight: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantized_values through PyTorch's ops, groups of `size` inputs."""
    n, k = weight.shape
    top = {"float": torch.finfo(torch.float8_e4m3fn).max, "int": (2 ** quant.bits - 1) / 2}[quant.kind]
    scale = torch.empty(n, k // size, device=weight.device)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn if quant.kind == "float" else torch.int8, device=weight.device)
    rows = max(1, LOAD_TILE_ELEMENTS // k)
    for a in range(0, n, rows):
        b = min(a + rows, n)
        tile = _scratch((b - a) * k, torch.float32, weight.device).view(b - a, -1, size)
        tile.copy_(weight[a:b].reshape(b - a, -1, size))
        torch.div(tile.abs().amax(-1), top, out=scale[a:b]).clamp_(min=torch.finfo(torch.float32).tiny)
        tile.div_(scale[a:b, :, None])
        if quant.kind == "float":
            tile.clamp_(-top, top)
        else:
            tile.round_().clamp_(-(2 ** (quant.bits - 1)), 2 ** (quant.bits - 1) - 1)
        q[a:b] = tile.view(b - a, k)
    return q, scale
