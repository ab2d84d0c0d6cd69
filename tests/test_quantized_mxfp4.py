"""gpt-oss's MXFP4 experts served as stage slices, kept in MXFP4 (modeling/mxfp4.py).

The checkpoint is a tiny gpt-oss (experts, attention sinks, alternating sliding windows) whose
experts are written as gpt-oss's release stores them: gate_up_proj_blocks / down_proj_blocks U8
[experts, out, in/32, 16] and _scales U8 [experts, out, in/32] (OCP MX: a power-of-two scale per 32
values, e2m1 values rounded to nearest), biases in bfloat16, and its quantization_config as
gpt-oss's config.json has it. (transformers quantizes to MXFP4 only with its Triton kernels, so
the values are rounded here.) The reference is transformers' own GptOss forward in float32 with
the experts dequantized by transformers' reader (integrations.mxfp4.convert_moe_packed_tensors,
what from_pretrained does on a CPU; from_pretrained itself needs accelerate, not installed here).
The dequantized weights are exact in float32 on both sides, so greedy tokens must be equal and
logprobs within 1e-4 or twice the reference's own float32 noise."""

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
from inferencemesh.modeling.mxfp4 import Mxfp4Experts
from inferencemesh.planner import PlanInputs

sys.path.insert(0, str(Path(__file__).parent))
from test_quantized_awq_gptq import SPLITS, greedy_against, stage_bytes  # noqa: E402

FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
GPT_OSS_CONFIG = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                             "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}


def _mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' [experts, in, out] weight -> (blocks [experts, out, in/32, 16], scales [experts, out, in/32])."""
    w = weight.float().transpose(1, 2)
    groups = w.reshape(*w.shape[:2], -1, 32)
    exponent = torch.floor(torch.log2(groups.abs().amax(-1).clamp(min=2.0 ** -100))) - 2  # e2m1's largest: 1.5 x 2^2
    codes = (groups / torch.exp2(exponent)[..., None])[..., None].sub(FP4_VALUES).abs().argmin(-1).to(torch.uint8)
    return (codes[..., 0::2] | codes[..., 1::2] << 4).contiguous(), (exponent + 127).to(torch.uint8).contiguous()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mxfp4") / "gpt-oss"
    config = AutoConfig.for_model(
        "gpt_oss", vocab_size=320, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=512, initializer_range=0.5,
        tie_word_embeddings=False)
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            state[name + "_blocks"], state[name + "_scales"] = _mxfp4(tensor)
        else:
            state[name] = tensor.contiguous()
    path.mkdir()
    save_file(state, path / "model.safetensors")
    config.dtype = torch.bfloat16
    config.save_pretrained(path)
    full = json.loads((path / "config.json").read_text())
    full["quantization_config"] = GPT_OSS_CONFIG
    (path / "config.json").write_text(json.dumps(full))
    return path


def reference(path: Path) -> torch.nn.Module:
    """transformers' GptOss in float32, its experts dequantized by transformers' MXFP4 reader."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config = AutoConfig.from_pretrained(path)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = load_file(path / "model.safetensors")
    model.load_state_dict({k: v.float() for k, v in state.items() if v.is_floating_point()}, strict=False)
    for name in [k.removesuffix("_blocks") for k in state if k.endswith("_blocks")]:
        module, _, proj = name.rpartition(".")
        dequantized = convert_moe_packed_tensors(state[name + "_blocks"], state[name + "_scales"], dtype=torch.float32)
        getattr(model.get_submodule(module), proj).data = dequantized
    return model


def test_greedy_tokens_at_1_2_stages_equal_transformers_dequantized_forward(checkpoint):
    stage = load_stage(checkpoint, 0, 1, dtype="float32", device="cpu")
    assert isinstance(stage.layers[0].mlp.experts, Mxfp4Experts)
    greedy_against(reference(checkpoint), checkpoint, seed=6, splits=SPLITS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_planned_bytes_are_what_each_stage_allocates(checkpoint, dtype):
    inputs = PlanInputs.from_checkpoint(read_local(checkpoint), dtype=dtype)
    for a, b in zip(SPLITS[2], SPLITS[2][1:], strict=False):
        stage = load_stage(checkpoint, a, b, dtype=dtype, device="cpu")
        assert stage_bytes(stage) == inputs.stage_bytes(a, b, 4)[0], (dtype, a, b)
    experts = stage.layers[0].mlp.experts  # 17/32 of a byte a weight (half a byte, and a scale byte per 32)
    assert sum(t.nbytes for t in experts.buffers()) == 4 * (128 * 64 + 64 * 64) * 17 // 32


@pytest.mark.parametrize("key,change,words", [
    ("model.layers.1.mlp.experts.down_proj_scales", lambda t: t[:, :32], "down_proj_scales is U8 [4, 32, 2], but"),
    ("model.layers.1.mlp.experts.gate_up_proj_blocks", lambda t: t.view(torch.int8), "gate_up_proj_blocks is I8"),
    ("model.layers.1.self_attn.q_proj.weight_blocks", lambda t: t.clone(), "only MoE experts"),
])
def test_malformed_blocks_and_scales_are_one_line_errors(checkpoint, tmp_path, key, change, words):
    path = Path(shutil.copytree(checkpoint, tmp_path / "broken"))
    state = load_file(path / "model.safetensors")
    source = key if key in state else "model.layers.1.mlp.experts.down_proj_blocks"
    state[key] = change(state[source]).contiguous()
    save_file(state, path / "model.safetensors")
    with pytest.raises(CheckpointError) as refused:
        read_local(path)
    assert words in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
