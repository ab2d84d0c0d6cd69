"""Decoder layers of the Llama shape run in as few tensor operations as their math takes.

A decode step runs every layer on one row, so on a small model the time of a token is mostly
host work: transformers' layer calls about 200 Python functions per layer (module calls and their
hooks, keyword plumbing, the attention registry, rotate_half twice, config lookups) around a dozen
kernels. A LeanLayer computes the same layer from the same modules' weights with one projection
for queries, keys and values, one for gate and up (their weights concatenated once at load, and
on a CPU packed for its matmul kernel), rotary applied to queries and keys together, and the
stage's own cache and attention (kv_pool, attention.stage_attention) as transformers' layer calls them;
on a CPU, where the runtime hands it a pass's frames in the pool (kv_pool.PagedFrames), attention for
every session in one native call over their block tables (native_kernels.paged_attention).

It covers the layers whose structure it knows exactly (LEAN_LAYERS: pre-norm RMSNorm, rotary,
grouped-query attention without soft-capping or sinks, a gated SiLU MLP; Qwen3's per-head
query/key norms) and is adopted only after computing the same output as transformers' layer on
a probe input (`lean_layers`); any other layer, or one that differs, stays transformers'. Float
results differ from transformers' only by summation order (the fused projections).

The row-wise parts (norms, projections, rotary, MLP) are pure tensor functions of their inputs;
what compiling a whole step of them would give on the CPU is measured in docs/design/decode-hot-path.md.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from inferencemesh.modeling import native_kernels
from inferencemesh.modeling.attention import KVSpans, PackedAttention, attend, stage_attention
from inferencemesh.modeling.kv_pool import PagedFrames
from inferencemesh.modeling.packed import PackedLinear, packs_weight
from inferencemesh.modeling.positions import sliding_window
from inferencemesh.modeling.quantized_fused import fused_outputs

log = logging.getLogger(__name__)

# transformers' decoder layer classes whose forward is exactly the pre-norm Llama layer (Qwen3's
# with a per-head RMSNorm of queries and keys before rotary).
LEAN_LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"})
LEAN_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
PROBE_TOKENS = 3
PROBE_TOLERANCE = 1e-4  # relative to the output's scale: summation order, not a different layer
# In 16-bit, one rounding of the output is already 2**-8 (bfloat16) of its scale, and a GPU's
# matmuls pick kernels (split-K, tiles) by the fused width, so the sums round differently: the
# tolerance there is a few of the dtype's epsilons; a different layer differs by whole units.
PROBE_EPSILONS = 4


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: computed in float32, scaled in the input's dtype (a float32 decode
    row on a CPU in one native call: 1.5 against 7 us)."""
    if x.dtype == torch.float32:
        native = native_kernels.rms_norm(x, weight, eps)
        return native if native is not None else torch.nn.functional.rms_norm(x, weight.shape, weight, eps)
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


class LeanNorm:
    """A final RMSNorm of the Llama shape (LEAN_NORMS) as one fused call (transformers' takes five)."""

    def __init__(self, norm: Any) -> None:
        self.weight, self.eps = norm.weight.detach(), float(norm.variance_epsilon)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.weight, self.eps)


def lean_norm(norm: Callable[[torch.Tensor], torch.Tensor] | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The model's final norm, lean where it is one of LEAN_NORMS, else as it is."""
    if norm is not None and type(norm).__name__ in LEAN_NORMS:
        return LeanNorm(norm)
    return norm


@functools.cache
def _half_signs(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[-1] * (size / 2) + [1] * (size / 2), made once per shape."""
    with torch.inference_mode(False):  # a normal tensor, usable in and out of inference mode
        sign = torch.ones(size, dtype=dtype, device=device)
        sign[: size // 2] = -1
    return sign


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: rotate_half(x) x sin = roll(x, D / 2) x this, bit for bit
    (negation is exact), in one roll instead of two slices, a negation and a cat."""
    return sin * _half_signs(sin.shape[-1], sin.dtype, sin.device)


class Rotary(NamedTuple):
    """A forward's rotary factors as the lean layers apply them, made once for all of its layers
    (three operations a layer saved): cos and _signed_sin(sin), [1, T, 1, D] (over every head)."""

    cos: torch.Tensor
    signed_sin: torch.Tensor


def rotary(rope: tuple[torch.Tensor, torch.Tensor]) -> Rotary:
    """The lean layers' factors of a rotary table's (cos, sin) [1, T, D]."""
    cos, sin = rope
    return Rotary(cos.unsqueeze(2), _signed_sin(sin.unsqueeze(2)))


def rotaries_of(ropes: dict[str | None, tuple[torch.Tensor, torch.Tensor]]) -> dict[str | None, Rotary]:
    """rotary() of each rotary table's (cos, sin) of a forward."""
    return {key: rotary(rope) for key, rope in ropes.items()}


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary (the half-split form transformers' Llama uses): x [1, T, heads, D], cos and
    _signed_sin(sin) [1, T, 1, D]; 6.7 against 10 us for transformers' form of one decode row."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class _Projection:
    """Several linear layers of one input as one matmul: their weights concatenated once, output
    features after output features, and on a CPU packed for its kernel (packed.py); quantized ones
    in their own layout (quantized_fused.py). Modules that cannot be joined run in turn."""

    def __init__(self, parent: nn.Module, names: Sequence[str]) -> None:
        self.parent, self.names = parent, list(names)
        modules = [getattr(parent, name) for name in names]
        self.sizes = [int(m.out_features) for m in modules]
        self.modules: list[Any] = modules
        self.fused: nn.Module | None = None
        weights = [m.weight for m in modules if type(m) is nn.Linear]
        if len(weights) == len(modules) and len({(w.dtype, w.device) for w in weights}) == 1:
            if len(weights) == 1:
                weight = weights[0].detach()
            else:  # the parts' own weights are dropped once joined: loading holds two copies, not three
                weight = torch.cat([w.detach() for w in weights])
                for module in modules:
                    module.weight = None
            del weights
            bias = _fused_bias(modules, weight)
            if packs_weight(weight):
                self.fused = PackedLinear(weight, bias)
            elif len(modules) > 1:
                self.fused = _Fused(weight, bias)
            # else: the module itself is the fused matmul
        else:
            self.fused = fused_outputs(modules)  # quantized ones, in their layout, where it allows
        if self.fused is not None:
            self.modules = []  # the fused matmul serves
            self._take_their_places()

    def _take_their_places(self) -> None:
        """The fused matmul takes the modules' places in their layer at once (a module of several
        becomes a slice of its output: the layer's transformers forward still works, slower), so
        the stage holds each weight once, and loading holds one projection's weights twice at a
        time, never a layer's."""
        if self.fused is None:
            return
        if len(self.names) == 1:
            setattr(self.parent, self.names[0], self.fused)
            return
        start = 0
        for name, size in zip(self.names, self.sizes, strict=True):
            setattr(self.parent, name, _OutputSlice(self.fused, start, size))
            start += size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.forward(x)  # not through nn.Module's call: no hooks here, a token's Python less
        if len(self.modules) == 1:
            return self.modules[0](x)
        return torch.cat([m(x) for m in self.modules], dim=-1)


def _fused_bias(modules: Sequence[nn.Linear], weight: torch.Tensor) -> torch.Tensor | None:
    biases = [m.bias for m in modules]
    if all(b is None for b in biases):
        return None
    return torch.cat([b.detach() if b is not None else weight.new_zeros(int(m.out_features))
                      for b, m in zip(biases, modules, strict=True)])


class _Fused(nn.Module):
    """x W^T + b over concatenated weights where no packed form is faster (a GPU's, say)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.fused_bias = weight, bias
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.fused_bias)


class _OutputSlice(nn.Module):
    """One of several fused linear layers, left in its layer's place: the fused matmul's columns
    [start, start + size)."""

    def __init__(self, fused: nn.Module, start: int, size: int) -> None:
        super().__init__()
        self.fused, self.start, self.out_features = fused, start, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)[..., self.start:self.start + self.out_features]


@dataclass(frozen=True)
class _Shape:
    heads: int
    kv_heads: int
    head_dim: int


class LeanLayer:
    """One transformers decoder layer of the Llama shape, computed lean (see the module docstring).
    Holds its layer's modules: their weights are shared, not copied, except the fused projections."""

    def __init__(self, layer: Any) -> None:  # a transformers decoder layer (its submodules read by name)
        attn, mlp = layer.self_attn, layer.mlp
        self.attn: Any = attn  # stage_attention reads its scaling and grouping, transformers-style
        self.layer_idx = int(attn.layer_idx)
        self.shape = _Shape(attn.config.num_attention_heads, attn.config.num_key_value_heads, int(attn.head_dim))
        self.scaling = float(attn.scaling)
        self.input_norm = (layer.input_layernorm.weight.detach(), float(layer.input_layernorm.variance_epsilon))
        self.post_norm = (layer.post_attention_layernorm.weight.detach(),
                          float(layer.post_attention_layernorm.variance_epsilon))
        self.head_norms = None
        if hasattr(attn, "q_norm"):  # Qwen3
            self.head_norms = ((attn.q_norm.weight.detach(), float(attn.q_norm.variance_epsilon)),
                               (attn.k_norm.weight.detach(), float(attn.k_norm.variance_epsilon)))
        # Each projection takes its modules' places as it is made: the layer's own forward then
        # computes through them (the same products), whether or not the lean form is adopted.
        self.qkv = _Projection(attn, ["q_proj", "k_proj", "v_proj"])
        self.gate_up = _Projection(mlp, ["gate_proj", "up_proj"])
        self.o_proj = _Projection(attn, ["o_proj"])
        self.down_proj = _Projection(mlp, ["down_proj"])
        self.gqa = self.shape.heads != self.shape.kv_heads
        self.window = sliding_window(attn.config, self.layer_idx)  # the native attention's; masks carry sdpa's
        self.mlp: Any = mlp

    def pre_attention(self, x: torch.Tensor, rot: Rotary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [1, T, H] -> queries [1, T, heads, D], keys and values [1, T, kv_heads, D], rotated (views
        of the fused projection where they can be)."""
        s = self.shape
        count = x.shape[1]
        qkv = self.qkv(_rms_norm(x, *self.input_norm)).view(1, count, s.heads + 2 * s.kv_heads, s.head_dim)
        cos, sin = rot
        # split_with_sizes: torch.split's Python wrapper costs more than the split (0.9 against 2.3 us)
        if self.head_norms is None:  # queries and keys rotated as one tensor
            qk, v = qkv.split_with_sizes((s.heads + s.kv_heads, s.kv_heads), dim=2)
            q, k = _rotate(qk, cos, sin).split_with_sizes((s.heads, s.kv_heads), dim=2)
        else:
            q, k, v = qkv.split_with_sizes((s.heads, s.kv_heads, s.kv_heads), dim=2)
            q = _rotate(_rms_norm(q, *self.head_norms[0]), cos, sin)
            k = _rotate(_rms_norm(k, *self.head_norms[1]), cos, sin)
        return q, k, v

    def post_attention(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The residual stream after attention's output [1, T, heads * D] and the MLP."""
        x = x + self.o_proj(attended)
        gate, up = self.gate_up(_rms_norm(x, *self.post_norm)).split_with_sizes(self.gate_up.sizes, dim=-1)
        return x + self.down_proj(torch.nn.functional.silu(gate) * up)

    def __call__(self, x: torch.Tensor, rot: Rotary, mask: torch.Tensor | None, cache: object | None,
                 paged: PagedFrames | None = None) -> torch.Tensor:
        """What the transformers layer returns for these arguments (its cache updated alike; rot:
        rotary() of the rotary table's (cos, sin) it is given). paged: the pass's frames in cache, for
        the native attention over their block tables (the runtime's choice)."""
        q, k, v = self.pre_attention(x, rot)
        if paged is not None:  # every session at once, its keys and values read where they lie
            out = native_kernels.paged_attention(q, k, v, paged.layer(self.layer_idx), paged.pool.block_tokens,
                                                 paged.tables, paged.frames, self.scaling, self.window)
            return self.post_attention(x, out.to(x.dtype))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [1, heads, T, D], as attention takes
        keys, values = cache.update(k, v, self.layer_idx) if cache is not None else (k, v)  # type: ignore[attr-defined]
        if isinstance(keys, PackedAttention):  # a batched pass: each session over its own cache
            out, _ = stage_attention(self.attn, q, keys, values, mask, scaling=self.scaling)
            out = out.reshape(1, x.shape[1], -1)
        else:
            kv_dtype = keys.keys[0].dtype if isinstance(keys, KVSpans) else keys.dtype
            out = attend(q.to(kv_dtype), keys, values, mask, self.scaling, self.gqa).to(x.dtype)
            out = out.transpose(1, 2).reshape(1, x.shape[1], -1)
        return self.post_attention(x, out)


def lean_layers(layers: Sequence[nn.Module], rope: Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]
                ) -> list[LeanLayer | None]:
    """A LeanLayer for each layer it covers and computes alike (checked on a probe input against
    what the layer computed before its projections were fused), else None: the layer stays
    transformers'. rope(x, start, count): the runtime's rotary tables for positions [start, start + count)."""
    out: list[LeanLayer | None] = []
    for layer in layers:
        lean = None
        if type(layer).__name__ in LEAN_LAYERS and _plain_attention(layer):
            try:
                probe = Probe.of(layer, rope)
                lean = LeanLayer(layer)
                if not probe.same_output(lean):
                    lean = None
            except Exception as err:  # a layer this form cannot take (its linears' kind): transformers' runs it
                log.warning("layer %s runs as transformers' layer: the lean form failed on it: %r",
                            type(layer).__name__, err)
                lean = None
        out.append(lean)
    return out


def _plain_attention(layer: nn.Module) -> bool:
    """No softcap, sinks or sliding window the lean call would miss (the masks come from the runtime
    either way; these are read by transformers' attention from the module or its config)."""
    attn = getattr(layer, "self_attn", None)
    mlp = getattr(layer, "mlp", None)
    if attn is None or mlp is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return False
    if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        return False
    config = attn.config
    act = getattr(config, "hidden_act", "silu")
    return act in ("silu", "swish") and getattr(attn, "sinks", None) is None and not getattr(
        config, "attn_logit_softcapping", None)


@dataclass(frozen=True)
class Probe:
    """A probe input and what a transformers layer computes for it."""

    x: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor]
    theirs: torch.Tensor

    @classmethod
    @torch.inference_mode()
    def of(cls, layer: Any, rope: Callable) -> Probe:  # (a transformers decoder layer: read by name)
        weight = layer.input_layernorm.weight
        x = torch.randn(1, PROBE_TOKENS, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight)
        cos, sin = rope(x, 0, PROBE_TOKENS)
        positions = torch.arange(PROBE_TOKENS, device=x.device)[None]
        theirs = layer(x, attention_mask=None, position_ids=positions, use_cache=False, position_embeddings=(cos, sin))
        return cls(x, (cos, sin), theirs[0] if isinstance(theirs, tuple) else theirs)

    @torch.inference_mode()
    def same_output(self, lean: LeanLayer) -> bool:
        """Whether `lean` computes what the layer did, within summation order (see PROBE_TOLERANCE)."""
        ours = lean(self.x, rotary(self.rope), None, None)
        scale = float(self.theirs.float().abs().max()) or 1.0
        error = float((ours.float() - self.theirs.float()).abs().max()) / scale
        if error > max(PROBE_TOLERANCE, PROBE_EPSILONS * torch.finfo(self.x.dtype).eps):
            log.warning("layer %d computed lean differs from transformers' by %.2e: it runs as transformers' layer",
                        lean.layer_idx, error)
            return False
        return True
