"""The draft model: a whole small decoder in the frontend process, run in one of two forms.

The draft runs every family the stages run. Its general form is the stage runtime itself over
all the layers (modeling/runtime.py: the family's own decoder layers, hooks and KV cache), so a
family added to the stages is a draft family too, with nothing written twice.

A draft step pushes one token through a small model, so on CPU its cost is framework overhead,
not arithmetic. For the Llama layout (separate q/k/v/o and gate/up/down projections, RMSNorms
before attention and MLP, SiLU, optional q/k norms and biases, no forward hooks: Llama, Mistral,
Qwen2, Qwen3 and their kind) there is also a lean forward: fused QKV and gate/up projections on
weights laid out once for the matmul, rotary from a table, keys and values written in place,
about fifteen tensor ops per layer. Measured on the bundled 2-layer draft (AVX2, float32): 0.80 ms
per step at batch 1 against 1.47 ms through the stage runtime, 2.6 against 3.8 ms at batch 8. It
is used only for those families' layers (LEAN_LAYERS) and only where it reproduces the general
form's logits on a probe at load (a rotary or norm it does not compute falls back), and the
draft only steers speculation: the target verifies every token, and with sampling the
draft's exact probabilities travel with the window.

Weights come through the stage loader (safetensors only, same family checks); on CPU the draft
computes in float32, which runs single-row matmuls of this size faster than bfloat16.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from inferencemesh.checkpoint.read import read_checkpoint
from inferencemesh.modeling import decode_graphs
from inferencemesh.modeling.families import forward_hooks
from inferencemesh.modeling.kv import SessionKV
from inferencemesh.modeling.kv_pool import BlockTableKV
from inferencemesh.modeling.loader import StageModules, load_stage
from inferencemesh.modeling.positions import attention_mask, rope_table, sliding_window
from inferencemesh.modeling.quantized import QuantizedLinear
from inferencemesh.modeling.runtime import Segment, StageRuntime
from inferencemesh.protocol.transport import KV_BLOCK_TOKENS
from inferencemesh.speculation import draft_dtype

log = logging.getLogger("inferencemesh.speculative")

_GROWTH = 256  # cache positions added at a time
DRAFT_KV_CONTEXTS = 16  # the GPU form's pool: this many requests at max_context at once (more run eagerly)


@dataclass
class _Layer:
    eps: float
    in_norm: torch.Tensor
    qkv: torch.Tensor  # [hidden, (heads + 2 kv_heads) * head_dim]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3: RMSNorm over each head
    k_norm: torch.Tensor | None
    o: torch.Tensor  # [heads * head_dim, hidden]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [hidden, 2 * intermediate]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [intermediate, hidden]
    down_bias: torch.Tensor | None
    window: int | None


def _t(linear: torch.nn.Linear, dtype: torch.dtype) -> torch.Tensor:
    return linear.weight.detach().to(dtype).t().contiguous()


def _cat_bias(*linears: torch.nn.Linear, dtype: torch.dtype) -> torch.Tensor | None:
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([lin.bias.detach().to(dtype) if lin.bias is not None
                      else torch.zeros(lin.out_features, dtype=dtype, device=lin.weight.device) for lin in linears])


def _bias(linear: torch.nn.Linear, dtype: torch.dtype) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach().to(dtype)


class DraftCache:
    """One request's draft KV for the lean forward: keys and values [layers, kv_heads, capacity,
    head_dim], grown as needed."""

    def __init__(self, model: _LeanForward) -> None:
        self.model = model
        self.length = 0  # positions held
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def reserve(self, stop: int) -> None:
        capacity = 0 if self.k is None else self.k.shape[2]
        if stop <= capacity:
            return
        m = self.model
        size = min(m.max_context, max(stop, capacity + _GROWTH, 2 * capacity))
        shape = (len(m.layers), m.kv_heads, size, m.head_dim)
        k = torch.empty(shape, dtype=m.dtype, device=m.device)
        v = torch.empty(shape, dtype=m.dtype, device=m.device)
        if self.k is not None and self.v is not None:
            k[:, :, : self.length] = self.k[:, :, : self.length]
            v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values, once reserve() has made room for them."""
        assert self.k is not None and self.v is not None, "the draft cache is used before reserve()"
        return self.k, self.v

    def forget(self) -> None:
        """Hold nothing (the next feed starts at position 0); the buffers stay for reuse."""
        self.length = 0

    def release(self) -> None:
        self.k = self.v = None
        self.length = 0


class _StageCache:
    """One request's draft KV for the stage-runtime form: a stage session's cache."""

    def __init__(self, kv: SessionKV) -> None:
        self.kv = kv

    @property
    def length(self) -> int:
        return self.kv.length

    def forget(self) -> None:
        self.kv.truncate(0)

    def release(self) -> None:
        self.kv.release()


class _DraftBlocks:
    """The draft's KV pool on a GPU and its free blocks: the stage's pool and block tables, so the
    draft's steps run through the stage runtime's decode graphs (modeling/decode_graphs.py)."""

    def __init__(self, runtime: StageRuntime, max_context: int) -> None:
        self.block_tokens = KV_BLOCK_TOKENS
        self.most = -(-max_context // KV_BLOCK_TOKENS)  # blocks a request can hold
        self.pool = runtime.new_pool(DRAFT_KV_CONTEXTS * self.most, KV_BLOCK_TOKENS, decode_graphs=True)
        self.free = list(range(self.pool.num_blocks - 1, -1, -1))
        self.runtime = runtime

    def new_cache(self) -> _PoolCache | _StageCache:
        """A cache over the pool's blocks while they last, else one of its own (eager)."""
        if len(self.free) < self.most:
            return _StageCache(self.runtime.new_session())
        return _PoolCache(self)


class _PoolCache:
    """One request's draft KV as a block table over the draft's pool: max_context's blocks, taken
    when the request starts (so a step never finds the pool full) and given back by release()."""

    def __init__(self, blocks: _DraftBlocks) -> None:
        self.owner = blocks
        self.table = [blocks.free.pop() for _ in range(blocks.most)]
        self.length = 0

    def frame(self, pos_start: int, count: int) -> BlockTableKV:
        return BlockTableKV(self.owner.pool, self.table, pos_start, count)

    def forget(self) -> None:
        self.length = 0

    def release(self) -> None:
        self.owner.free.extend(reversed(self.table))
        self.table = []
        self.length = 0


Cache = DraftCache | _StageCache | _PoolCache


# The decoder layers the lean forward computes. A family whose layers read alike may still
# compute otherwise where a short probe cannot see it (Ministral3 scales queries by position
# beyond its original context), so the lean form is for these, and only where the probe agrees.
LEAN_LAYERS = {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"}


class NotLean(Exception):
    """The family's layers are not the Llama layout the lean forward computes."""


# Logits of the probe that picks the form: the lean forward must agree with the stage runtime
# to within this fraction of the logits' scale (float32 summation order differs; a family the
# lean forward does not compute differs by whole units).
PROBE_TOLERANCE_FLOAT32 = 1e-3
PROBE_TOLERANCE_16BIT = 5e-2


class DraftModel:
    """A small model of any family the stages serve, run whole in this process to propose tokens."""

    def __init__(self, source: str, *, dtype: str = "auto", device: str = "auto", max_context: int = 2048,
                 vocab_size: int | None = None, form: str = "auto") -> None:
        """vocab_size: the target's (its padded embedding size), which the draft's logits are fitted
        to: a checkpoint family's small and large models may pad their embeddings differently (as
        Qwen2.5's do) while sharing the tokenizer, and the stages verify distributions of the
        target's width. Rows the target lacks are dropped (nothing can propose them); rows the
        draft lacks get -inf (it never proposes them). None: the draft's own size.
        form: "auto" (lean where it agrees with the stage runtime), "lean" (refused where it
        cannot be) or "stage" (the stage runtime): see the module docstring."""
        if form not in ("auto", "lean", "stage", "graphs"):
            raise ValueError(f"draft form must be auto, lean, stage or graphs, not {form!r}")
        facts = read_checkpoint(source)
        on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
        stage = load_stage(source, 0, facts.num_layers, dtype=draft_dtype(dtype, on_cpu) or dtype, device=device)
        self.source = source
        self.dtype, self.device = stage.dtype, stage.device
        self.max_context = max_context
        self.embedding_rows = facts.vocab_size  # token ids the draft can read
        self.vocab_size = vocab_size or facts.vocab_size  # the width of its logits
        self._missing_rows = max(0, self.vocab_size - self.embedding_rows)
        lean: _LeanForward | None = None
        why = "asked for the stage runtime"
        # On a GPU a step is launches, not arithmetic: the stage runtime's decode graphs over a pool.
        graphs = form == "graphs" or (form == "auto" and decode_graphs.wanted(self.device))
        if form != "stage" and not graphs:
            try:
                lean = _LeanForward(stage, max_context, self.vocab_size)
            except NotLean as err:
                why = str(err)
        # The stage runtime over every layer: the general form, and the reference the lean one is
        # checked against (built after the lean form: it lays the layers' weights out anew).
        runtime = StageRuntime(source, 0, facts.num_layers, max_context=max_context, modules=stage)
        self._blocks = _DraftBlocks(runtime, max_context) if graphs and (
            form == "graphs" or decode_graphs.covers(runtime)) else None
        if graphs and self._blocks is None:
            why = "its layers are not ones the decode graphs compute"
        if lean is not None and form == "auto":
            disagreement = _disagreement(lean, runtime)
            if disagreement is not None:
                lean, why = None, disagreement
        if lean is None and form == "lean":
            raise ValueError(f"the lean draft forward cannot run {source}: {why}")
        self.form = "lean" if lean is not None else "graphs" if self._blocks is not None else "stage"
        self._lean = lean
        self._runtime = None if lean is not None else runtime
        del runtime, stage
        if self.form == "graphs":
            why = "its steps as the stage runtime's decode graphs"
        log.info("draft %s (%s) runs %s", source, facts.model_type,
                 "the lean forward" if self.form == "lean" else f"through the stage runtime ({why})")

    def new_cache(self) -> Cache:
        if self._lean is not None:
            return DraftCache(self._lean)
        if self._blocks is not None:
            return self._blocks.new_cache()
        assert self._runtime is not None  # one form or the other
        return _StageCache(self._runtime.new_session())

    def forward(self, cache: Cache, pos_start: int, token_ids: list[int]) -> torch.Tensor:
        """Feed token_ids at positions [pos_start, ...) (the cache is truncated to pos_start
        first, as on the stages); returns float32 logits [vocab] of the last position only."""
        return self.forward_packed([(cache, pos_start, token_ids)])[0]

    @torch.inference_mode()
    def forward_packed(self, feeds: list[tuple[Cache, int, list[int]]]) -> list[torch.Tensor]:
        """forward() for several requests in one pass: their tokens share the matmuls, each
        attends over its own cache. Per feed, float32 logits [vocab] of its last position."""
        for cache, pos_start, token_ids in feeds:
            stop = pos_start + len(token_ids)
            if not token_ids or not 0 <= pos_start <= cache.length or stop > self.max_context:
                raise ValueError(f"draft positions [{pos_start}, {stop}) with {cache.length} cached "
                                 f"and max_context {self.max_context}")
        if self._lean is not None:
            logits = self._lean.forward_packed(feeds)  # type: ignore[arg-type]  # lean caches
        else:
            assert self._runtime is not None
            segments = [Segment(cache.frame(pos_start, len(token_ids)) if isinstance(cache, _PoolCache)
                                else cache.kv, pos_start, torch.tensor(token_ids), "last")  # type: ignore[union-attr]
                        for cache, pos_start, token_ids in feeds]
            rows = self._runtime.forward_batch(segments)
            for cache, pos_start, token_ids in feeds:
                if isinstance(cache, _PoolCache):
                    cache.length = pos_start + len(token_ids)
            logits = torch.cat([row for row in rows if row is not None])[:, : self.vocab_size]
        if self._missing_rows:
            logits = F.pad(logits, (0, self._missing_rows), value=float("-inf"))
        return list(logits)


def _disagreement(lean: _LeanForward, runtime: StageRuntime) -> str | None:
    """Why the lean forward is not this model (its logits on a probe differ from the stage
    runtime's), or None: a prefill and two single steps, compared at every step."""
    probe = [(7 + 31 * i) % lean.embedding_rows for i in range(10)]
    cache, kv = DraftCache(lean), runtime.new_session()
    worst, scale = 0.0, 1.0
    for start, stop in ((0, 8), (8, 9), (9, 10)):
        ours = lean.forward_packed([(cache, start, probe[start:stop])])[0]
        theirs = runtime.forward(kv, start, token_ids=torch.tensor(probe[start:stop]))
        assert theirs is not None  # the whole model ends in its head
        theirs = theirs[-1, : ours.shape[0]]
        worst = max(worst, float((ours - theirs).abs().max()))
        scale = max(scale, float(theirs.abs().max()))
    cache.release()
    tolerance = (PROBE_TOLERANCE_FLOAT32 if lean.dtype == torch.float32 else PROBE_TOLERANCE_16BIT) * scale
    if not worst <= tolerance:  # (NaN disagrees too)
        return f"the lean forward's logits differ from the family's own by {worst:.3g} (scale {scale:.3g})"
    return None


class _LeanForward:
    """The hand-fused forward for the Llama layout (see the module docstring)."""

    def __init__(self, stage: StageModules, max_context: int, vocab_size: int) -> None:
        config: Any = stage.config  # a transformers PretrainedConfig, read by attribute
        layer_class = type(stage.layers[0]).__name__ if len(stage.layers) else ""
        if layer_class not in LEAN_LAYERS:
            raise NotLean(f"its layers ({layer_class}) are not ones the lean forward computes")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise NotLean(f"activation {config.hidden_act!r} (the lean forward computes SiLU)")
        hooks = forward_hooks(config)
        if hooks != type(hooks)(None, None, None, False) or getattr(config, "attn_logit_softcapping", None):
            raise NotLean("the family's forward adds hooks around the layers (modeling/families.py)")
        if any(isinstance(m, QuantizedLinear) for m in stage.layers.modules()):
            raise NotLean("its layers are quantized (the stage runtime computes them)")
        facts = stage.facts
        self.dtype, self.device = stage.dtype, stage.device
        self.max_context = max_context
        self.embedding_rows = facts.vocab_size
        self.hidden_size = facts.hidden_size
        self.heads, self.kv_heads = int(config.num_attention_heads), facts.num_kv_heads
        self.head_dim = int(getattr(config, "head_dim", None) or facts.head_dim)
        assert stage.embed is not None and stage.norm is not None and stage.lm_head is not None  # the whole model
        try:
            self.layers = [self._layer(config, layer, index) for index, layer in enumerate(stage.layers)]
            final_norm: Any = stage.norm  # the family's RMSNorm module
            self.norm, self.norm_eps = final_norm.weight.detach().to(self.dtype), float(final_norm.variance_epsilon)
        except AttributeError as err:  # a module the Llama layout has and this family's lacks
            raise NotLean(f"its layers are not the Llama layout ({err})") from err
        tied = stage.lm_head.weight is stage.embed.weight
        # [hidden, vocab], cut to the target's width once here rather than per step.
        self.head = _t(stage.lm_head, self.dtype)[:, :vocab_size].contiguous()
        # A tied embedding is read from the head's columns rather than held twice (when the
        # head keeps every row the embedding has).
        keep_embedding = not tied or self.head.shape[1] < self.embedding_rows
        self.embedding = stage.embed.weight.detach().to(self.dtype) if keep_embedding else None
        self.rotary = stage.rotary
        table = rope_table(config, stage.rotary, max_context, self.dtype, self.device)
        half = self.head_dim // 2
        # rotate_half(x) * sin == roll(x, half) * (sin with its first half negated)
        sign = torch.cat([-torch.ones(half), torch.ones(self.head_dim - half)]).to(self.dtype).to(self.device)
        self.sign = sign
        self.cos: torch.Tensor | None = None
        self.sin_signed: torch.Tensor | None = None
        if table is not None:
            cos, sin = table
            self.cos, self.sin_signed = cos[0, :, None, :], (sin * sign)[0, :, None, :]  # [positions, 1, head_dim]

    def _layer(self, config: Any, layer: Any, index: int) -> _Layer:
        # (layer: a transformers decoder layer of the family's layout; its parts are read by name)
        attn, mlp, dt = layer.self_attn, layer.mlp, self.dtype
        q_norm = getattr(attn, "q_norm", None)
        k_norm = getattr(attn, "k_norm", None)
        return _Layer(
            eps=layer.input_layernorm.variance_epsilon,
            in_norm=layer.input_layernorm.weight.detach().to(dt),
            qkv=torch.cat([_t(attn.q_proj, dt), _t(attn.k_proj, dt), _t(attn.v_proj, dt)], dim=1).contiguous(),
            qkv_bias=_cat_bias(attn.q_proj, attn.k_proj, attn.v_proj, dtype=dt),
            q_norm=None if q_norm is None else q_norm.weight.detach().to(dt),
            k_norm=None if k_norm is None else k_norm.weight.detach().to(dt),
            o=_t(attn.o_proj, dt),
            o_bias=_bias(attn.o_proj, dt),
            post_norm=layer.post_attention_layernorm.weight.detach().to(dt),
            gate_up=torch.cat([_t(mlp.gate_proj, dt), _t(mlp.up_proj, dt)], dim=1).contiguous(),
            gate_up_bias=_cat_bias(mlp.gate_proj, mlp.up_proj, dtype=dt),
            down=_t(mlp.down_proj, dt),
            down_bias=_bias(mlp.down_proj, dt),
            window=sliding_window(config, index),
        )

    @torch.inference_mode()
    def forward_packed(self, feeds: list[tuple[DraftCache, int, list[int]]]) -> torch.Tensor:
        """DraftModel.forward_packed in this form: float32 logits [feeds, head width]."""
        counts = [len(token_ids) for _, _, token_ids in feeds]
        for (cache, pos_start, _), count in zip(feeds, counts, strict=True):
            cache.reserve(pos_start + count)  # positions checked by DraftModel.forward_packed
        ids = torch.tensor([t for _, _, token_ids in feeds for t in token_ids], device=self.device)
        x = self.embedding[ids] if self.embedding is not None else self.head.index_select(1, ids).t()
        ropes = [self._rope(pos_start, count) for (_, pos_start, _), count in zip(feeds, counts, strict=True)]
        cos, sin = ropes[0] if len(ropes) == 1 else (torch.cat([c for c, _ in ropes]), torch.cat([s for _, s in ropes]))
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        qk_width = (heads + kv_heads) * dim
        hidden_shape, head_shape = (self.hidden_size,), (dim,)
        total = len(ids)
        for i, layer in enumerate(self.layers):
            h = F.rms_norm(x, hidden_shape, layer.in_norm, layer.eps)
            qkv = torch.mm(h, layer.qkv) if layer.qkv_bias is None else torch.addmm(layer.qkv_bias, h, layer.qkv)
            qk = qkv[:, :qk_width].view(total, heads + kv_heads, dim)
            if layer.q_norm is not None:
                qk = torch.cat([F.rms_norm(qk[:, :heads], head_shape, layer.q_norm, layer.eps),
                                F.rms_norm(qk[:, heads:], head_shape, layer.k_norm, layer.eps)], dim=1)
            qk = torch.addcmul(qk * cos, qk.roll(dim // 2, -1), sin)
            values = qkv[:, qk_width:].view(total, kv_heads, dim)
            outs, row = [], 0
            for (cache, pos_start, _), count in zip(feeds, counts, strict=True):
                stop, rows = pos_start + count, slice(row, row + count)
                keys, vals = cache.tensors()
                keys[i, :, pos_start:stop] = qk[rows, heads:].transpose(0, 1)
                vals[i, :, pos_start:stop] = values[rows].transpose(0, 1)
                mask = attention_mask(pos_start, count, layer.window, self.device)
                out = F.scaled_dot_product_attention(
                    qk[rows, :heads].transpose(0, 1)[None], keys[i, :, :stop][None], vals[i, :, :stop][None],
                    attn_mask=mask, is_causal=mask is None and count > 1, enable_gqa=heads != kv_heads)
                outs.append(out[0].transpose(0, 1).reshape(count, heads * dim))
                row += count
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
            x = torch.addmm(x, out, layer.o) if layer.o_bias is None else torch.addmm(x + layer.o_bias, out, layer.o)
            h = F.rms_norm(x, hidden_shape, layer.post_norm, layer.eps)
            gate_up = torch.mm(h, layer.gate_up) if layer.gate_up_bias is None else \
                torch.addmm(layer.gate_up_bias, h, layer.gate_up)
            half = gate_up.shape[1] // 2
            act = F.silu(gate_up[:, :half]) * gate_up[:, half:]
            x = torch.addmm(x, act, layer.down) if layer.down_bias is None else \
                torch.addmm(x + layer.down_bias, act, layer.down)
        lasts, end = [], 0
        for (cache, pos_start, _), count in zip(feeds, counts, strict=True):
            cache.length = pos_start + count
            end += count
            lasts.append(end - 1)
        last = F.rms_norm(x[lasts], hidden_shape, self.norm, self.norm_eps)
        return torch.mm(last, self.head).float()

    def _rope(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos is not None and self.sin_signed is not None:
            return self.cos[start : start + count], self.sin_signed[start : start + count]
        positions = torch.arange(start, start + count, device=self.device)[None]
        cos, sin = self.rotary(torch.empty(0, dtype=self.dtype, device=self.device), positions)
        return cos[0, :, None, :], (sin * self.sign)[0, :, None, :]
