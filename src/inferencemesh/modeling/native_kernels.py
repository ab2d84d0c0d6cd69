"""The CPU kernels PyTorch lacks, compiled from C at first use: weight-only INT8 and FP8 products
for the few rows of a decode step (native/woq_gemm.c says how they read memory and why), with
bfloat16 dot products (AVX512_BF16) for bfloat16 rows where the CPU has them; quantizing at load
(native/quantize.c); per-token operations whose dispatch outweighs their arithmetic
(native/host_ops.c: RMSNorm); attention over a KV pool's block tables for every session of a pass
in one call (native/paged_attention.c).

The sources ship with the package: native_build.py compiles them once per machine with its C
compiler into a cache, or ahead of time into an image (which has no compiler).

Where it cannot be had (no compiler, a CPU without AVX-512, INFERENCEMESH_NATIVE_KERNELS=0) one
log line says why and the layers compute as before, through PyTorch's kernels or dequantized
tiles: never a failed load or request.

The library is linked against libgomp, the OpenMP runtime PyTorch's CPU wheel loads under the
same soname, so the kernel's threads are PyTorch's (torch.get_num_threads()), not a second pool.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch

from inferencemesh.modeling import native_build

log = logging.getLogger(__name__)

SWITCH_ENV = "INFERENCEMESH_NATIVE_KERNELS"  # 0: never build or load
# Rows of x a layer sends here. In float32 each weight is widened once per 4 rows, so with more
# rows the products grow faster than the bytes saved: per-channel INT8 then has PyTorch's own
# kernel (equal at 4 rows, faster at 5-8); formats whose alternative is a dequantized tile come
# here up to 8 rows (llama-150m's layers, one thread: FP8 at 8 rows 12.8 against 18 ms). bfloat16
# rows with bfloat16 dot products come here up to 16 for every format (a third of llama-150m's
# layers, one thread, INT8: 8 rows 2.4 ms against a dequantized tile's 5.5, 16 rows 4.8 against
# 6.5, 40 rows 12.1 against 9.1). More rows (prefill chunks, a batch's verify windows) are
# compute-bound, where a 16-bit GEMM over dequantized tiles wins.
ROWS_BESIDE_PYTORCH_KERNEL = 4
MAX_ROWS = 8
MAX_DOT_ROWS = 16
_FORMATS = {torch.int8: 0, torch.float8_e4m3fn: 1}
_DTYPES = {torch.bfloat16: 0, torch.float32: 1}


def _load(path: Path) -> ctypes.CDLL | None:
    library = ctypes.CDLL(str(path))
    if not library.imesh_woq_available():
        return None
    library.imesh_woq_gemm.restype = ctypes.c_int
    library.imesh_woq_gemm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                       ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 5, *[ctypes.c_int] * 3]
    library.imesh_rms_norm_f32.restype = ctypes.c_int
    library.imesh_rms_norm_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]
    library.imesh_quantize.restype = ctypes.c_int
    library.imesh_quantize.argtypes = [ctypes.c_void_p, ctypes.c_int, *[ctypes.c_int64] * 3, ctypes.c_int, ctypes.c_int,
                                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    library.imesh_paged_attention_f32.restype = ctypes.c_int
    pointer_and_stride: list[type] = [ctypes.c_void_p, ctypes.c_int64]
    library.imesh_paged_attention_f32.argtypes = [*pointer_and_stride * 4,
                                                  ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 5,
                                                  ctypes.c_float, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    return library


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernels, built and loaded once per process; None (with one log line) where they cannot be."""
    if os.environ.get(SWITCH_ENV, "1") == "0":
        log.info("native CPU kernels off (%s=0): PyTorch's paths compute instead", SWITCH_ENV)
        return None
    try:
        path = native_build.prebuilt() or native_build.build()
        loaded = _load(path)
    except Exception as error:  # noqa: BLE001 - whatever stops the build, the layers compute without it
        detail = getattr(error, "stderr", None) or error
        log.warning("native CPU kernels unavailable (%s): PyTorch's paths compute instead", str(detail).strip())
        return None
    if loaded is None:
        log.info("native CPU kernels need AVX-512 (F, BW, DQ), which this CPU lacks: PyTorch's paths compute instead")
    else:
        dots = "yes" if loaded.imesh_woq_dot_available() else "no, this CPU lacks AVX512_BF16"
        log.info("native CPU kernels: %s (bfloat16 dot products: %s)", path, dots)
    return loaded


@functools.cache
def bfloat16_dots() -> bool:
    """Whether bfloat16 rows take the bfloat16 tiles (the library, and AVX512_BF16)."""
    lib = library()
    return lib is not None and bool(lib.imesh_woq_dot_available())


def rows_for(dtype: torch.dtype, beside_pytorch_kernel: bool) -> int:
    """How many rows of x a layer computing in dtype sends to woq_matmul (the comment on MAX_ROWS
    says why); beside_pytorch_kernel: per-channel INT8, which PyTorch's kernel also takes."""
    if dtype == torch.bfloat16 and bfloat16_dots():
        return MAX_DOT_ROWS
    return ROWS_BESIDE_PYTORCH_KERNEL if beside_pytorch_kernel else MAX_ROWS


def takes(weight: torch.Tensor, dtype: torch.dtype, in_features: int, group: int) -> bool:
    """Whether woq_matmul computes a layer of these weights (its compute dtype, inputs and scale
    group): INT8 or FP8 on a CPU, bfloat16 or float32 activations, inputs (and groups narrower
    than a row) in multiples of 32, and the library at hand."""
    return (weight.device.type == "cpu" and weight.dtype in _FORMATS and dtype in _DTYPES and in_features % 32 == 0
            and (group >= in_features or group % 32 == 0) and library() is not None)


def woq_matmul(rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
               group: int, row_div: int, dot: bool | None = None) -> torch.Tensor:
    """rows [M, K] (any count; the compute dtype) times weight [N, K]^T, dequantized as
    scale[n // row_div, k // group] x weight[n, k] (+ offset[n, k // group]): [M, N] in rows'
    dtype. dot: the bfloat16 tiles (default: for bfloat16 rows where the CPU has them; False
    computes bfloat16 rows in float32 as float32 rows are)."""
    lib = library()
    assert lib is not None, "woq_matmul called where takes() said no"
    # the kernel reads raw row-major buffers (the layer holds them so: contiguous() is a no-op)
    rows, weight, scale = rows.contiguous(), weight.contiguous(), scale.contiguous()
    offset = None if offset is None else offset.contiguous()
    m, k = rows.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=rows.dtype)
    if dot is None:
        dot = rows.dtype == torch.bfloat16 and bfloat16_dots()
    status = lib.imesh_woq_gemm(rows.data_ptr(), weight.data_ptr(), _FORMATS[weight.dtype], scale.data_ptr(),
                                None if offset is None else offset.data_ptr(), out.data_ptr(), m, n, k, group, row_div,
                                _DTYPES[rows.dtype], int(dot), torch.get_num_threads())
    if status:
        raise RuntimeError(f"imesh_woq_gemm refused a [{m}, {k}] x [{n}, {k}] product (status {status})")
    return out


def quantize(weight: torch.Tensor, kind: str, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """quantized_values' (modeling/quantized.py) values and float32 scales [n, k / group] of a CPU
    weight [n, k] (bfloat16 or float32), the same bits in one pass (native/quantize.c); None where
    the kernel does not take it (no library, another dtype or device, a group not a multiple of 16)
    or a group holds an infinity or NaN: PyTorch's path computes those."""
    lib = library()
    if lib is None or weight.device.type != "cpu" or weight.dtype not in _DTYPES or weight.dim() != 2:
        return None
    weight = weight.contiguous()
    n, k = weight.shape
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn if kind == "float" else torch.int8)
    scale = torch.empty(n, k // group if group and k % group == 0 else 0)
    status = lib.imesh_quantize(weight.data_ptr(), _DTYPES[weight.dtype], n, k, group, int(kind == "float"), bits,
                                q.data_ptr(), scale.data_ptr(), torch.get_num_threads())
    return None if status else (q, scale)


# Rows a native RMSNorm takes: decode steps and verify windows; longer prompt chunks keep PyTorch's
# vectorised, threaded kernel, where the dispatch is paid once for many rows.
RMS_NORM_MAX_ROWS = 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """transformers' float32 RMSNorm of x's rows in one native call, or None where it does not take
    x (not float32 on a CPU, a width not a multiple of 16, more than RMS_NORM_MAX_ROWS rows, no
    library): the caller computes it as before."""
    lib = library()
    n = weight.shape[0]
    float32 = x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu"
    if lib is None or not float32 or n % 16 or x.numel() > RMS_NORM_MAX_ROWS * n or not x.is_contiguous() \
            or not weight.is_contiguous():
        return None
    out = torch.empty_like(x)
    lib.imesh_rms_norm_f32(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // n, n, eps)
    return out


# Head widths the native attention takes: multiples of 16 (its vectors) up to 256 (its registers).
PAGED_ATTENTION_MAX_HEAD_DIM = 256


def takes_paged_attention(kv_dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether paged_attention computes a stage's attention: a float32 KV pool on a CPU, a head width
    it takes, and the library at hand."""
    return (kv_dtype == torch.float32 and device.type == "cpu" and head_dim % 16 == 0
            and head_dim <= PAGED_ATTENTION_MAX_HEAD_DIM and library() is not None)


def paged_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layer: torch.Tensor,
                    block_tokens: int, tables: torch.Tensor, frames: torch.Tensor, scale: float,
                    window: int | None = None) -> torch.Tensor:
    """Every frame's new keys and values [1, rows, kv_heads, D] written into its slots of the pool's layer
    [2, kv_heads, slots, D] (float32, blocks of block_tokens slots), then its queries [1, rows, heads, D]
    (a pass's rows, packed; any dtype) over its keys and values, causal (within the layer's sliding
    window, if any: positions.attention_mask's), as kv_pool.PagedFrames describes them:
    [1, rows, heads x D] float32, what the output projection takes."""
    lib = library()
    assert lib is not None, "paged_attention called where takes_paged_attention() said no"
    _, rows, heads, dim = queries.shape
    queries, keys, values = _rows_of(queries), _rows_of(keys), _rows_of(values)
    out = torch.empty(1, rows, heads * dim)
    status = lib.imesh_paged_attention_f32(queries.data_ptr(), queries.stride(1), keys.data_ptr(), keys.stride(1),
                                           values.data_ptr(), values.stride(1), layer.data_ptr(), layer.shape[2],
                                           tables.data_ptr(), frames.data_ptr(), frames.shape[0], heads,
                                           layer.shape[1], dim, block_tokens, scale, window or 0, out.data_ptr(),
                                           torch.get_num_threads())
    if status:
        raise RuntimeError(f"imesh_paged_attention_f32 refused {heads} heads over {layer.shape[1]} of {dim} "
                           f"(status {status})")
    return out


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    """x [1, rows, heads, D] in float32 with each row's heads side by side (the kernel steps through
    rows only): a view of a fused projection as it is, anything else made so."""
    if x.dtype != torch.float32:
        x = x.float()
    stride = x.stride()
    return x if stride[3] == 1 and stride[2] == x.shape[3] else x.contiguous()
