"""Quantized checkpoints served as stage slices, kept quantized: compressed-tensors W4A16 (symmetric
and not), W8A16 grouped, INT8 per channel (int-quantized; once with the LM head quantized too),
FP8_DYNAMIC's per-channel and FP8 per tensor weights, each written by compressed-tensors' own
compressor (ModelCompressor) from the tests' tiny Llama; and transformers' `fp8` block-wise
format, written by its specification (weight F8_E4M3, weight_scale_inv per block; transformers
cannot load it on a CPU).

The reference is the same checkpoint with its linear layers dequantized by the format's owner
(compressed-tensors' decompress; the fp8 spec's q x scale_inv), in float32 as the stages compute
here, through transformers' own forward. transformers 5.24 with compressed-tensors 0.20 cannot
load these checkpoints itself (its loader rejects the packed zero points and runs FP8 weights
undequantized). Both sides then run the same float32 weights, so greedy tokens must be equal and
logprobs within 1e-4, or twice the reference's own float32 noise where that is larger (its
step-by-step logprobs against one forward of the same tokens: the stages' tiled matmuls sum in
another order), plus float32's relative noise on logprobs of magnitude ~10 (rtol 1e-5)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from inferencemesh.checkpoint.errors import CheckpointError
from inferencemesh.checkpoint.read import read_local
from inferencemesh.modeling.loader import load_stage
from inferencemesh.modeling.quantized import QuantizedLinear, fp8_bits_as_float
from inferencemesh.modeling.quantized_embedding import QuantizedEmbedding
from inferencemesh.modeling.runtime import StageRuntime
from inferencemesh.planner import PlanInputs

sys.path.insert(0, str(Path(__file__).parent))
from quantized_reference import NEW, PROMPT, chain, greedy_against  # noqa: E402  # noqa: E402
from tiny_models import write_tiny_model  # noqa: E402

SPLITS = {1: [0, 4], 2: [0, 2, 4], 3: [0, 1, 3, 4]}
# name -> (compressed-tensors preset or None for the fp8 spec writer, format, weight overrides)
FORMATS = {
    "w4a16": ("W4A16", "pack-quantized", {"group_size": 32}),
    "w4a16-asym": ("W4A16_ASYM", "pack-quantized", {"group_size": 32}),
    "w8a16-group": ("W8A16", "pack-quantized", {"group_size": 32}),
    "int8-channel": ("W8A16", "int-quantized", {"strategy": "channel", "group_size": None}),
    "int8-channel-head": ("W8A16", "int-quantized", {"strategy": "channel", "group_size": None, "ignore": []}),
    "fp8-dynamic": ("FP8_DYNAMIC", "float-quantized", {}),
    "fp8-tensor": ("FP8_DYNAMIC", "float-quantized", {"strategy": "tensor"}),
    "fp8-block": (None, "fp8", {"block": [32, 32]}),
    "fp8-block-ragged": (None, "fp8", {"block": [48, 32]}),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("q") / "base", "llama", num_layers=4, shards=1,
                            dtype=torch.bfloat16)


def _quantize_with_compressed_tensors(model, preset: str, fmt: str, overrides: dict):
    """compressed-tensors' own scheme, scales from each weight's min and max (its calculate_qparams,
    what llm-compressor's round-to-nearest observer computes), compressed by its ModelCompressor."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    overrides = dict(overrides)
    ignore = overrides.pop("ignore", ["lm_head"])  # the LM head quantized too where it is []
    scheme = dict(PRESET_SCHEMES[preset])
    scheme["weights"] = scheme["weights"].model_copy(update=overrides)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], **scheme)},
                                ignore=ignore)
    apply_quantization_config(model, config)
    for module in model.modules():
        args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
        if args is None:
            continue
        w = module.weight.data.float()
        if args.strategy == "group":
            w = w.reshape(w.shape[0], -1, args.group_size)
        elif args.strategy == "tensor":
            w = w.reshape(1, -1)
        scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), args)
        module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype).reshape(
                module.weight_zero_point.shape)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    return compressor


def _write_fp8_block(base: Path, path: Path, block: list[int]) -> None:
    """transformers' fp8 format by its specification: each linear layer's weight in F8_E4M3 and
    weight_scale_inv [ceil(out/b0), ceil(in/b1)] float32 with weight = q x scale_inv per block."""
    state = {k: v for shard in sorted(base.glob("*.safetensors")) for k, v in load_file(shard).items()}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if not (name.startswith("model.layers.") and name.endswith("proj.weight")):
            out[name] = tensor
            continue
        w = tensor.float()
        n, k = w.shape
        rows, cols = -(-n // block[0]), -(-k // block[1])
        amax = torch.zeros(rows, cols)
        for i in range(rows):
            for j in range(cols):
                amax[i, j] = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].abs().max()
        scale = amax / torch.finfo(torch.float8_e4m3fn).max
        expanded = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
        out[name] = (w / expanded).to(torch.float8_e4m3fn)
        out[name.removesuffix("weight") + "weight_scale_inv"] = scale
    path.mkdir()
    save_file(out, path / "model.safetensors")
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": block, "modules_to_not_convert": ["lm_head"]}
    (path / "config.json").write_text(json.dumps(config))


def write_quantized(base: Path, root: Path, name: str) -> Path:
    preset, fmt, overrides = FORMATS[name]
    path = root / name
    if path.exists():
        return path
    if preset is None:
        _write_fp8_block(base, path, overrides["block"])
        return path
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    compressor = _quantize_with_compressed_tensors(model, preset, fmt, overrides)
    model.save_pretrained(path)
    compressor.update_config(str(path))
    return path


def reference(path: Path) -> torch.nn.Module:
    """The checkpoint through transformers' forward in float32, its quantized layers dequantized by
    the format's owner (scales in float32, the stages' compute dtype)."""
    config = AutoConfig.from_pretrained(path)
    quantization = config.quantization_config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = load_file(path / "model.safetensors")
    modules = {k.rsplit(".", 1)[0] for k in state if k.endswith(("weight_scale", "weight_scale_inv"))}
    plain = {k: v.float() for k, v in state.items() if k.rsplit(".", 1)[0] not in modules}
    model.load_state_dict(plain, strict=False)
    for module in modules:
        own = {k[len(module) + 1:]: v for k, v in state.items() if k.startswith(module + ".")}
        model.get_submodule(module).weight.data = _dequantized(quantization, own)
    return model


def _dequantized(quantization: dict, own: dict[str, torch.Tensor]) -> torch.Tensor:
    if quantization["quant_method"] == "fp8":
        q, scale = own["weight"].float(), own["weight_scale_inv"].float()
        b0, b1 = quantization["weight_block_size"]
        n, k = q.shape
        return q * scale.repeat_interleave(b0, 0)[:n].repeat_interleave(b1, 1)[:, :k]
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    group = quantization["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])
    own = {k: (v.float() if "scale" in k else v) for k, v in own.items()}
    return BaseCompressor.load_from_registry(quantization["format"]).decompress(own, scheme)["weight"].float()


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("quantized")


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_greedy_tokens_at_1_2_3_stages_equal_the_dequantized_reference(base, root, name):
    path = write_quantized(base, root, name)
    greedy_against(reference(path), path, seed=3, splits=SPLITS, check_stages=lambda stages: None if all(
        isinstance(s._layers[0].mlp.down_proj, QuantizedLinear) for s in stages) else pytest.fail(name))


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("dtype,width", [("float32", 4), ("bfloat16", 2)])
def test_planned_bytes_are_what_each_stage_allocates(base, root, name, dtype, width):
    path = write_quantized(base, root, name)
    facts = read_local(path)
    inputs = PlanInputs.from_checkpoint(facts, dtype=dtype)
    plain = PlanInputs.from_checkpoint(read_local(base), dtype=dtype)
    assert sum(inputs.layer_bytes) < 0.7 * sum(plain.layer_bytes), name  # fewer bytes: fewer stages
    for a, b in zip(SPLITS[2], SPLITS[2][1:], strict=False):
        stage = load_stage(path, a, b, dtype=dtype, device="cpu")
        held = {id(t): t.numel() * t.element_size() for m in (stage.embed, stage.layers, stage.norm, stage.lm_head)
                if m is not None for t in [*m.parameters(), *m.buffers()]}
        assert sum(held.values()) == inputs.stage_bytes(a, b, 4)[0], (name, a, b)


def test_the_cpu_kernels_agree_with_the_dequantized_weight(base, root):
    """bfloat16 compute takes the int4/int8 kernels (decode rows) and scratch dequantization
    (prefill rows); each within bfloat16's rounding of the float32 product with the same weight."""
    paths = {"int4_cpu": "w4a16", "int8": "int8-channel", "fp8_dequant": "fp8-block"}
    for path_name, name in paths.items():
        stage = load_stage(write_quantized(base, root, name), 0, 1, dtype="bfloat16", device="cpu")
        linear = stage.layers[0].mlp.up_proj
        assert isinstance(linear, QuantizedLinear) and linear.path == path_name, (name, linear.path)
        weight = linear.dequantized().float().clone()
        for rows in (1, 64):
            x = torch.randn(rows, linear.in_features, generator=torch.Generator().manual_seed(rows))
            want = x.bfloat16().float() @ weight.t()
            got = linear(x.bfloat16()).float()
            assert (got - want).abs().max() <= 0.02 * want.abs().max(), (name, rows)


def test_fp8_bits_convert_as_torch_converts():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = ~codes.float().isnan()
    for dtype in (torch.float32, torch.bfloat16):
        got = fp8_bits_as_float(codes, torch.empty(256, dtype=dtype)).float() * 2.0 ** 120
        assert torch.equal(got[finite], codes.float()[finite]), dtype


def _edit_config(path: Path, **quantization) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization or config.get("quantization_config")
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("config,words", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, ["bitsandbytes", "compressed-tensors"]),
    ({"quant_method": "gptq", "bits": 3}, ["GPTQ 3-bit", "served: 4 and 8 bits"]),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, ["AWQ 4-bit 'gemv'", "GEMM"]),
    ({"quant_method": "fp8", "activation_scheme": "static"}, ["static", "dynamic activations"]),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"type": "int", "num_bits": 8, "strategy": "channel"},
        "input_activations": {"type": "int", "num_bits": 8, "strategy": "token", "dynamic": True}}}},
     ["activations", "W8A16"]),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy": "tensor"},
        "input_activations": {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False}}}},
     ["static", "FP8_DYNAMIC"]),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"type": "float", "num_bits": 4, "strategy": "tensor_group"}}}},
     ["nvfp4-pack-quantized", "not served"]),
])
def test_formats_not_served_are_refused_in_one_line(base, tmp_path, config, words):
    path = Path(__import__("shutil").copytree(base, tmp_path / "m"))
    _edit_config(path, **config)
    with pytest.raises(CheckpointError) as refused:
        read_local(path)
    line = str(refused.value)
    assert "\n" not in line and all(w in line for w in words), line


def test_gguf_and_bad_scales_are_refused_in_one_line(base, root, tmp_path):
    gguf = tmp_path / "gguf"
    gguf.mkdir()
    (gguf / "config.json").write_text((base / "config.json").read_text())
    (gguf / "model-Q4_K_M.gguf").write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match="GGUF files .* are not served"):
        read_local(gguf)
    for change, words in (("drop", "without its weight_scale"), ("reshape", "needs a float [64, 2]")):
        path = Path(__import__("shutil").copytree(write_quantized(base, root, "w4a16"), tmp_path / change))
        state = load_file(path / "model.safetensors")
        name = "model.layers.1.self_attn.q_proj.weight_scale"
        if change == "drop":
            del state[name]
        else:
            state[name] = state[name].reshape(-1)[:64].reshape(64, 1).contiguous()
        save_file(state, path / "model.safetensors")
        with pytest.raises(CheckpointError) as refused:
            read_local(path)
        assert words in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
    plain = Path(__import__("shutil").copytree(write_quantized(base, root, "fp8-block"), tmp_path / "noconfig"))
    config = json.loads((plain / "config.json").read_text())
    del config["quantization_config"]
    (plain / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="F8_E4M3, but config.json has no quantization_config"):
        read_local(plain)


def _fake_quantized(weight: torch.Tensor, method: str) -> torch.Tensor:
    """compressed-tensors' own quantize-dequantize of a weight with the scheme --quantization uses."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    from inferencemesh.checkpoint.quantization import quantized_at_load

    quant = quantized_at_load("model.layers.0.mlp.up_proj.weight", tuple(weight.shape), method)
    assert quant is not None
    args = QuantizationArgs(num_bits=quant.bits, type=quant.kind, strategy=quant.strategy, symmetric=True,
                            group_size=quant.group_size or None)
    w = weight.float()
    view = w.reshape(w.shape[0], -1, quant.group_size) if quant.strategy == "group" else w
    keep = quant.strategy == "channel"  # a scale per row: [out, 1]
    scale, zero = calculate_qparams(view.amin(-1, keepdim=keep), view.amax(-1, keepdim=keep), args)
    return fake_quantize(w, scale, zero, args)


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_a_16_bit_checkpoint_quantized_as_it_is_read(base, method):
    """load_stage(quantization=...) quantizes each dense linear weight, and the (untied) embedding
    table and LM head, as it is read: greedy tokens at 1 and 2 stages through the stage runtime
    equal transformers' forward of the same checkpoint with compressed-tensors' own
    quantize-dequantize of those weights, and the plan counts the bytes each stage then holds."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    assert not model.config.tie_word_embeddings
    for name, module in model.named_modules():
        if (name.startswith("model.layers.") and isinstance(module, torch.nn.Linear)) or \
                name in ("model.embed_tokens", "lm_head"):
            module.weight.data = _fake_quantized(module.weight.data, method)
    prompt = torch.randint(3, 256, (PROMPT,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model.generate(prompt[None], max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0, PROMPT:]
    for n in (1, 2):
        _quantized_at_load_serves(base, method, SPLITS[n], prompt, expected.tolist())


def _quantized_at_load_serves(path: Path, method: str, bounds: list[int], prompt: torch.Tensor,
                              expected: list[int]) -> None:
    """The stages of `bounds` loaded with quantization `method`: their layers, table and head
    quantized, the bytes each holds the plan's, and greedy tokens through them `expected`."""
    inputs = PlanInputs.from_checkpoint(read_local(path), dtype="float32", quantization=method, kv_tokens=64)
    ranges = list(zip(bounds, bounds[1:], strict=False))
    layers = bounds[-1]
    modules = [load_stage(path, a, b, dtype="float32", device="cpu", quantization=method) for a, b in ranges]
    for (a, b), stage in zip(ranges, modules, strict=True):
        assert isinstance(stage.layers[0].self_attn.o_proj, QuantizedLinear)
        assert a > 0 or isinstance(stage.embed, QuantizedEmbedding)
        assert b < layers or isinstance(stage.lm_head, QuantizedLinear)
        held = {id(t): t.numel() * t.element_size() for m in (stage.embed, stage.layers, stage.norm, stage.lm_head)
                if m is not None for t in [*m.parameters(), *m.buffers()]}
        assert sum(held.values()) == inputs.stage_bytes(a, b, layers)[0], (method, a, b)
    stages = [StageRuntime(path, a, b, dtype="float32", device="cpu", max_context=64, modules=m)
              for (a, b), m in zip(ranges, modules, strict=True)]
    sessions = [s.new_session() for s in stages]
    logits, got, pos = chain(stages, sessions, 0, prompt), [], PROMPT
    for _ in range(NEW):
        got.append(int(logits[-1].argmax()))
        logits = chain(stages, sessions, pos, torch.tensor([got[-1]]))
        pos += 1
    assert got == expected, (method, bounds)


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_an_embedding_quantized_at_load_reads_the_rows_of_its_quantized_table(method):
    """A lookup dequantizes exactly the rows compressed-tensors' quantize-dequantize gives (float32),
    holds the bytes the plan counts, and a scaled embedding (Gemma 3's) keeps its scale."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    from inferencemesh.checkpoint.quantization import held_embedding_bytes, quantized_at_load
    from inferencemesh.modeling.quantized_load import _quantized_embedding

    weight = torch.randn(320, 64, generator=torch.Generator().manual_seed(2))
    quant = quantized_at_load("model.embed_tokens.weight", (320, 64), method)
    assert quant is not None
    table = QuantizedEmbedding(quant, weight, torch.float32, torch.device("cpu"))
    ids = torch.tensor([[0, 5, 319], [7, 7, 100]])
    assert torch.equal(table(ids), _fake_quantized(weight, method)[ids])
    assert sum(b.numel() * b.element_size() for b in table.buffers()) == held_embedding_bytes(quant, 320, 64, 4)
    scaled = Gemma3TextScaledWordEmbedding(320, 64, 0, embed_scale=8.0)
    scaled.weight.data = weight.clone()
    ours = _quantized_embedding(scaled, quant, weight, torch.float32, torch.device("cpu"), "m")
    scaled.weight.data = _fake_quantized(weight, method)
    assert torch.allclose(ours(ids), scaled(ids), rtol=1e-6, atol=0)
    norm_capped = torch.nn.Embedding(320, 64, max_norm=1.0)
    with pytest.raises(CheckpointError, match="cannot be quantized at load"):
        _quantized_embedding(norm_capped, quant, weight, torch.float32, torch.device("cpu"), "m")


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_a_tied_embedding_and_head_are_quantized_for_each_role_a_stage_holds(tmp_path, method):
    """One matrix serving both (tied): the first stage holds it as a quantized table, the last as a
    quantized head, one stage as both (two quantized copies), each as the plan counts it; greedy
    tokens at 1 and 2 stages equal transformers' forward with the matrix quantize-dequantized
    (both roles read the same rows)."""
    path = write_tiny_model(tmp_path / "tied", "qwen2", num_layers=2, shards=1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    for name, module in model.named_modules():
        if name == "model.embed_tokens" or (name.startswith("model.layers.") and isinstance(module, torch.nn.Linear)):
            module.weight.data = _fake_quantized(module.weight.data, method)
    prompt = torch.randint(3, 200, (PROMPT,), generator=torch.Generator().manual_seed(5))
    ids = prompt.tolist()
    with torch.no_grad():
        for _ in range(NEW):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    expected = ids[PROMPT:]
    for bounds in ([0, 2], [0, 1, 2]):
        _quantized_at_load_serves(path, method, bounds, prompt, expected)


def test_quantized_experts_are_refused_at_plan_time(base, root, tmp_path):
    """A quantized layer with no dense linear layer to hold it (transformers fuses MoE experts into
    one tensor) is refused when the checkpoint is read, not when a stage loads it."""
    path = Path(__import__("shutil").copytree(write_quantized(base, root, "w8a16-group"), tmp_path / "experts"))
    state = load_file(path / "model.safetensors")
    for suffix in ("weight_packed", "weight_scale", "weight_shape"):
        state[f"model.layers.0.mlp.experts.0.up_proj.{suffix}"] = state[f"model.layers.0.mlp.up_proj.{suffix}"].clone()
    save_file(state, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="quantized MoE experts and embeddings are not served yet"):
        read_local(path)


@pytest.mark.parametrize("name", ["w4a16", "int8-channel", "fp8-dynamic"])
def test_a_quantized_draft_takes_the_stage_runtime_and_refuses_the_lean_form(base, root, name):
    """The draft's lean forward reads plain Linear weights: a quantized draft takes the stage
    runtime (which computes QuantizedLinear), and refuses the lean form by name."""
    from inferencemesh.frontend.engine.proposers.draft_model import DraftModel

    path = write_quantized(base, root, name)
    draft = DraftModel(str(path), dtype="float32", device="cpu", max_context=128)
    assert draft.form == "stage"
    with pytest.raises(ValueError, match="quantized"):
        DraftModel(str(path), dtype="float32", device="cpu", max_context=128, form="lean")
