"""Quantized projections joined into one layer (modeling/quantized_fused.py): the joined layer
computes each part's outputs, side by side, on every path (CPU kernels for a few rows, dequantized
tiles for many), holds the same bytes, and layouts that cannot be joined are left apart. Through a
stage: a quantized lean layer's q/k/v and gate/up are one layer each, and it still computes what
transformers' layer over the same modules does."""

from __future__ import annotations

import pytest
import torch
from test_quantized_compute import FORMATS, _made

from inferencemesh.checkpoint.quantization import WeightQuant
from inferencemesh.modeling import quantized
from inferencemesh.modeling.quantized import QuantizedLinear
from inferencemesh.modeling.quantized_fused import fused_outputs

CPU = torch.device("cpu")
JOINED = ["int8-channel", "int8-group", "int4-group", "fp8-channel", "fp8-block"]


def _parts(name: str, dtype: torch.dtype, sizes: tuple[int, ...]) -> list[QuantizedLinear]:
    quant, _, k = FORMATS[name]
    parts = []
    for seed, n in enumerate(sizes):
        q, scale = _made(quant, n, k, seed=seed)
        bias = torch.randn(n, generator=torch.Generator().manual_seed(seed))
        parts.append(QuantizedLinear(quant, q, scale, None, bias, dtype, CPU))
    return parts


@pytest.mark.parametrize("name", JOINED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_joined_layer_computes_its_parts_side_by_side(name: str, dtype: torch.dtype,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quantized, "TILE_ELEMENTS", 70 * 128)  # several tiles a layer
    parts = _parts(name, dtype, (128, 64, 64))  # queries, keys, values: whole 64-row units
    fused = fused_outputs(parts)
    assert fused is not None and fused.path == parts[0].path and fused.out_features == 256
    assert fused.nbytes + fused.bias.numel() * fused.bias.element_size() == sum(
        p.nbytes + p.bias.numel() * p.bias.element_size() for p in parts)
    k = parts[0].in_features
    for rows in (1, quantized.INT8_KERNEL_ROWS, quantized.INT4_KERNEL_ROWS + 1, 80):
        x = torch.randn(1, rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
        want = torch.cat([p(x) for p in parts], dim=-1)
        got = fused(x)
        # the same weights and kernels, but a GEMM may block (and so sum) a wider matrix otherwise:
        # float32's rounding, or a 16-bit output's last bit
        tolerance = 1e-6 if dtype == torch.float32 else 2 ** -7
        assert float((got.float() - want.float()).abs().max() / want.float().abs().max()) <= tolerance, rows
    for part in parts:  # the parts are untouched: a joined layer is a new one
        assert part.out_features in (128, 64)


def test_layouts_that_cannot_be_joined_are_left_apart() -> None:
    # per-tensor scales: one number a part
    assert fused_outputs(_parts("fp8-tensor", torch.bfloat16, (128, 64))) is None
    # the CPU INT4 kernel's blocks are 64 rows: a part of 96 would split one
    assert fused_outputs(_parts("int4-group", torch.bfloat16, (128, 96))) is None
    # different formats, or a single layer
    int8, fp8 = _parts("int8-channel", torch.bfloat16, (64,)), _parts("fp8-channel", torch.bfloat16, (64,))
    assert fused_outputs(int8 + fp8) is None and fused_outputs(int8) is None
    quant = WeightQuant("int", 8, "channel")
    q, scale = _made(quant, 64, FORMATS["int8-channel"][2])
    unbiased = QuantizedLinear(quant, q, scale, None, None, torch.bfloat16, CPU)
    assert fused_outputs(int8 + [unbiased]) is None  # one with a bias, one without


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
def test_a_quantized_lean_layer_joins_its_projections(tmp_path, quantization: str) -> None:
    from tiny_models import write_tiny_model

    from inferencemesh.modeling.runtime import StageRuntime

    # every projection a whole number of the CPU INT4 kernel's 64-row blocks
    path = write_tiny_model(tmp_path / "llama", "llama", hidden_size=128, intermediate_size=256,
                            num_attention_heads=4, num_key_value_heads=2, tokenizer=False)
    lean = StageRuntime(path, 0, 4, dtype="bfloat16", device="cpu", max_context=64, quantization=quantization)
    plain = StageRuntime(path, 0, 4, dtype="bfloat16", device="cpu", max_context=64, quantization=quantization,
                         lean=False)
    layer = lean._lean[0]
    assert layer is not None
    assert type(layer.qkv.fused) is QuantizedLinear and type(layer.gate_up.fused) is QuantizedLinear
    attn = lean._layers[0].self_attn
    assert attn.k_proj.fused is layer.qkv.fused  # the layer's own modules are slices of it
    ids = torch.tensor([5, 9, 2, 7])
    with torch.inference_mode():
        got = lean.forward(lean.new_session(), 0, token_ids=ids)
        want = plain.forward(plain.new_session(), 0, token_ids=ids)
    assert float((got.float() - want.float()).abs().max() / want.float().abs().max()) < 2 ** -6
