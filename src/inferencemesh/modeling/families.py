"""Which decoder-only families a stage can run, found from transformers itself, and the one table
of what differs between them.

Any `*ForCausalLM` of the installed transformers whose model has the standard layout is served
by one path: `model.embed_tokens` -> `model.layers[i]` (its own decoder layers, each taking the
rotary `position_embeddings` and our KV cache) -> `model.norm` -> `lm_head`. The classes are
never named here: the model is built from the config with its parameters on the meta device
(`build_causal_lm`) and the stage keeps the modules it runs. What the family's own modules do
inside (q/k norms, fused projections, (1 + weight) norms, partial rotary, parallel attention +
MLP, Gemma's scaled embedding class) comes for free. What the model's *forward* does around
the layers is listed in HOOKS, the one place per-family differences are declared; the stage
runtime applies each hook that a checkpoint's config switches on.

A family that cannot be split (another layout, modules outside it such as absolute position
embeddings or per-layer inputs, recurrent or linear-attention layers, encoder-decoder or
bidirectional attention) is refused by `refusal`, with the reason, wherever
checkpoint.validate.check_supported runs (plan, serve, the operator's status).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Families the coverage test (tests/test_families.py) checks exact at 1, 2 and 3 stages against
# transformers' generate(). Others with the standard layout are served by the same path
# (docs/families.md lists what the survey found); `inferencemesh models` prints both.
VERIFIED = (
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2",
    "mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "hunyuan_v1_moe", "ministral3", "granite", "cohere",
    "hyperclovax",
)

# The quantized weights served (checkpoint/quantization.py decides; `inferencemesh models` prints
# these, tests/test_quantization_flag.py checks they name every format it serves): format, weights.
QUANTIZED_FORMATS = (
    ("compressed-tensors pack-quantized", "INT4 or INT8, per channel or in groups, symmetric or with zero "
                                          "points (llm-compressor's W4A16, W4A16_ASYM, W8A16)"),
    ("compressed-tensors int-quantized", "INT8, per channel or in groups (W8A16)"),
    ("compressed-tensors float-quantized", "FP8 e4m3, per tensor, channel or block (FP8_DYNAMIC, FP8_BLOCK)"),
    ("compressed-tensors naive-quantized", "INT8 or FP8 unpacked, as float- and int-quantized"),
    ("transformers fp8", "FP8 e4m3, weight_scale_inv per block (DeepSeek-V3 style), dynamic activations"),
    ("awq", "INT4 in groups with zero points, GEMM layout (AutoAWQ)"),
    ("gptq", "INT4 or INT8, v1 and v2, symmetric or not, with or without desc_act (act order)"),
    ("mxfp4", "FP4 blocks with E8M0 scales, gpt-oss's MoE experts"),
    ("--quantization int8, int4, fp8", "a 16-bit checkpoint quantized as the stages load it (spec.model."
                                       "quantization): INT8 per channel, INT4 in groups of 128, FP8 per channel"),
)

# Layer kinds a stage's KV cache and masks implement (config.layer_types).
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}

# More layers than any model has (the deepest public ones have a few hundred): a config beyond it
# is refused before transformers is asked to build it (which would take as long as it is large).
MAX_LAYERS = 4096

# config.logits_scaling divides the logits (Granite, MuP) except in these families, which multiply.
LOGITS_SCALING_MULTIPLIES = {"hyperclovax"}

# Families whose model's forward does something around its layers that no hook here applies:
# refused with the reason rather than served wrong (tools/survey_families.py found them).
FORWARD_NOT_APPLIED = {
    "nanochat": "its model normalises the embeddings (with the final norm) before the first layer",
    "doge": "its attention builds a dynamic mask from a materialised attention mask, which a stage's "
            "causal prefill does not pass",
}


@dataclass(frozen=True)
class Hook:
    """One per-family difference: its name, an example family, what it does, where it is applied,
    and whether a (transformers) config switches it on."""

    name: str
    example: str
    what: str
    where: str  # "runtime" (applied by the stage runtime) or "modules" (inside the family's own classes)
    applies: Callable[[Any], bool]


def _number(config: Any, name: str) -> float | None:
    value = getattr(config, name, None)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _layer_types(config: Any) -> list[str]:
    return list(getattr(config, "layer_types", None) or [])


HOOKS: tuple[Hook, ...] = (
    Hook("embedding_multiplier", "granite", "embeddings x config.embedding_multiplier (in the model's forward)",
         "runtime", lambda c: _number(c, "embedding_multiplier") not in (None, 1.0)),
    Hook("final_logit_softcapping", "gemma2", "logits = tanh(logits / cap) * cap",
         "runtime", lambda c: bool(_number(c, "final_logit_softcapping"))),
    Hook("logit_scale", "cohere", "logits x config.logit_scale", "runtime",
         lambda c: _number(c, "logit_scale") not in (None, 1.0)),
    Hook("logits_scaling", "granite, hyperclovax", "logits / config.logits_scaling (x in the families of "
         "LOGITS_SCALING_MULTIPLIES)", "runtime", lambda c: _number(c, "logits_scaling") not in (None, 1.0)),
    Hook("attention_sinks", "gpt_oss, granite_swa", "a learned sink logit per head beside the keys in the "
         "softmax (the layer passes s_aux): the stage's attention function honours it", "runtime",
         lambda c: c.model_type in ("gpt_oss", "flint", "granite_swa", "granitemoe_swa")),
    Hook("attention_softcapping", "gemma2", "attention scores tanh-capped (attn_logit_softcapping) at the "
         "layer's own scaling: the stage's attention function honours softcap and scaling", "runtime",
         lambda c: bool(_number(c, "attn_logit_softcapping"))),
    Hook("layer_types", "gemma2, gemma3, qwen2", "alternating sliding and global attention (config.layer_types): "
         "a window and mask per layer", "runtime", lambda c: "sliding_attention" in _layer_types(c)),
    Hook("rotary_per_layer_type", "gemma3_text", "one rotary table per layer type (rope_local_base_freq for "
         "sliding layers), chosen per layer", "runtime", lambda c: rotary_takes_layer_type(c)),
    Hook("scaled_embedding", "gemma, gemma2, gemma3_text", "embeddings x sqrt(hidden_size), inside the "
         "family's embedding class", "modules", lambda c: c.model_type.startswith("gemma")),
    Hook("qk_norm", "qwen3, olmo2, gemma3_text", "RMSNorm of queries and keys, inside the attention", "modules",
         lambda c: c.model_type in ("qwen3", "qwen3_moe", "olmo2", "gemma3_text")),
    Hook("fused_projections", "phi3", "one qkv and one gate_up projection, inside the layer", "modules",
         lambda c: c.model_type in ("phi3",)),
    Hook("unit_offset_norm", "gemma", "norms scale by (1 + weight), inside the family's norm class", "modules",
         lambda c: c.model_type.startswith("gemma")),
    Hook("mixture_of_experts", "mixtral, qwen2_moe, qwen3_moe", "routed experts inside the layer; checkpoints "
         "store them per expert and transformers' own conversion fuses them at load", "modules",
         lambda c: bool(getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None))),
)


@dataclass(frozen=True)
class ForwardHooks:
    """What the stage runtime applies around the layers for one config (see HOOKS)."""

    embedding_multiplier: float | None
    logit_multiplier: float | None
    final_softcap: float | None
    rotary_per_layer_type: bool


def forward_hooks(config: Any) -> ForwardHooks:
    scale = _number(config, "logit_scale")
    scaling = _number(config, "logits_scaling") or 1.0
    multiplier = (scale or 1.0) * (scaling if config.model_type in LOGITS_SCALING_MULTIPLIES else 1.0 / scaling)
    embed = _number(config, "embedding_multiplier")
    return ForwardHooks(
        embedding_multiplier=embed if embed not in (None, 1.0) else None,
        logit_multiplier=multiplier if multiplier != 1.0 else None,
        final_softcap=_number(config, "final_logit_softcapping") or None,
        rotary_per_layer_type=rotary_takes_layer_type(config),
    )


def rotary_takes_layer_type(config: Any) -> bool:
    """Whether the family's rotary parameters are per layer type (Gemma3: a local and a global
    base frequency), so that its rotary module is asked once per layer type."""
    rope = getattr(config, "rope_parameters", None)
    return isinstance(rope, dict) and bool(set(rope) & set(_layer_types(config)))


# --------------------------------------------------------------------------- transformers lookups


def causal_lm_class(model_type: str) -> type:
    """transformers' *ForCausalLM class for model_type (KeyError when there is none)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    cls: type = AutoModelForCausalLM._model_mapping[config_cls]  # type: ignore[attr-defined,assignment]
    return cls


def transformers_config(config: dict) -> Any:
    """The transformers config object of a config.json dict."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[config["model_type"]].from_dict(config)


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory, no init) while
    their buffers (rotary frequencies, Gemma's embedding scale: values computed at construction,
    never stored in the checkpoint) are built for real."""
    import torch
    from torch import nn

    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        with torch.device("cpu"), _EmptyOnMeta():
            yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _empty_on_meta_mode() -> Any:
    from torch.overrides import TorchFunctionMode

    class EmptyOnMeta(TorchFunctionMode):
        """torch.empty made on the meta device: an uninitialised tensor is a parameter to be
        loaded (nn.Linear, nn.Embedding, fused experts), never a buffer's computed value, and
        allocating it for real would cost its memory (pages the allocator hands back touched)."""

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            import torch

            kwargs = dict(kwargs or {})
            if func is torch.empty:
                kwargs["device"] = "meta"
            return func(*args, **kwargs)

    return EmptyOnMeta()


class _EmptyOnMeta:
    def __enter__(self) -> None:
        self._mode = _empty_on_meta_mode()
        self._mode.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)


def build_causal_lm(config: Any, *, meta: bool = False) -> Any:
    """The family's *ForCausalLM built from a transformers config, parameters on the meta device
    (and buffers too with meta=True: enough to inspect the layout)."""
    import torch

    cls = causal_lm_class(config.model_type)
    if meta:
        with torch.device("meta"):
            return cls(config)
    with params_on_meta():
        return cls(config)


# --------------------------------------------------------------------------- refusals


def refusal(config: dict) -> str | None:
    """Why a checkpoint of this config.json cannot be split into stages, or None when it can; one
    line (a status condition's message, a log line).

    Decided from the installed transformers (the family's own classes, built on the meta
    device). Where transformers and torch are not installed (the operator's image), from
    FAMILY_TABLE: the same decision recorded per model_type for the transformers release the
    table names, plus the checks a config.json alone answers."""
    why = _decide(config)
    return None if why is None else " ".join(why.split())


def _decide(config: dict) -> str | None:
    if _transformers_installed():
        return _refusal(json.dumps(config, sort_keys=True, default=str))
    table = family_table()
    model_type = config.get("model_type", "")
    if model_type in table["undecided"]:
        return config_refusal(config.get)  # its stages decide, from transformers and the real config
    if model_type not in table["refusals"]:
        return (f"model_type {model_type!r} is not in this release's family table (transformers "
                f"{table['transformers']}; `inferencemesh models` lists the families served)")
    return table["refusals"][model_type] or config_refusal(config.get)


def config_refusal(get: Callable[[str], Any]) -> str | None:
    """What a config says against splitting it, read through get(name) (a config.json dict's
    .get, or a transformers config's attributes): no transformers needed."""
    if get("is_encoder_decoder"):
        return "it is an encoder-decoder model"
    if get("use_bidirectional_attention"):
        return "its attention is bidirectional, not causal"
    layers = get("num_hidden_layers")
    if not isinstance(layers, int) or isinstance(layers, bool):
        return "its config has no num_hidden_layers (not a stack of decoder layers a plan can split)"
    if not 1 <= layers <= MAX_LAYERS:
        return f"num_hidden_layers {layers} is not between 1 and {MAX_LAYERS}"
    other = sorted(set(get("layer_types") or []) - ATTENTION_LAYER_TYPES)
    if other:
        return (f"its layers include {', '.join(other)} (recurrent, linear or chunked attention state a "
                "stage's KV cache does not hold)")
    return None


def _transformers_installed() -> bool:
    import importlib.util

    try:
        return all(importlib.util.find_spec(name) is not None for name in ("torch", "transformers"))
    except ValueError:  # a module blocked in sys.modules (None): as good as absent
        return False


# --------------------------------------------------------------------------- the recorded table

_CANNOT_BUILD = "transformers cannot build it from its config"

TABLE_PATH = Path(__file__).with_name("family_table.json")


@functools.cache
def family_table() -> dict:
    """{"transformers": version, "refusals": {model_type: reason or None}, "undecided": [...]}:
    refusal() of each causal-LM family's default config, recorded by `python -m
    inferencemesh.modeling.families` for the places without transformers (tests/test_families.py
    checks it is current); "undecided": families whose default config builds no model."""
    table: dict = json.loads(TABLE_PATH.read_text())
    return table


def build_family_table() -> dict:
    """refusal() of every model_type of the installed transformers that has a *ForCausalLM,
    from the family's default config."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # default configs of old families warn about their token ids
    refusals: dict[str, str | None] = {}
    undecided: list[str] = []
    try:
        for model_type, config_cls in sorted(CONFIG_MAPPING.items()):
            try:
                causal_lm_class(model_type)
                config = config_cls().to_dict()
            except KeyError:
                continue  # no causal LM: never asked for
            except Exception as err:  # a default config its own class rejects
                refusals[model_type] = f"its default config does not build ({type(err).__name__})"
                continue
            why = _refusal(json.dumps(config, sort_keys=True, default=str))
            if why and why.startswith(_CANNOT_BUILD):
                # A default config that leaves sizes unset (head_dim None) says nothing of the
                # family: a real checkpoint sets them. Not refused here; its stages decide.
                undecided.append(model_type)
            else:
                refusals[model_type] = why
    finally:
        hf_logging.set_verbosity(verbosity)
    return {"transformers": transformers.__version__, "refusals": refusals, "undecided": undecided}


@functools.lru_cache(maxsize=64)
def _refusal(config_json: str) -> str | None:
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    raw = json.loads(config_json)
    model_type = raw.get("model_type", "")
    version = transformers.__version__
    if model_type not in CONFIG_MAPPING:
        return f"model_type {model_type!r} is unknown to the installed transformers {version}"
    try:
        causal_lm_class(model_type)
    except KeyError:
        return f"model_type {model_type!r} has no causal LM (*ForCausalLM) in transformers {version}"
    try:
        config = transformers_config(raw)
    except Exception as err:  # a config transformers itself rejects
        return f"its config.json does not build a {model_type} config ({type(err).__name__}: {err})"
    # The config object, not the raw dict: its class fills in what config.json leaves out
    # (layer_types) and maps the family's own names (n_layer) to the common ones.
    if (why := config_refusal(lambda name: _attr(config, name))) is not None:
        return why
    if model_type in FORWARD_NOT_APPLIED:
        return FORWARD_NOT_APPLIED[model_type]
    if (why := cache_refusal(config)) is not None:
        return why
    try:
        model = build_causal_lm(config, meta=True)
    except Exception as err:
        return f"{_CANNOT_BUILD} ({type(err).__name__}: {err})"
    return layout_refusal(model, config)


def _attr(config: Any, name: str) -> Any:
    """config.name, or None where it has none (a heterogeneous config raises for a per-layer
    attribute read globally: its layers are checked one by one later)."""
    try:
        return getattr(config, name, None)
    except Exception:
        return None


def cache_refusal(config: Any) -> str | None:
    """Why a stage's KV cache (keys and values of num_key_value_heads x head_dim in every layer,
    rotated by one rotary table per layer type) cannot hold what this family's layers cache."""
    if _attr(config, "kv_lora_rank"):
        return ("its layers use multi-head latent attention and cache a compressed latent (kv_lora_rank), not "
                "keys and values of num_key_value_heads x head_dim")
    head_dim = _attr(config, "head_dim") or _attr(config, "qk_head_dim")
    v_head_dim = _attr(config, "v_head_dim")
    if v_head_dim and head_dim and v_head_dim != head_dim:
        return f"its values are {v_head_dim} wide and its keys {head_dim}; a stage caches both at one width"
    rope = _attr(config, "rope_parameters")
    if isinstance(rope, dict) and any(rope.get(kind, {}) is None for kind in _layer_types(config)):
        return "some of its layer types have no rotary embedding (positions reach them another way)"
    return None


def layout_refusal(model: Any, config: Any) -> str | None:
    """Why a built *ForCausalLM is not embed -> layers -> norm -> head, or None."""
    from torch import nn

    if getattr(model, "base_model_prefix", None) != "model" or not isinstance(getattr(model, "model", None),
                                                                             nn.Module):
        prefix = getattr(model, "base_model_prefix", "?")
        return f"not the standard layout: its decoder is model.{prefix}, not model.model"
    base = model.model
    missing = [n for n in ("embed_tokens", "layers", "norm") if not isinstance(getattr(base, n, None), nn.Module)]
    if missing or not isinstance(getattr(model, "lm_head", None), nn.Linear):
        missing += [] if isinstance(getattr(model, "lm_head", None), nn.Linear) else ["lm_head"]
        return f"not the standard layout (embed_tokens, layers, norm, lm_head): it lacks {', '.join(missing)}"
    if not isinstance(base.embed_tokens, nn.Embedding) or not isinstance(base.layers, nn.ModuleList):
        return "not the standard layout: embed_tokens is not an embedding or layers is not a list of layers"
    if len(base.layers) != config.num_hidden_layers:
        return f"its model holds {len(base.layers)} layers for num_hidden_layers={config.num_hidden_layers}"
    extra = sorted(name for name, child in base.named_children()
                   if name not in ("embed_tokens", "layers", "norm", "rotary_emb")
                   and any(True for _ in child.parameters()))
    if extra:
        return (f"its model has weights outside embed/layers/norm ({', '.join(extra)}): state shared across "
                "layers or inputs a stage does not pass on")
    extra_top = sorted(name for name, child in model.named_children() if name not in ("model", "lm_head")
                       and any(True for _ in child.parameters()))
    if extra_top:
        return f"its causal LM has weights beside the model and the head ({', '.join(extra_top)})"
    if not isinstance(getattr(base, "rotary_emb", None), nn.Module):
        return "it has no rotary embedding module (absolute or learned positions, or rotary inside each layer)"
    key_projections = [getattr(getattr(layer, "self_attn", None), "k_proj", None) for layer in base.layers]
    kv_widths = {proj.out_features for proj in key_projections if isinstance(proj, nn.Linear)}
    if len(kv_widths) > 1:
        return ("its layers hold keys of different widths (different numbers of key/value heads per layer type); "
                "a stage caches the same width in every layer")
    params = inspect.signature(type(base.layers[0]).forward).parameters
    if "position_embeddings" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return "its decoder layers do not take rotary position_embeddings"
    return None


if __name__ == "__main__":  # python -m inferencemesh.modeling.families: record FAMILY_TABLE
    TABLE_PATH.write_text(json.dumps(build_family_table(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {TABLE_PATH}")
