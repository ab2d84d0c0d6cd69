"""AWQ, GPTQ and MXFP4 checkpoints: their quantization_config read into a WeightQuant, and the
modules they quantize found and checked from the safetensors headers alone (checkpoint/
quantization.py dispatches here; modeling/quantized_formats.py computes them).

The layouts, as their tools write them (AutoAWQ's WQLinear_GEMM and packing_utils, GPTQModel's
and AutoGPTQ's QuantLinear, gpt-oss's MXFP4 as transformers.integrations.mxfp4 reads it):

    AWQ (version "gemm")  qweight I32 [in, out/8]  8 nibbles a word along the outputs, in the
                          order 0 2 4 6 1 3 5 7; qzeros I32 [in/group, out/8] the same way;
                          scales F16 [in/group, out]; w = (q - z) x s
    GPTQ                  qweight I32 [in x bits/32, out]  packed along the inputs, low bits
                          first; qzeros I32 [groups, out x bits/32] along the outputs; scales
                          [groups, out]; g_idx I32 [in], each input's group (out of order with
                          desc_act); w = (q - z) x s. The classic format ("gptq", v1) stores
                          z - 1 (GPTQModel subtracts 0x11111111 from each packed word, and adds
                          it back as it loads); "gptq_v2" stores z.
    MXFP4 (gpt-oss)       experts' gate_up_proj_blocks / down_proj_blocks U8 [experts, out,
                          in/32, 16] (e2m1 values, two a byte, low nibble first) and _scales U8
                          [experts, out, in/32] (E8M0: 2^(s - 127)); only the experts quantized.
"""

from __future__ import annotations

from collections.abc import Mapping

from inferencemesh.checkpoint.errors import CheckpointError, shown
from inferencemesh.checkpoint.quant_types import QuantizedModule, TensorInfo, WeightQuant

_FLOATS = ("F16", "BF16", "F32")


def format_quant(method: str, qc: dict) -> WeightQuant:
    """The weight quantization an AWQ, GPTQ or MXFP4 quantization_config describes; what is not
    served is refused in one line (CheckpointError)."""
    if method == "mxfp4":
        return WeightQuant("mxfp4", 4, "group", 32, layout="mxfp4")
    bits, group = int(qc.get("bits", 4)), int(qc.get("group_size", 128))
    if group == 0 or group < -1:
        raise CheckpointError(f"group_size {group} is not a group size (a positive number, or -1: per channel)")
    strategy = "channel" if group == -1 else "group"
    if method == "awq":
        version = str(qc.get("version") or qc.get("format") or "gemm").lower()
        if version != "gemm" or bits != 4:
            raise CheckpointError(f"AWQ {bits}-bit {shown(version, 20)} is not served; served: 4-bit GEMM "
                                  "(AutoAWQ's default version)")
        if not qc.get("zero_point", True):
            raise CheckpointError("AWQ without zero points is not served; served: zero_point true (AutoAWQ's default)")
        return WeightQuant("int", 4, strategy, max(group, 0), symmetric=False, layout="awq")
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    pack = str(qc.get("pack_dtype") or "int32")
    if bits not in (4, 8) or fmt not in ("gptq", "gptq_v2") or pack != "int32":
        raise CheckpointError(f"GPTQ {bits}-bit format {shown(fmt, 20)} packed in {shown(pack, 12)} is not served; "
                              "served: 4 and 8 bits, formats gptq and gptq_v2, packed in int32")
    if qc.get("dynamic"):
        raise CheckpointError("GPTQ with per-module overrides (dynamic) is not served")
    meta = qc.get("meta")
    meta = meta if isinstance(meta, dict) else {}
    static_groups = bool(qc.get("static_groups", meta.get("static_groups", False)))
    return WeightQuant("int", bits, strategy, max(group, 0), symmetric=bool(qc.get("sym", True)), layout=fmt,
                       act_order=bool(qc.get("desc_act", False)) and not static_groups and strategy == "group")


def format_modules(method: str, quant: WeightQuant, config: dict,
                   tensors: Mapping[str, TensorInfo]) -> dict[str, QuantizedModule]:
    """module name -> how it is quantized (`quant`, format_quant's) and its shape, every tensor
    checked (shapes, dtypes)."""
    if method == "mxfp4":
        return _mxfp4_modules(quant, config, tensors)
    out: dict[str, QuantizedModule] = {}
    for name in sorted(n for n in tensors if n.endswith(".qweight")):
        module = name.removesuffix(".qweight")
        if "experts" in module.split(".") or not (module.startswith("model.layers.") or module == "lm_head"):
            raise CheckpointError(f"{shown(module)} is quantized, but quantized MoE experts and embeddings are not "
                                  f"served in {method.upper()} checkpoints yet: give the 16-bit checkpoint")
        out[module] = (_awq if quant.layout == "awq" else _gptq)(module, quant, tensors)
    return _some(out, method, "qweight")


def _tensor(tensors: Mapping[str, TensorInfo], module: str, suffix: str, dtypes: tuple[str, ...],
            shape: tuple[int, ...], what: str) -> None:
    info = tensors.get(f"{module}.{suffix}")
    if info is None:
        raise CheckpointError(f"{shown(module)}: {what} weight without its {suffix} tensor")
    if info.dtype not in dtypes or tuple(info.shape) != shape:
        raise CheckpointError(f"{shown(module)}: {suffix} is {info.dtype} {list(info.shape)}, but {what} needs "
                              f"{'/'.join(dtypes)} {list(shape)}")


def _awq(module: str, quant: WeightQuant, tensors: Mapping[str, TensorInfo]) -> QuantizedModule:
    qweight = tensors[f"{module}.qweight"]
    if qweight.dtype != "I32" or len(qweight.shape) != 2:
        raise CheckpointError(f"{shown(module)}: qweight is {qweight.dtype} {list(qweight.shape)}, but AWQ packs "
                              "2-d I32 words")
    in_features, out_features = qweight.shape[0], qweight.shape[1] * 8
    groups = _groups(module, quant, in_features)
    what = f"an AWQ int4 weight of {out_features}x{in_features} in {groups} groups"
    _tensor(tensors, module, "scales", _FLOATS, (groups, out_features), what)
    _tensor(tensors, module, "qzeros", ("I32",), (groups, out_features // 8), what)
    return QuantizedModule(quant, out_features, in_features)


def _gptq(module: str, quant: WeightQuant, tensors: Mapping[str, TensorInfo]) -> QuantizedModule:
    qweight, per_word = tensors[f"{module}.qweight"], 32 // quant.bits
    if qweight.dtype != "I32" or len(qweight.shape) != 2:
        raise CheckpointError(f"{shown(module)}: qweight is {qweight.dtype} {list(qweight.shape)}, but GPTQ packs "
                              "2-d I32 words")
    in_features, out_features = qweight.shape[0] * per_word, qweight.shape[1]
    groups = _groups(module, quant, in_features)
    what = f"a GPTQ int{quant.bits} weight of {out_features}x{in_features} in {groups} groups"
    if out_features % per_word:
        raise CheckpointError(f"{shown(module)}: {what} cannot pack its {out_features} zero points in I32 words")
    _tensor(tensors, module, "scales", _FLOATS, (groups, out_features), what)
    _tensor(tensors, module, "qzeros", ("I32",), (groups, out_features // per_word), what)
    if quant.act_order or f"{module}.g_idx" in tensors:
        _tensor(tensors, module, "g_idx", ("I32", "I64"), (in_features,), what)
    return QuantizedModule(quant, out_features, in_features)


def _groups(module: str, quant: WeightQuant, in_features: int) -> int:
    if quant.strategy == "channel":
        return 1
    if in_features % quant.group_size:
        raise CheckpointError(f"{shown(module)}: {in_features} inputs are not whole groups of {quant.group_size}")
    return in_features // quant.group_size


def _mxfp4_modules(quant: WeightQuant, config: dict, tensors: Mapping[str, TensorInfo]) -> dict[str, QuantizedModule]:
    """gpt-oss's experts: per layer, gate_up_proj [experts, 2 x intermediate, hidden] and down_proj
    [experts, hidden, intermediate] as blocks and scales (out_features: all experts' rows of both)."""
    experts = int(config.get("num_local_experts") or 0)
    hidden, inter = int(config.get("hidden_size") or 0), int(config.get("intermediate_size") or 0)
    modules = sorted({n.rpartition(".")[0] for n in tensors if n.endswith(("_blocks", "_scales"))})
    out: dict[str, QuantizedModule] = {}
    for module in modules:
        if not (module.startswith("model.layers.") and module.endswith(".mlp.experts")):
            raise CheckpointError(f"{shown(module)} has MXFP4 blocks, but only MoE experts (model.layers.N.mlp."
                                  "experts, gpt-oss's) are served in MXFP4")
        for proj, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
            what = f"MXFP4 {proj} of {experts} experts x {rows}x{cols}"
            if cols % 32:
                raise CheckpointError(f"{shown(module)}: {what}: {cols} inputs are not whole blocks of 32")
            _tensor(tensors, module, f"{proj}_blocks", ("U8",), (experts, rows, cols // 32, 16), what)
            _tensor(tensors, module, f"{proj}_scales", ("U8",), (experts, rows, cols // 32), what)
        out[module] = QuantizedModule(quant, experts * 3 * inter, hidden)  # 2i x h + h x i rows x inputs, per expert
    return _some(out, "mxfp4", "experts' _blocks")


def _some(modules: dict[str, QuantizedModule], method: str, tensors: str) -> dict[str, QuantizedModule]:
    """The modules found; none is a checkpoint whose config and tensors disagree (a 16-bit export
    with the quantized model's config.json), refused rather than served as something else."""
    if not modules:
        raise CheckpointError(f"quantization_config {method!r}: the checkpoint has no quantized tensors ({tensors}); "
                              "give the quantized export its config.json describes, or the 16-bit checkpoint "
                              "without a quantization_config")
    return modules
