"""QuantizedLinear's compute paths against the weights they hold: the CPU kernels for a few rows,
the kernel-layout INT4 blocks dequantized for many (prefill), per-channel scales applied to the
product's columns, and the FP8 path CUDA takes (torch._scaled_mm, which also runs on a CPU).

The reference is each format's dequantization written out here in float32 (q x scale, per
channel, group, tensor or block), multiplied in float32 with the same (bfloat16-rounded) inputs.
bfloat16 compute rounds each dequantized weight and each output to bfloat16 (2^-9 relative), and
sums in another order: outputs agree within 1% of the largest; float32 compute within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from inferencemesh.checkpoint.quantization import WeightQuant
from inferencemesh.modeling import native_kernels, quantized
from inferencemesh.modeling.quantized import QuantizedLinear

CPU = torch.device("cpu")
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def _made(quant: WeightQuant, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantized values [n, k] (int8 holding INT4's [-8, 7], or e4m3) and scales as quant.scale_shape."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = quant.scale_shape(n, k)
    scale = torch.rand(rows, cols, generator=gen) * 1e-3 + 1e-4
    if quant.kind == "float":
        return (torch.randn(n, k, generator=gen) * 100).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale
    top = 2 ** (quant.bits - 1)
    return torch.randint(-top, top, (n, k), generator=gen, dtype=torch.int8), scale


def _reference(quant: WeightQuant, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    rows, cols = scale.shape
    b0, b1 = quant.block if quant.strategy == "block" else (-(-n // rows), -(-k // cols))
    return q.float() * scale.repeat_interleave(b0, 0)[:n].repeat_interleave(b1, 1)[:, :k]


FORMATS = {
    "int8-channel": (WeightQuant("int", 8, "channel"), 192, 256),
    "int8-group": (WeightQuant("int", 8, "group", 64), 192, 256),
    "int4-group": (WeightQuant("int", 4, "group", 64), 192, 256),
    "int4-ragged": (WeightQuant("int", 4, "group", 32), 96, 128),  # rows no kernel block divides
    "fp8-channel": (WeightQuant("float", 8, "channel"), 192, 256),
    "fp8-tensor": (WeightQuant("float", 8, "tensor"), 192, 256),
    "fp8-block": (WeightQuant("float", 8, "block", block=(64, 128)), 160, 256),  # a partial last block
}


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_path_computes_the_weight_it_holds(name: str, dtype: torch.dtype,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A few rows to many, across the kernel / dequantized-tile switches, a few tiles a
    layer (a last one partial)."""
    monkeypatch.setattr(quantized, "TILE_ELEMENTS", 70 * 128)
    quant, n, k = FORMATS[name]
    q, scale = _made(quant, n, k)
    layer = QuantizedLinear(quant, q, scale.clone(), None, None, dtype, CPU)
    assert len(layer._tiles()) > 1 or layer.kernel_rows > n  # (a ragged INT4 layer: the kernel's, always)
    weight = _reference(quant, q, scale.to(dtype).float())  # the scales as the layer holds them
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    counts = {1, native_kernels.ROWS_BESIDE_PYTORCH_KERNEL + 1, native_kernels.MAX_ROWS, native_kernels.MAX_DOT_ROWS,
              native_kernels.MAX_DOT_ROWS + 1, quantized.INT8_KERNEL_ROWS,
              quantized.INT8_KERNEL_ROWS + 1, quantized.INT4_KERNEL_ROWS, quantized.INT4_KERNEL_ROWS + 1, 80}
    for rows in sorted(counts):
        x = torch.randn(2, rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
        want = x.float() @ weight.t()
        got = layer(x)
        assert got.shape == (2, rows, n) and got.dtype == dtype
        err = float((got.float() - want).abs().max() / want.abs().max())
        assert err <= tolerance, (name, dtype, rows, layer.path, err)
    dequantized = layer.dequantized().float()
    assert torch.allclose(dequantized, weight, rtol=2 ** -8 if dtype == torch.bfloat16 else 1e-6, atol=0), name


def test_int4_blocks_read_from_the_kernel_layout_are_the_kernel_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill rows dequantize the CPU kernel's own packed blocks: exactly the weights the kernel
    multiplies (its product with the identity), so the switch between them changes nothing but
    rounding of the sums."""
    quant, n, k = WeightQuant("int", 4, "group", 128), 256, 512
    q, scale = _made(quant, n, k, seed=1)
    zero = torch.randint(-2, 3, scale.shape, generator=torch.Generator().manual_seed(2))  # asymmetric too
    layer = QuantizedLinear(quant, q, scale, zero, None, torch.bfloat16, CPU)
    monkeypatch.setattr(quantized, "TILE_ELEMENTS", 100 * k)  # blocks of 64 rows: tiles of 64
    assert layer.path == "int4_cpu" and layer.kernel_rows == quantized.INT4_KERNEL_ROWS
    eye = torch.eye(k, dtype=torch.bfloat16)
    kernel = torch._weight_int4pack_mm_for_cpu(eye, layer.weight, layer.group_size, layer.scale_zeros).t()
    tiles = layer._tiles()
    assert len(tiles) > 1 and all((b - a) % quantized.INT4_BLOCK == 0 for a, b in tiles)
    assert torch.equal(torch.cat([layer._int4_cpu_tile(a, b, torch.bfloat16).clone() for a, b in tiles]), kernel)
    x = torch.randn(quantized.INT4_KERNEL_ROWS + 1, k).bfloat16()
    by_kernel = torch._weight_int4pack_mm_for_cpu(x, layer.weight, layer.group_size, layer.scale_zeros)
    torch.testing.assert_close(layer(x), by_kernel, rtol=2 ** -7, atol=2e-3 * float(by_kernel.abs().max()))


def test_dequantizing_holds_one_tile_per_thread_never_a_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many rows through a layer larger than a tile: the scratch buffers stay a tile's size, and the
    layer's own bytes (what the plan counts) do not change."""
    monkeypatch.setattr(quantized, "TILE_ELEMENTS", 256 * 1024)
    quant, n, k = WeightQuant("float", 8, "channel"), 2048, 512
    q, scale = _made(quant, n, k)
    layer = QuantizedLinear(quant, q, scale, None, None, torch.bfloat16, CPU)
    held = layer.nbytes
    quantized._local.__dict__.pop("buffers", None)  # this thread's scratch, from nothing
    assert len(layer._tiles()) > 1
    layer(torch.randn(64, k).bfloat16())
    layer(torch.randn(1, k).bfloat16())
    assert layer.nbytes == held == n * k + n * 2
    largest = max(b.numel() for b in quantized._local.buffers.values())
    assert largest <= quantized.TILE_ELEMENTS < n * k


def test_fp8_on_cuda_takes_scaled_mm_with_activations_quantized_per_row() -> None:
    """The path an H100 takes (torch._scaled_mm, e4m3 activations scaled per row), run through
    torch's CPU implementation of the same op: within e4m3's rounding of the activations (2^-4
    relative per element) of the float32 product."""
    quant, n, k = WeightQuant("float", 8, "channel"), 64, 128
    q, scale = _made(quant, n, k)
    layer = QuantizedLinear(quant, q, scale, None, None, torch.bfloat16, CPU)
    assert layer.path == "fp8_dequant"  # on a CPU; "scaled_mm" is chosen for a CUDA device
    x = torch.randn(3, k).bfloat16()
    want = x.float() @ _reference(quant, q, scale.bfloat16().float()).t()
    got = layer._scaled_mm(x)
    assert got.dtype == torch.bfloat16
    assert float((got.float() - want).abs().max()) <= 0.05 * float(want.abs().max())
