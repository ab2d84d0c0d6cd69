"""The stage runtime: run a layer range of a causal LM over sessions' KV caches.

    rt = StageRuntime("path/or/org/model", 0, 12)
    kv = rt.new_session()
    logits = rt.forward(kv, 0, token_ids=prompt)        # prefill (first and last stage)
    logits = rt.forward(kv, len(prompt), token_ids=nxt)  # decode

A stage keeps its KV in one pool of blocks (new_pool) and hands each frame a BlockTableKV over
it (modeling/kv_pool.py); a session of its own (new_session, a SessionKV) serves a single run
outside a stage (the draft model, tests). Both are a kv.CacheKV, which forward and forward_batch take.

pos_start is authoritative: a frame at position p first truncates the session's cache to p,
which is how a rejected speculation rolls back without a message of its own. The first stage
takes token ids, the others the previous stage's hidden states; the last stage returns float32
logits, only for the last row unless asked for all (speculative verification).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from inferencemesh.modeling.attention import PackedAttention, kv_cache_dtype
from inferencemesh.modeling.decode_graphs import DecodeGraphs
from inferencemesh.modeling.decode_graphs import covers as graphs_cover
from inferencemesh.modeling.decode_graphs import wanted as decode_graphs_wanted
from inferencemesh.modeling.families import ForwardHooks, forward_hooks
from inferencemesh.modeling.kv import CacheKV, SessionKV
from inferencemesh.modeling.kv_pool import KVPool, PagedFrames, PassWrites
from inferencemesh.modeling.lean_layers import LeanLayer, lean_layers, lean_norm, rotaries_of
from inferencemesh.modeling.loader import StageModules, load_stage
from inferencemesh.modeling.native_kernels import takes_paged_attention
from inferencemesh.modeling.packed import PackedLinear, pack_linears, packs
from inferencemesh.modeling.pages import return_freed_memory
from inferencemesh.modeling.positions import attention_mask, rope_table, sliding_window
from inferencemesh.protocol.transport import KV_BLOCK_TOKENS


class PositionError(ValueError):
    """pos_start beyond what the session's cache holds, or past max_context or its block table."""


@dataclass
class Segment:
    """One session's frame within a batched forward pass."""

    kv: CacheKV  # a BlockTableKV at a stage
    pos_start: int
    inputs: torch.Tensor  # token ids [T] on the first stage, hidden states [T, H] after it
    logits: str = "last"  # on the last stage: "last", "all" or "none" (see StageRuntime.forward)


def held_bytes(stage: StageModules) -> int:
    """The bytes of a loaded stage's weights and buffers, each tensor once (a tied head is the embedding)."""
    modules = [m for m in (stage.embed, stage.layers, stage.norm, stage.lm_head) if m is not None]
    unique = {id(t): t.numel() * t.element_size() for m in modules for t in [*m.parameters(), *m.buffers()]}
    return sum(unique.values())


class StageRuntime:
    """Layers [layer_start, layer_end) of a model, plus embeddings (first stage) or norm + head (last)."""

    _norm: Callable[[torch.Tensor], torch.Tensor] | None  # the last stage's final norm (lean_norm's where it can)

    def __init__(
        self,
        source: str | Path,
        layer_start: int,
        layer_end: int,
        *,
        revision: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        cache_dir: str | None = None,
        max_context: int = 2048,
        on_progress: Callable[[str, float], None] | None = None,
        modules: StageModules | None = None,
        quantization: str | None = None,
        lean: bool = True,
    ) -> None:
        """modules: layers [layer_start, layer_end) already loaded (load_stage) from source,
        used as they are (the draft model, which loads once and may run its own forward).
        quantization: int8, int4 or fp8, a 16-bit checkpoint's layers quantized as they are read
        (load_stage's, config.ModelOptions.quantization).
        lean: the layers of the Llama shape computed by lean_layers (False: all transformers')."""
        stage = modules or load_stage(source, layer_start, layer_end, revision=revision, dtype=dtype, device=device,
                                      cache_dir=cache_dir, on_progress=on_progress, quantization=quantization)
        # What the stage's weights hold, as loaded (the plan's weight_bytes counts the same), before
        # the CPU packing below lays some of them out again.
        self.weight_bytes = held_bytes(stage)
        self.facts = stage.facts
        self.config = stage.config
        self.num_layers = stage.facts.num_layers
        self.layer_start = layer_start
        self.layer_end = layer_end
        self.is_first = layer_start == 0
        self.is_last = layer_end == self.num_layers
        self.hidden_size = stage.facts.hidden_size
        self.vocab_size = stage.facts.vocab_size
        self.dtype = stage.dtype
        self.device = stage.device
        self.max_context = max_context
        self.model_dir = stage.model_dir
        self._adopt_modules(stage)
        self._plan_attention(stage)
        self._plan_rotary(stage)
        self._lean: list[LeanLayer | None] = [None] * len(self._layers)
        self._graphs: DecodeGraphs | None = None  # new_pool's, where its decode steps run as graphs
        if lean and None in self._rope_tables:  # one rotary table for every layer
            self._lean = lean_layers(self._layers, lambda x, start, count: self._rope(x, start, count, None))
            self._norm = lean_norm(self._norm)
        self._has_lean = any(lean is not None for lean in self._lean)
        # Lean layers' attention natively over the pool's block tables (kv_pool.PagedFrames).
        self._paged = self._has_lean and takes_paged_attention(self._kv_dtype, self.device, self._head_dim)
        if self.device.type == "cpu":  # after the lean layers, which fuse and pack their projections
            for layer in self._layers:
                pack_linears(layer)
            return_freed_memory()
        if on_progress is not None:
            on_progress("ready", 1.0)

    def _adopt_modules(self, stage: StageModules) -> None:
        """The stage's modules, its LM head packed for the CPU's matmul there (the layers' linear
        layers are, once the lean layers have fused theirs)."""
        self._embed: nn.Module | None = stage.embed
        self._layers = list(stage.layers)
        self._norm = stage.norm
        self._lm_head: nn.Module | None = stage.lm_head
        if self.device.type == "cpu":
            self._lm_head, self._embed = _packed_head(self._lm_head, self._embed)
            stage.lm_head = None  # the unpacked head goes now, not after the layers are packed too

    def _plan_attention(self, stage: StageModules) -> None:
        """The KV cache's shape and dtype, the layers' sliding windows and how a layer is handed the cache."""
        self._kv_heads = stage.facts.num_kv_heads
        self._kv_dtype = kv_cache_dtype(self.dtype, self.device)
        self._head_dim = int(getattr(self.config, "head_dim", None) or stage.facts.head_dim)
        self._windows = [sliding_window(self.config, i) for i in range(self.layer_start, self.layer_end)]
        self._smallest_window = min((w for w in self._windows if w is not None), default=None)
        self._no_masks: list[torch.Tensor | None] = [None] * len(self._layers)  # shared, never mutated
        self._cache_kwarg = _cache_argument(self._layers)

    def _plan_rotary(self, stage: StageModules) -> None:
        """What the family's forward does around the layers (modeling/families.py HOOKS), and the
        rotary tables: one per layer type where the family has one per type (Gemma3), else one for all."""
        self._rotary = stage.rotary
        self._hooks = forward_hooks(self.config)
        layer_types = list(getattr(self.config, "layer_types", None) or [])
        self._rope_keys: list[str | None] = [layer_types[i] if self._hooks.rotary_per_layer_type else None
                                             for i in range(self.layer_start, self.layer_end)]
        self._rope_tables = {key: rope_table(self.config, self._rotary, self.max_context, self.dtype, self.device,
                                             layer_type=key) for key in set(self._rope_keys)}

    # ------------------------------------------------------------------ sessions

    def new_session(self) -> SessionKV:
        return SessionKV(
            len(self._layers),
            self.layer_start,
            self._kv_heads,
            self._head_dim,
            dtype=self._kv_dtype,
            device=self.device,
            max_context=self.max_context,
        )

    def new_pool(self, num_blocks: int, block_tokens: int = KV_BLOCK_TOKENS, *, decode_graphs: bool | None = None
                 ) -> KVPool:
        """The stage's KV pool: num_blocks blocks of block_tokens positions for its layers.
        decode_graphs: its decode steps through modeling/decode_graphs.py, captured as CUDA graphs
        on a GPU (None: there, where the stage's layers allow it; True on the CPU: the same
        fixed-shape step, uncaptured)."""
        graphs = decode_graphs if decode_graphs is not None else decode_graphs_wanted(self.device)
        graphs = graphs and graphs_cover(self)
        pool = KVPool(len(self._layers), self.layer_start, self._kv_heads, self._head_dim, num_blocks=num_blocks,
                      block_tokens=block_tokens, dtype=self._kv_dtype, device=self.device, scratch=graphs)
        if graphs:
            self._graphs = DecodeGraphs(self, pool, capture=self.device.type == "cuda")
        return pool

    def warm_decode_graphs(self, max_rows: int) -> tuple[int, float]:
        """The decode graphs of the last new_pool captured for batches of up to max_rows frames
        (DecodeGraphs.warm): how many, and the seconds; (0, 0.0) where the stage has none."""
        return self._graphs.warm(max_rows) if self._graphs is not None else (0, 0.0)

    # ------------------------------------------------------------------ forward

    @torch.inference_mode()
    def forward(
        self,
        kv: CacheKV,
        pos_start: int,
        *,
        token_ids: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
        logits: str = "last",
    ) -> torch.Tensor | None:
        """Run the stage on T new positions starting at pos_start.

        Returns hidden [T, H] (non-last stage), or float32 logits [1, V] (logits="last") or
        [T, V] (logits="all") on the last stage; logits="none" skips the head (the last stage
        reading a prompt piece whose prediction nobody wants) and returns None there.
        """
        if logits not in ("last", "all", "none"):
            raise ValueError(f"logits must be 'last', 'all' or 'none', not {logits!r}")
        x = self._input(token_ids, hidden)  # [1, T, H]
        count = x.shape[1]
        self.check_positions(kv, pos_start, count)

        kv.truncate(pos_start)
        kv.begin(pos_start, count)
        ropes = {key: self._rope(x, pos_start, count, key) for key in self._rope_tables}
        rotaries = rotaries_of(ropes) if self._has_lean else {}  # once a forward, for every lean layer
        masks = self._masks(pos_start, count)
        paged = PagedFrames.of([kv]) if self._paged else None
        for layer, lean, mask, key in zip(self._layers, self._lean, masks, self._rope_keys, strict=True):
            if lean is not None:
                x = lean(x, rotaries[key], mask, kv, paged)
                continue
            x = layer(x, attention_mask=mask, position_ids=self._positions(pos_start, count),
                      **{self._cache_kwarg: kv}, use_cache=True, position_embeddings=ropes[key])
        kv.end()

        if not self.is_last:
            return x[0]
        if logits == "none":
            return None
        if logits == "last":
            x = x[:, -1:]  # dead rows skipped: only the last row goes through norm and head
        return self._logits(x)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The last stage's float32 logits of hidden rows x [1, T, H]: [T, vocab]."""
        assert self._norm is not None and self._lm_head is not None  # the last stage has both
        return _scaled_logits(self._lm_head(self._norm(x))[0].float(), self._hooks)

    def check_positions(self, kv: CacheKV, pos_start: int, count: int) -> None:
        """PositionError unless [pos_start, pos_start + count) continues what the cache holds and
        fits max_context and the cache's room (a block table's positions)."""
        if pos_start < 0 or pos_start > kv.length:
            raise PositionError(f"pos_start {pos_start} is beyond the {kv.length} positions this session holds")
        if pos_start + count > self.max_context:
            raise PositionError(f"positions up to {pos_start + count} exceed max_context {self.max_context}")
        if pos_start + count > kv.room:
            raise PositionError(f"positions up to {pos_start + count} exceed the {kv.room} the block table covers")

    @torch.inference_mode()
    def forward_batch(self, segments: list[Segment]) -> list[torch.Tensor | None]:
        """Several sessions' frames in one pass; per segment what forward() would return.

        The segments' tokens are packed into one sequence for the projections and MLPs, so
        each weight is read once for all of them (what makes decoding many sessions cheap);
        attention runs over each session's own keys and values, per segment (attention.PackedAttention).
        """
        if self._graphs is not None and self._graphs.takes(segments):
            stepped = self._graphs.run(segments)
            if stepped is not None:
                return stepped
        if len(segments) == 1:
            seg = segments[0]
            feed = {"token_ids": seg.inputs} if self.is_first else {"hidden": seg.inputs}
            return [self.forward(seg.kv, seg.pos_start, logits=seg.logits, **feed)]
        pieces = [self._input(seg.inputs, None) if self.is_first else self._input(None, seg.inputs)
                  for seg in segments]
        counts = [p.shape[1] for p in pieces]
        for seg, count in zip(segments, counts, strict=True):
            self.check_positions(seg.kv, seg.pos_start, count)
            seg.kv.truncate(seg.pos_start)
            seg.kv.begin(seg.pos_start, count)
        x = torch.cat(pieces, dim=1)
        by_key = {}
        for key in self._rope_tables:
            ropes = [self._rope(p, seg.pos_start, count, key)
                     for p, seg, count in zip(pieces, segments, counts, strict=True)]
            by_key[key] = (torch.cat([c for c, _ in ropes], dim=1), torch.cat([s for _, s in ropes], dim=1))
        positions = torch.cat([self._positions(seg.pos_start, count)
                               for seg, count in zip(segments, counts, strict=True)], dim=1)
        rotaries = rotaries_of(by_key) if self._has_lean else {}
        paged = PagedFrames.of([seg.kv for seg in segments]) if self._paged else None
        # the sessions' caches as transformers' layers take them: not built where no layer reads them
        packed = _PackedCache(self, segments, counts) if paged is None or None in self._lean else None
        for layer, lean, key in zip(self._layers, self._lean, self._rope_keys, strict=True):
            if lean is not None:
                x = lean(x, rotaries[key], None, packed, paged)
                continue
            x = layer(x, attention_mask=None, position_ids=positions, **{self._cache_kwarg: packed}, use_cache=True,
                      position_embeddings=by_key[key])
        for seg in segments:
            seg.kv.end()
        if not self.is_last:
            return list(x[0].split(counts))
        rows, spans = _logit_rows(segments, counts)
        if not rows:
            return [None] * len(segments)
        logits = self._logits(x[:, rows]).split(spans)
        return [out if seg.logits != "none" else None for seg, out in zip(segments, logits, strict=True)]

    def _input(self, token_ids: torch.Tensor | None, hidden: torch.Tensor | None) -> torch.Tensor:
        if self.is_first:
            if token_ids is None or hidden is not None:
                raise ValueError("the first stage takes token_ids (and no hidden states)")
            _check_token_ids(token_ids, self.vocab_size)
            assert self._embed is not None  # the first stage has it
            x = self._embed(token_ids.to(device=self.device, dtype=torch.long))[None]
            if self._hooks.embedding_multiplier is not None:
                x = x * self._hooks.embedding_multiplier
            return x
        if hidden is None or token_ids is not None:
            raise ValueError("a stage after the first takes hidden states (and no token_ids)")
        if hidden.dim() != 2 or hidden.shape[0] == 0 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden must be [T, {self.hidden_size}] with T >= 1, got {tuple(hidden.shape)}")
        return hidden.to(device=self.device, dtype=self.dtype)[None]

    # ------------------------------------------------------------------ positions

    def _rope(self, x: torch.Tensor, start: int, count: int, key: str | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._rope_tables[key]
        if table is not None:
            cos, sin = table
            return cos[:, start : start + count], sin[:, start : start + count]
        positions = torch.arange(start, start + count, device=self.device)[None]
        if key is not None:
            return self._rotary(x, positions, key)
        return self._rotary(x, positions)

    def _positions(self, start: int, count: int) -> torch.Tensor:
        """position_ids [1, count]: rotary comes precomputed (position_embeddings), but some
        families' layers read the positions themselves (Ministral3 scales queries by them)."""
        return torch.arange(start, start + count, device=self.device)[None]

    def _masks(self, start: int, count: int) -> list[torch.Tensor | None]:
        """Boolean attention masks per layer (see positions.attention_mask), one per distinct window."""
        stop = start + count
        if (count == 1 or start == 0) and (self._smallest_window is None or stop <= self._smallest_window):
            return self._no_masks  # the decode step: nothing to build
        by_window = {w: attention_mask(start, count, w, self.device) for w in set(self._windows)}
        return [by_window[w] for w in self._windows]


def _scaled_logits(logits: torch.Tensor, hooks: ForwardHooks) -> torch.Tensor:
    """The family's multiplier and final soft-cap on float32 logits (transformers applies them in
    the model's dtype; float32 here)."""
    if hooks.logit_multiplier is not None:
        logits = logits * hooks.logit_multiplier
    if hooks.final_softcap is not None:
        logits = torch.tanh(logits / hooks.final_softcap) * hooks.final_softcap
    return logits


def _check_token_ids(token_ids: torch.Tensor, vocab_size: int) -> None:
    """ValueError unless token_ids is a non-empty 1-D integer tensor of ids in [0, vocab_size).
    Checked where the ids arrive (the CPU, from the wire): no device sync for it."""
    if token_ids.dim() != 1 or token_ids.numel() == 0 or token_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"token_ids must be a non-empty 1-D integer tensor, got {tuple(token_ids.shape)}")
    low, high = (int(token_ids), int(token_ids)) if len(token_ids) == 1 else map(int, token_ids.aminmax())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size})")


def _packed_head(head: nn.Module | None, embed: nn.Module | None) -> tuple[nn.Module | None, nn.Module | None]:
    """The LM head packed for the CPU, and the embedding. A head that shares its matrix with this
    stage's embedding (tied, one stage holding both) is packed only where the packed matrix can
    serve the embedding too (float32's [hidden, vocab]: an embedding is a column of it), so that
    the stage holds the largest matrix once; elsewhere it stays as it is."""
    if not (isinstance(head, nn.Linear) and packs(head)):
        return head, embed
    tied = embed is not None and head.weight is embed.weight
    transposable = head.weight.dtype == torch.float32  # MKL's [in, out] form: 16-bit there is slow
    if tied and (not transposable or type(embed) is not nn.Embedding or embed.max_norm is not None):
        return head, embed  # decided before packing: a head packed for nothing would cost a copy at load
    packed = PackedLinear(head.weight, head.bias, transposed=tied)
    return (packed, ColumnEmbedding(packed.packed)) if tied else (packed, embed)


class ColumnEmbedding(nn.Module):
    """An embedding read from the tied head's packed [hidden, vocab] matrix: token t's vector is
    column t. The same numbers as the embedding's row t (the matrix is its transpose)."""

    def __init__(self, columns: torch.Tensor) -> None:
        super().__init__()
        self.columns = columns

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.columns.index_select(1, ids).t()


def _cache_argument(layers: list[nn.Module]) -> str:
    """The layers' name for the KV cache argument: `cache` from transformers 5.x's rename on
    (passing the old name warns on every call), `past_key_values` before it."""
    takes_cache = bool(layers) and "cache" in inspect.signature(type(layers[0]).forward).parameters
    return "cache" if takes_cache else "past_key_values"


def _logit_rows(segments: list[Segment], counts: list[int]) -> tuple[list[int], list[int]]:
    """The packed rows whose logits the segments want (their last, all or none), and how many per segment."""
    rows: list[int] = []
    spans: list[int] = []
    end = 0
    for seg, count in zip(segments, counts, strict=True):
        end += count
        span = {"all": count, "last": 1}.get(seg.logits, 0)
        rows.extend(range(end - span, end))
        spans.append(span)
    return rows, spans


class _PackedCache:
    """The Cache a batched pass hands the decoder layers: each layer's new keys and values are
    split by segment into the sessions' own caches, and attention gets each session's keys and
    values back (PackedAttention)."""

    def __init__(self, runtime: StageRuntime, segments: list[Segment], counts: list[int]) -> None:
        self.runtime, self.segments, self.counts = runtime, segments, counts
        self._masks: dict[tuple[int, int | None], torch.Tensor | None] = {}  # per (segment, window)
        caches = [seg.kv for seg in segments]
        # Frames over a stage's pool: one write per layer for every session (else each its own).
        self._writes = PassWrites(caches) if PassWrites.over_one_pool(caches) else None  # type: ignore[arg-type]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object,
               **kwargs: object) -> tuple[PackedAttention, None]:
        rt = self.runtime
        window = rt._windows[layer_idx - rt.layer_start]
        # Keys and values stacked and converted to the cache's dtype once for every session.
        rows = torch.stack((key_states[0], value_states[0])).to(rt._kv_dtype)
        if self._writes is not None:
            layer = self._writes.write(rows, layer_idx)
            kvs = [seg.kv.read(layer) for seg in self.segments]  # type: ignore[attr-defined]
        else:
            kvs = [seg.kv.write(part, layer_idx)
                   for seg, part in zip(self.segments, rows.split(self.counts, dim=2), strict=True)]
        parts = []
        for i, (seg, (keys, values)) in enumerate(zip(self.segments, kvs, strict=True)):
            if (i, window) not in self._masks:
                self._masks[i, window] = attention_mask(seg.pos_start, self.counts[i], window, rt.device)
            parts.append((keys, values, self._masks[i, window]))
        return PackedAttention(parts, self.counts), None

