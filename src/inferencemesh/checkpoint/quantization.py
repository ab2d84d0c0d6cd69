"""Quantized checkpoints: which formats are served, which linear layers a checkpoint quantizes
and how, and the bytes a stage holds for each, learned from config.json and the safetensors
headers alone (the planner and the loader both start here).

Served: compressed-tensors (`quant_method: compressed-tensors`) `pack-quantized` INT4/INT8
and `int-quantized` INT8 weights, per channel or grouped, symmetric or not (llm-compressor's
W4A16, W8A16), `float-quantized` FP8 e4m3 weights per tensor, per channel or in blocks
(FP8_DYNAMIC's, FP8_BLOCK's), transformers' own `fp8` config (block-wise
`weight_scale_inv`), AWQ (GEMM) and GPTQ INT4/INT8 (checkpoint/quant_gptq_awq.py), and gpt-oss's
MXFP4 experts. Activations are never quantized: dynamic FP8 activation scales are a
device of FP8 tensor cores, and computing in 16/32 bits as vLLM's weight-only FP8 (Marlin)
path does is at least as accurate; static activation scales and integer activations, which
change the result, are refused. Modules the config ignores (often lm_head) load as before.

A stage holds a quantized linear layer as modeling/quantized.py lays it out, which
`held_bytes` counts: INT4 as two values a byte plus a (scale, zero) pair per group in the
compute dtype (the CPU kernel's own layout), INT8 and FP8 a byte a value plus their scales
(and an offset per group when asymmetric) in the compute dtype.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import TypeVar

from inferencemesh.checkpoint.errors import CheckpointError, first_line, shown
from inferencemesh.checkpoint.quant_gptq_awq import format_modules, format_quant
from inferencemesh.checkpoint.quant_types import QuantizedModule, TensorInfo, WeightQuant

T = TypeVar("T")


SERVED_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")
# Suffixes of a quantized linear's tensors; "weight_shape" is metadata a stage does not keep.
QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_scale_inv", "weight_zero_point", "weight_shape",
                  "qweight", "qzeros", "scales", "g_idx")  # ... and AWQ's and GPTQ's
# The tensor of a quantized module that its held bytes are counted on (its other tensors count 0).
WEIGHT_SUFFIXES = (".weight_packed", ".weight", ".qweight")
MXFP4_SUFFIXES = ("_blocks", "_scales")  # gpt-oss's experts: gate_up_proj_blocks, down_proj_scales, ...
_INSTEAD = ("give the 16-bit checkpoint, or a compressed-tensors W4A16/W8A16/FP8 export of it (llm-compressor "
            "writes them, with GPTQ or AWQ too)")
_NOT_SERVED = {  # quant_method -> the format's name: refused as "cannot be served yet"
    "bitsandbytes": "bitsandbytes 4-bit and 8-bit",
    "gguf": "GGUF", "hqq": "HQQ", "eetq": "EETQ", "quanto": "quanto", "torchao": "torchao", "bitnet": "BitNet",
}


def held_bytes(quant: WeightQuant, out_features: int, in_features: int, width: int) -> int:
    """Bytes a stage holds for a linear layer quantized as `quant`, its scales in `width`-byte floats
    (modeling/quantized.py allocates exactly these)."""
    if quant.kind == "mxfp4":  # as stored: two values a byte, an E8M0 scale byte per 32 (out: all experts' rows)
        return out_features * in_features // 2 + out_features * in_features // 32
    rows, cols = quant.scale_shape(out_features, in_features)
    perm = in_features * 4 if quant.act_order else 0  # the int32 input permutation of GPTQ's desc_act
    if quant.kind == "int" and quant.bits == 4:
        return out_features * in_features // 2 + rows * cols * 2 * width + perm  # (scale, zero) pairs
    offsets = 0 if quant.symmetric else rows * cols * width
    return out_features * in_features + rows * cols * width + offsets + perm


def held_embedding_bytes(quant: WeightQuant, rows: int, columns: int, width: int) -> int:
    """Bytes a stage holds for an embedding table [rows, columns] quantized as `quant`
    (modeling/quantized_embedding.py's QuantizedEmbedding): the values (INT4 two a byte) and a scale per row
    or per group of a row, in `width`-byte floats."""
    scale_rows, scale_cols = quant.scale_shape(rows, columns)
    values = rows * columns // 2 if quant.kind == "int" and quant.bits == 4 else rows * columns
    return values + scale_rows * scale_cols * width


def held_on(name: str, shape: tuple[int, ...], module: QuantizedModule, width: int) -> int:
    """The bytes counted on one tensor of a quantized module: the module's all on its weight, 0 on
    its other tensors (MXFP4's blocks and scales, held as stored, count their own)."""
    if module.quant.kind == "mxfp4":
        return math.prod(shape)
    return held_bytes(module.quant, module.out_features, module.in_features, width) \
        if name.endswith(WEIGHT_SUFFIXES) else 0


def quant_method(config: dict) -> str | None:
    quantization = config.get("quantization_config")
    if quantization is None:
        return None
    return str(quantization.get("quant_method", "unnamed")) if isinstance(quantization, dict) else "unnamed"


def refusal(config: dict) -> str | None:
    """Why a checkpoint's quantization cannot be served (one line naming the format and what to
    do instead), or None: unquantized, or a served format."""
    method = quant_method(config)
    if method is None:
        return None
    qc = config["quantization_config"]
    if method in _NOT_SERVED:
        return (f"quantization_config {shown(method, 40)}: {_NOT_SERVED[method]} checkpoints cannot be served yet; "
                + _INSTEAD)
    if method in ("awq", "gptq", "mxfp4"):
        try:
            _parsed(lambda q: format_quant(method, q), qc)
        except CheckpointError as err:
            return f"quantization_config {method!r}: {err}"
        return None
    if method == "fp8":
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            scheme = shown(qc.get("activation_scheme"), 20)
            return (f"quantization_config 'fp8' with {scheme} activation scales is not served (static activation "
                    "scales change the result): give an FP8 checkpoint with dynamic activations")
        return None
    if method != "compressed-tensors":
        return f"quantization_config {shown(method, 40)} is not a format InferenceMesh serves; " + _INSTEAD
    try:
        _parsed(_compressed_groups, qc)
    except CheckpointError as err:
        return f"quantization_config 'compressed-tensors': {err}"
    return None


def _parsed(parse: Callable[[dict], T], qc: dict) -> T:
    """parse(qc), a malformed config (a hostile or hand-edited file) refused in one line."""
    try:
        return parse(qc)
    except (TypeError, ValueError, AttributeError, KeyError, re.error) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"quantization_config is malformed ({first_line(err)})") from None


def _compressed_groups(qc: dict) -> list[tuple[list[str], WeightQuant]]:
    """A compressed-tensors config's groups: (targets, weight quantization), refusing what is not served."""
    for key, what in (("sparsity_config", "sparsity"), ("transform_config", "transforms"),
                      ("kv_cache_scheme", "KV cache quantization")):
        if qc.get(key):
            return _refuse(f"compressed-tensors with {what} is not served: give a weight-only export "
                           "(W4A16, W8A16, FP8_DYNAMIC)")
    groups = []
    for name, group in (qc.get("config_groups") or {}).items():
        fmt = group.get("format") or qc.get("format")
        if fmt not in SERVED_FORMATS:
            _refuse(f"compressed-tensors format {shown(fmt, 40)} (group {shown(name, 30)}) is not served; served: "
                    "pack-quantized INT4/INT8, int-quantized INT8, float-quantized FP8 weights")
        acts = group.get("input_activations")
        if group.get("output_activations") or (acts and not (acts.get("type") == "float" and acts.get("dynamic"))):
            _refuse(f"compressed-tensors group {shown(name, 30)} quantizes activations "
                    f"({(acts or {}).get('type')}, {'dynamic' if (acts or {}).get('dynamic') else 'static'}), "
                    "which cannot be computed here: give a weight-only export (W4A16, W8A16, FP8_DYNAMIC)")
        groups.append((list(group.get("targets") or []), _weight_quant(group.get("weights") or {}, str(fmt), name)))
    if not groups:
        _refuse("compressed-tensors config has no config_groups")
    return groups


def _weight_quant(w: dict, fmt: str, group: str) -> WeightQuant:
    kind, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
    served = (kind == "int" and bits in (4, 8) and strategy in ("channel", "group")) or \
        (kind == "float" and bits == 8 and strategy in ("tensor", "channel", "block"))
    if not served or (kind == "int" and bits == 4 and fmt != "pack-quantized"):
        _refuse(f"compressed-tensors weights {kind} {bits}-bit {strategy} (group {shown(group, 30)}) are not served; "
                "served: INT4/INT8 per channel or group, FP8 per tensor, channel or block")
    block = tuple(w.get("block_structure") or (0, 0))
    group_size = int(w.get("group_size") or 0)
    if (strategy == "group" and group_size <= 0) or (strategy == "block" and (len(block) != 2 or min(block) <= 0)):
        _refuse(f"compressed-tensors group {shown(group, 30)}: {strategy} quantization without its size")
    return WeightQuant(str(kind), int(bits or 0), str(strategy), group_size, (int(block[0]), int(block[1])),
                       bool(w.get("symmetric", True)), fmt == "pack-quantized")


def _refuse(message: str) -> list:
    raise CheckpointError(message)


def _matches(targets: list[str], module: str) -> bool:
    """Whether a config group's targets (a class name, a module name, "re:" a pattern) name `module`."""
    for target in map(str, targets):
        try:
            if target == "Linear" or target == module or (target.startswith("re:") and re.match(target[3:], module)):
                return True
        except re.error as err:
            raise CheckpointError(f"quantization_config target {shown(target, 40)} is not a pattern ({err})") from None
    return False


def quantized_modules(config: dict, tensors: Mapping[str, TensorInfo]) -> dict[str, QuantizedModule]:
    """module name -> how it is quantized and its shape, for every linear layer whose tensors
    carry scales, checked against the config: scales present and of the right shape, the
    weight's dtype the format's. Raises CheckpointError in one line."""
    method = quant_method(config)
    if method is None:
        return {}
    qc = config["quantization_config"]
    if method in ("awq", "gptq", "mxfp4"):
        return format_modules(method, _parsed(lambda q: format_quant(method, q), qc), config, tensors)
    weights = {n.removesuffix(".weight_packed") for n in tensors if n.endswith(".weight_packed")} | \
        {n.removesuffix(".weight") for n in tensors if n.endswith(".weight") and tensors[n].dtype in ("F8_E4M3", "I8")}
    groups = _parsed(_compressed_groups, qc) if method == "compressed-tensors" else \
        [(["Linear"], _parsed(_fp8_quant, qc))]
    out: dict[str, QuantizedModule] = {}
    for module in sorted(weights):
        if "experts" in module.split(".") or not (module.startswith("model.layers.") or module == "lm_head"):
            raise CheckpointError(f"{shown(module)} is quantized, but quantized MoE experts and embeddings are not "
                                  "served yet: give a checkpoint that quantizes only dense linear layers (its "
                                  "ignore list naming them) or the 16-bit checkpoint")
        quant = next((q for targets, q in groups if _matches(targets, module)), None)
        if quant is None:
            raise CheckpointError(f"quantized tensors of {shown(module)} match no config_groups target")
        out[module] = _checked(module, quant, tensors)
    return out


def _fp8_quant(qc: dict) -> WeightQuant:
    """transformers' fp8 config: e4m3 weights, a weight_scale_inv per block (or one per tensor)."""
    block = tuple(qc.get("weight_block_size") or (0, 0))
    if len(block) != 2 or min(int(b) for b in block) < 0:
        raise CheckpointError(f"quantization_config 'fp8': weight_block_size {shown(block, 30)} is not two sizes")
    return WeightQuant("float", 8, "block" if block != (0, 0) else "tensor", 0, (int(block[0]), int(block[1])),
                       scale_name="weight_scale_inv")


def _checked(module: str, quant: WeightQuant, tensors: Mapping[str, TensorInfo]) -> QuantizedModule:
    """The module's shape from its weight, its tensors checked against `quant`."""
    weight = tensors.get(f"{module}.weight_packed" if quant.packed else f"{module}.weight")
    want = "I32" if quant.packed else ("F8_E4M3" if quant.kind == "float" else "I8")
    if weight is None or weight.dtype != want or len(weight.shape) != 2:
        got = f"{weight.dtype} {list(weight.shape)}" if weight else "none"
        raise CheckpointError(f"{shown(module)}: its quantized weight should be a 2-d {want} tensor, found {got}")
    out_features, columns = weight.shape
    in_features = columns * 32 // quant.bits if quant.packed else columns
    scale = tensors.get(f"{module}.{quant.scale_name}")
    if scale is None:
        raise CheckpointError(f"{shown(module)}: quantized weight without its {quant.scale_name} tensor")
    rows, cols = quant.scale_shape(out_features, in_features)
    shape = tuple(scale.shape)
    fits = shape in ((rows, cols), (rows * cols,)) or (rows * cols == 1 and shape == ())
    if quant.strategy == "group" and in_features % quant.group_size:
        fits = False
    if not fits or scale.dtype not in ("F32", "F16", "BF16"):
        raise CheckpointError(f"{shown(module)}: {quant.scale_name} is {scale.dtype} {list(shape)}, but a {quant.name} "
                              f"{quant.strategy} weight of {out_features}x{in_features} needs a float [{rows}, {cols}]")
    zero = tensors.get(f"{module}.weight_zero_point")
    if not quant.symmetric and zero is None:
        raise CheckpointError(f"{shown(module)}: asymmetric quantized weight without its weight_zero_point")
    return QuantizedModule(quant, out_features, in_features)


def module_of(name: str) -> str | None:
    """The linear layer (or MXFP4 experts) a quantized tensor's name belongs to, by its suffix
    (None: not one)."""
    head, _, suffix = name.rpartition(".")
    if head.endswith(".experts") and suffix.endswith(MXFP4_SUFFIXES):
        return head
    return head if suffix in QUANT_SUFFIXES or suffix == "weight" else None


LOAD_METHODS = ("int8", "int4", "fp8")  # a 16-bit checkpoint quantized as it is read (load_stage's quantization)
_ROUTERS = ("gate", "router", "wg")  # MoE routers stay in float, as vLLM keeps them


# The embedding table and the LM head: quantized at load too, tied or not.
EMBEDDING_WEIGHT, HEAD_WEIGHT = "model.embed_tokens.weight", "lm_head.weight"


def quantized_at_load(name: str, shape: tuple[int, ...], method: str) -> WeightQuant | None:
    """How a 16-bit tensor is quantized as a stage reads it with quantization `method` (int8: per
    channel; int4: groups of 128, 64 or 32 inputs; fp8: e4m3 per channel, FP8_DYNAMIC's weights),
    or None: it stays as it is (norms, fused experts, MoE routers, inputs no int4 group divides).
    The embedding and the head are quantized as a linear weight [rows, hidden] is: per row, or per
    group of a row. They are a third of a 150M model's weights and most of a stage's at the ends of
    a split, as in GGUF. A tied matrix is quantized for each role a stage gives it (HEAD_WEIGHT
    names the head's): the first stage's table, the last stage's head, and both in one stage,
    which holds two quantized copies (INT8 and FP8: the 16-bit matrix's bytes; INT4: half)."""
    parts = name.split(".")
    table = name in (EMBEDDING_WEIGHT, HEAD_WEIGHT)
    if not ((table or name.startswith("model.layers.")) and parts[-1] == "weight" and len(shape) == 2) or \
            parts[-2] in _ROUTERS or "experts" in parts:
        return None
    if method == "int8":
        return WeightQuant("int", 8, "channel")
    if method == "fp8":
        return WeightQuant("float", 8, "channel")
    group = next((g for g in (128, 64, 32) if shape[1] % g == 0), 0)
    return WeightQuant("int", 4, "group", group) if group else None
