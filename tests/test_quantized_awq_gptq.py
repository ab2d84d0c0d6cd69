"""AWQ (GEMM) and GPTQ checkpoints served as stage slices, kept quantized.

Neither AutoAWQ nor GPTQModel runs with this torch (GPTQModel needs torch >= 2.14; AutoAWQ and
AutoGPTQ install in a separate venv but cannot load a model with transformers 5), so the
checkpoints are written here by their specification, as those tools write them: AutoAWQ's
WQLinear_GEMM.from_linear (its pseudo_quantize_tensor's scales and zeros, values packed 8 a word
in the order 0 2 4 6 1 3 5 7 along the outputs, scales in float16) and config
(AwqConfig.to_transformers_dict); GPTQModel's QuantLinear packing (values along the inputs,
zeros along the outputs, the classic format's zeros minus one on the whole word: its
convert_gptq_v2_to_v1_format) and config (QuantizeConfig.to_dict), with and without desc_act, sym
and asym, 4 and 8 bits, gptq and gptq_v2. Asymmetric checkpoints carry zero points of 0 and of
the maximum on purpose: stored minus one, a 0 borrows from its neighbour, which a reader that adds
the one back value by value (rather than word by word, as GPTQModel does) gets wrong.

The reference is transformers' forward (float32) with each layer's weight (q - z) x s computed
from the integers the writer packed, never from the packed words: the stages must unpack them
to the same values. Both sides compute in float32 on the same weights, so greedy tokens must be
equal and logprobs agree within 1e-4 or twice the reference's own float32 noise (its step-by-step
logprobs against one forward), as in test_quantized_formats."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from inferencemesh.checkpoint.errors import CheckpointError
from inferencemesh.checkpoint.read import read_local
from inferencemesh.modeling.loader import load_stage
from inferencemesh.modeling.quantized import QuantizedLinear
from inferencemesh.modeling.quantized_formats import PermutedLinear
from inferencemesh.planner import PlanInputs

sys.path.insert(0, str(Path(__file__).parent))
from quantized_reference import greedy_against  # noqa: E402
from tiny_models import write_tiny_model  # noqa: E402

SPLITS = {1: [0, 4], 2: [0, 2, 4]}
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's order_map: the nibble each logical column goes to
# name -> (method, bits, group size, desc_act, sym, checkpoint format)
FORMATS = {
    "awq": ("awq", 4, 32, False, False, "gemm"),
    "gptq-sym": ("gptq", 4, 32, False, True, "gptq"),
    "gptq-asym-act-order": ("gptq", 4, 32, True, False, "gptq"),
    "gptq-v2-asym-act-order": ("gptq", 4, 32, True, False, "gptq_v2"),
    "gptq-int8-asym": ("gptq", 8, 32, False, False, "gptq"),
    "gptq-int8-sym-act-order": ("gptq", 8, 32, True, True, "gptq"),
    "gptq-channel": ("gptq", 4, -1, False, True, "gptq"),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("q") / "base", "llama", num_layers=4, shards=1,
                            dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("awq-gptq")


def _pack(values: torch.Tensor, bits: int, dim: int, order: list[int] | None = None) -> torch.Tensor:
    """Unsigned values packed 32/bits to an int32 word along dim (0: GPTQ's qweight, along the
    inputs; 1: zeros and AWQ, along the outputs), low bits first; AWQ's word holds its logical
    columns in `order` (nibble i: column order[i])."""
    per, v = 32 // bits, values.to(torch.int64)
    v = v.reshape(-1, per, v.shape[1]).transpose(1, 2) if dim == 0 else v.reshape(v.shape[0], -1, per)
    if order is not None:
        v = v[..., order]
    words = (v << (bits * torch.arange(per))).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32).contiguous()


def _quantize(w: torch.Tensor, bits: int, group: int, sym: bool, order: torch.Tensor):
    """GPTQ's / AutoAWQ's min-max quantizer over groups of inputs taken in `order`: (values [in, out]
    in the checkpoint's input order, zeros [groups, out], scales [groups, out] float16, g_idx [in])."""
    out_f, in_f = w.shape
    group = in_f if group == -1 else group
    maxq = 2 ** bits - 1
    g = w.float()[:, order].reshape(out_f, -1, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    if sym:
        hi = torch.maximum(-lo, hi)
        lo = -hi
    scale = ((hi - lo) / maxq).clamp(min=1e-5).half().float()
    zero = torch.full_like(scale, (maxq + 1) // 2) if sym else torch.round(-lo / scale).clamp(0, maxq)
    if not sym:  # the extremes, on purpose: a zero of 0 borrows from its neighbour in the classic format
        zero[::5, 0] = 0
        zero[1::7, -1] = maxq
    q = torch.clamp(torch.round(g / scale[..., None]) + zero[..., None], 0, maxq).reshape(out_f, in_f)
    values = torch.empty_like(q)
    values[:, order] = q
    g_idx = torch.empty(in_f, dtype=torch.int32)
    g_idx[order] = torch.arange(in_f, dtype=torch.int32) // group
    return values.t().to(torch.int64), zero.t().to(torch.int64), scale.t().half().contiguous(), g_idx


def write_quantized(base: Path, root: Path, name: str) -> Path:
    method, bits, group, desc_act, sym, fmt = FORMATS[name]
    path = root / name
    if path.exists():
        return path
    state = {k: v for shard in sorted(base.glob("*.safetensors")) for k, v in load_file(shard).items()}
    out: dict[str, torch.Tensor] = {}
    generator = torch.Generator().manual_seed(7)
    for key, tensor in state.items():
        if not (key.startswith("model.layers.") and key.endswith("proj.weight")):
            out[key] = tensor
            continue
        module = key.removesuffix(".weight")
        in_f = tensor.shape[1]
        order = torch.randperm(in_f, generator=generator) if desc_act else torch.arange(in_f)
        values, zeros, scales, g_idx = _quantize(tensor, bits, group, sym, order)
        out[f"{module}.scales"] = scales
        if method == "awq":
            out[f"{module}.qweight"] = _pack(values, 4, 1, AWQ_ORDER)
            out[f"{module}.qzeros"] = _pack(zeros, 4, 1, AWQ_ORDER)
        else:
            out[f"{module}.qweight"] = _pack(values, bits, 0)
            packed = _pack(zeros, bits, 1).to(torch.int64)
            if fmt == "gptq":  # convert_gptq_v2_to_v1_format: every zero minus one, on the whole word
                packed = (packed - {4: 0x11111111, 8: 0x01010101}[bits]) & 0xFFFFFFFF
            out[f"{module}.qzeros"] = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)
            out[f"{module}.g_idx"] = g_idx
        out[f"{module}.reference"] = ((values - zeros[g_idx.long()]) *
                                      scales.float()[g_idx.long()]).t().contiguous()
    path.mkdir()
    save_file({k: v for k, v in out.items() if not k.endswith(".reference")}, path / "model.safetensors")
    torch.save({k: v for k, v in out.items() if k.endswith(".reference")}, path / "reference.pt")
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = _config(method, bits, group, desc_act, sym, fmt)
    (path / "config.json").write_text(json.dumps(config))
    return path


def _config(method: str, bits: int, group: int, desc_act: bool, sym: bool, fmt: str) -> dict:
    """quantization_config as AutoAWQ (AwqConfig.to_transformers_dict) and GPTQModel
    (QuantizeConfig.to_dict, version 7) write it."""
    if method == "awq":
        return {"quant_method": "awq", "zero_point": True, "group_size": group, "bits": bits, "version": fmt,
                "modules_to_not_convert": None}
    return {"bits": bits, "group_size": group, "desc_act": desc_act, "lm_head": False, "method": "gptq",
            "quant_method": "gptq", "format": fmt, "checkpoint_format": fmt, "pack_dtype": "int32", "sym": sym,
            "meta": {"quantizer": ["gptqmodel:7.7.0"], "uri": "https://github.com/modelcloud/gptqmodel",
                     "damp_percent": 0.05, "damp_auto_increment": 0.01, "static_groups": False,
                     "true_sequential": True, "mse": 0.0, "act_group_aware": False}}


def reference(path: Path) -> torch.nn.Module:
    """transformers' float32 forward with every quantized layer's weight (q - z) x s from the
    writer's own integers."""
    config = AutoConfig.from_pretrained(path)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = load_file(path / "model.safetensors")
    model.load_state_dict({k: v.float() for k, v in state.items() if v.is_floating_point() and "." in k
                           and not k.endswith(".scales")}, strict=False)
    for key, weight in torch.load(path / "reference.pt").items():
        model.get_submodule(key.removesuffix(".reference")).weight.data = weight
    return model


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_greedy_tokens_at_1_2_stages_equal_the_dequantized_reference(base, root, name):
    path = write_quantized(base, root, name)
    stage = load_stage(path, 0, 1, dtype="float32", device="cpu")
    down = stage.layers[0].mlp.down_proj
    assert isinstance(down, PermutedLinear if FORMATS[name][3] else QuantizedLinear), (name, down)
    greedy_against(reference(path), path, seed=5, splits=SPLITS)


def stage_bytes(stage) -> int:
    held = {id(t): t.numel() * t.element_size() for m in (stage.embed, stage.layers, stage.norm, stage.lm_head)
            if m is not None for t in [*m.parameters(), *m.buffers()]}
    return sum(held.values())


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_planned_bytes_are_what_each_stage_allocates(base, root, name, dtype):
    path = write_quantized(base, root, name)
    inputs = PlanInputs.from_checkpoint(read_local(path), dtype=dtype)
    plain = PlanInputs.from_checkpoint(read_local(base), dtype=dtype)
    assert sum(inputs.layer_bytes) < 0.75 * sum(plain.layer_bytes), name  # fewer bytes: fewer stages
    for a, b in zip(SPLITS[2], SPLITS[2][1:], strict=False):
        stage = load_stage(path, a, b, dtype=dtype, device="cpu")
        assert stage_bytes(stage) == inputs.stage_bytes(a, b, 4)[0], (name, dtype, a, b)


def _broken(base: Path, root: Path, tmp_path: Path, name: str, key: str, change) -> Path:
    path = Path(shutil.copytree(write_quantized(base, root, name), tmp_path / f"{name}-{key.rsplit('.', 1)[1]}"))
    state = load_file(path / "model.safetensors")
    state[key] = change(state[key]).contiguous()
    save_file(state, path / "model.safetensors")
    return path


@pytest.mark.parametrize("name,suffix,change,words", [
    ("awq", "scales", lambda t: t[:, :64], "scales is F16 [2, 64], but an AWQ int4 weight of 128x64 in 2 groups"),
    ("awq", "qzeros", lambda t: t[:1], "qzeros is I32 [1, 16], but an AWQ int4 weight"),
    ("gptq-sym", "scales", lambda t: t.float(), None),  # float32 scales are served: no error
    ("gptq-sym", "qzeros", lambda t: t[:, :8], "qzeros is I32 [2, 8], but a GPTQ int4 weight of 128x64"),
    ("gptq-asym-act-order", "g_idx", lambda t: t[:32], "g_idx is I32 [32], but a GPTQ int4 weight"),
])
def test_malformed_scales_and_zeros_are_one_line_errors_at_plan_time(base, root, tmp_path, name, suffix, change,
                                                                     words):
    path = _broken(base, root, tmp_path, name, f"model.layers.1.mlp.up_proj.{suffix}", change)
    if words is None:
        read_local(path)
        return
    with pytest.raises(CheckpointError) as refused:
        read_local(path)
    assert words in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


@pytest.mark.parametrize("name,change,words", [
    ("gptq-asym-act-order", lambda t: t.clamp(max=0), "g_idx is not 2 groups of 32 inputs"),
    ("gptq-sym", lambda t: t.flip(0), "g_idx is out of order, but desc_act is false"),
])
def test_a_bad_g_idx_is_a_one_line_error_when_the_stage_loads(base, root, tmp_path, name, change, words):
    path = _broken(base, root, tmp_path, name, "model.layers.1.mlp.up_proj.g_idx", change)
    with pytest.raises(CheckpointError) as refused:
        load_stage(path, 0, 2, dtype="float32", device="cpu")
    assert words in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_sym_with_zero_points_off_the_middle_is_refused(base, root, tmp_path):
    path = _broken(base, root, tmp_path, "gptq-sym", "model.layers.0.self_attn.q_proj.qzeros", lambda t: t + 1)
    with pytest.raises(CheckpointError, match="sym is true, but its qzeros are not all 8"):
        load_stage(path, 0, 1, dtype="float32", device="cpu")


@pytest.mark.parametrize("config,words", [
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv", "zero_point": True}, "GEMM"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": False}, "zero points"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 32, "checkpoint_format": "gptq"}, "4 and 8 bits"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"}, "formats gptq and gptq_v2"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "dynamic": {"-:.*down": {}}}, "dynamic"),
    ({"quant_method": "gptq", "bits": 4, "group_size": "x"}, "malformed"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "no quantized tensors (qweight)"),  # 16-bit tensors
    ({"quant_method": "mxfp4"}, "no quantized tensors (experts' _blocks)"),
])
def test_variants_not_served_and_configs_without_their_tensors_are_refused_in_one_line(base, tmp_path, config, words):
    path = Path(shutil.copytree(base, tmp_path / "m"))
    full = json.loads((path / "config.json").read_text())
    full["quantization_config"] = config
    (path / "config.json").write_text(json.dumps(full))
    with pytest.raises(CheckpointError) as refused:
        read_local(path)
    line = str(refused.value)
    assert "\n" not in line and words in line and config["quant_method"] in line, line


@pytest.mark.parametrize("name,path_name", [("awq", "int4_cpu"), ("gptq-asym-act-order", "int4_cpu"),
                                            ("gptq-int8-sym-act-order", "int8")])
def test_bfloat16_takes_the_cpu_kernels_through_the_permutation(base, root, name, path_name):
    """bfloat16 compute runs the int4 kernel (and int8's for decode rows) on the converted values,
    behind the act-order permutation: within bfloat16's rounding of the float32 product with the
    writer's own weight."""
    path = write_quantized(base, root, name)
    stage = load_stage(path, 0, 1, dtype="bfloat16", device="cpu")
    layer = stage.layers[0].mlp.up_proj
    linear = layer.linear if isinstance(layer, PermutedLinear) else layer
    assert isinstance(linear, QuantizedLinear) and linear.path == path_name, (name, linear)
    weight = torch.load(path / "reference.pt")["model.layers.0.mlp.up_proj.reference"]
    assert (layer.dequantized().float() - weight).abs().max() <= 0.01 * weight.abs().max(), name  # input order
    for rows in (1, 64):
        x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))
        want = x.bfloat16().float() @ weight.t()
        got = layer(x.bfloat16()).float()
        assert (got - want).abs().max() <= 0.02 * want.abs().max(), (name, rows)
