"""CUDA graphs over a stage's decode step (docs/design/decode-hot-path.md, "On a GPU").

On a GPU the decode step of a model below tens of billions of parameters is host work: a 1B
Llama's step launched 687 kernels from Python for 1.8 ms of kernel time and took 12 ms (H200,
2026-11-27). A CUDA graph records the launches once and replays them with one call.

A graph needs fixed shapes and fixed addresses, so the step here is written for them:
- B rows, each one session's frame of up to T positions (a batch-size bucket, BATCH_BUCKETS, and
  a window bucket, WINDOW_BUCKETS: T = 1 for decode steps, more for a verify window; rows and
  positions past the frames are padding), attending over a block table of N blocks (a length
  bucket: powers of two from MIN_TABLE_BLOCKS; the table's unused entries name the scratch block);
- everything that changes per step lives in static device buffers the host fills before a
  replay: one int64 tensor [B, 2 + T + N] (the frame's count of positions, its first position,
  its token ids, its block table) and, after the first stage, the hidden rows [B T, H]. The write
  slots, the slots read, the rotary rows and the masks are computed from it inside the graph, so
  a step costs the host one or two copies and a replay;
- each layer writes its new keys and values with one index_copy_ into the pool, gathers the rows'
  keys and values through the table, and attends over them masked by position (values no
  position of the row reads are zeroed, since a slot nobody wrote may hold anything, and 0 x NaN
  is NaN). Padding writes into the pool's scratch block (KVPool(scratch=True)), which no table
  handed out by the frontend names, and attends as its row's first position.

It covers stages whose layers are all lean (modeling/lean_layers.py: the Llama shape) with one
precomputed rotary table, and frames over the stage's pool of up to 16 positions (decode steps,
verify windows, short prompt pieces); longer prompt chunks run eagerly. Decode steps' buckets are
captured before the stage says ready (warm), a window's when first needed. A capture that fails
is logged once and the stage runs eagerly from then on: never a failed request.

The same step runs without capture where there is no GPU (DecodeGraphs(capture=False)), which is
how the tests check, on the CPU, that it computes what the eager pass computes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from inferencemesh.modeling.kv_pool import BlockTableKV, KVPool
from inferencemesh.modeling.lean_layers import rotary

# The stage runtime (modeling/runtime.py) imports this module, so its types are not imported back:
# `runtime` is a StageRuntime, whose layers, rotary tables, embedding and head the step reads,
# and a segment a runtime.Segment (kv, pos_start, inputs, logits).
StageRuntime = Any
Segment = Any

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# Positions a row: 1 for a decode step, up to 16 for a verify window (k + 1 rows of one session)
# or a short prompt piece; a batch's rows are padded to its longest frame's bucket.
WINDOW_BUCKETS = (1, 2, 4, 8, 16)
MAX_GRAPH_POSITIONS = 256  # rows x window bucket at most: the attention's scores grow with both
MIN_TABLE_BLOCKS = 16  # the shortest length bucket: 256 positions of 16-token blocks
# The step gathers each row's whole table bucket of keys and values a layer (rows x positions x
# 2 x kv_heads x head_dim): a bucket whose gather would exceed this runs eagerly, so long contexts
# at large batches cost no unplanned GPU memory (a paged decode attention kernel would gather nothing).
GATHER_LIMIT_BYTES = 256 << 20
# "0": a GPU stage runs eagerly (to compare; vLLM's --enforce-eager); "always": the CPU's stages
# run the fixed-shape step too, uncaptured (the tests' way to send whole meshes through it).
ENV = "INFERENCEMESH_DECODE_GRAPHS"


def wanted(device: torch.device) -> bool:
    """Whether a stage on `device` runs its frames through the fixed-shape step: on CUDA unless
    ENV is "0"; elsewhere only when ENV is "always"."""
    setting = os.environ.get(ENV, "1")
    return setting == "always" or (device.type == "cuda" and setting != "0")


def covers(runtime: StageRuntime) -> bool:
    """Whether the fixed-shape step computes this stage: every layer lean, one precomputed rotary table."""
    return bool(runtime._lean) and all(lean is not None for lean in runtime._lean) and \
        set(runtime._rope_tables) == {None} and runtime._rope_tables[None] is not None


def bucket(value: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds value, or None."""
    return next((b for b in buckets if b >= value), None)


@dataclass
class _Graph:
    """One (batch, table) bucket's static inputs, and its graph and outputs once captured."""

    window: int  # T: positions a row
    meta: torch.Tensor  # [B, 2 + T + N] int64: the frame's positions, its first position, T token ids, the table
    hidden: torch.Tensor | None  # [B T, H] after the first stage
    graph: torch.cuda.CUDAGraph | None = None
    outputs: torch.Tensor | None = None  # what the captured step wrote: [B T, H] hidden or [B T, V] logits


class DecodeGraphs:
    """The decode steps of one stage over one KV pool, in fixed-shape buckets (see the module docstring)."""

    def __init__(self, runtime: StageRuntime, pool: KVPool, *, capture: bool) -> None:
        if pool.scratch_block is None:
            raise ValueError("decode graphs need a KV pool with a scratch block (KVPool(scratch=True))")
        self.runtime, self.pool, self.capture = runtime, pool, capture
        size = pool.block_tokens
        most = -(-runtime.max_context // size)
        self.table_buckets = tuple(sorted({min(MIN_TABLE_BLOCKS << i, most) for i in range(most.bit_length() + 1)}))
        self._graphs: dict[tuple[int, int, int], _Graph] = {}  # (rows, positions a row, blocks)
        self._memory = torch.cuda.graph_pool_handle() if capture else None  # one memory pool for every graph
        self.failed: str | None = None  # why capturing failed: the stage decodes eagerly from then on
        self.captured = 0
        # Computed once: the positions of a block, the layers' windows (one mask per distinct window).
        self._block_positions = torch.arange(size, device=pool.device)
        self._windows = runtime._windows
        self._scratch: int = pool.scratch_block
        store = pool.store  # [layers, 2, kv_heads, slots, head_dim]
        self._position_bytes = 2 * store.shape[2] * store.shape[4] * store.element_size()

    def warm(self, max_rows: int) -> tuple[int, float]:
        """Capture every bucket a batch of up to max_rows frames can need (the stage's session
        limit), before the stage says ready, so that no request pays a capture; returns how many
        were captured and the seconds it took. Uncaptured (the CPU), only the buffers are made."""
        started = time.perf_counter()
        before = self.captured
        largest = bucket(min(max_rows, BATCH_BUCKETS[-1]), BATCH_BUCKETS) or BATCH_BUCKETS[-1]
        for batch in (b for b in BATCH_BUCKETS if b <= largest):
            for blocks in self.table_buckets:  # decode steps (verify windows are captured when first seen)
                if not self._fits(batch, blocks):
                    continue
                if self._entry(batch, 1, blocks) is None:  # a failed capture: eager from here on
                    return self.captured - before, time.perf_counter() - started
        return self.captured - before, time.perf_counter() - started

    def takes(self, segments: Sequence[Segment]) -> bool:
        """Whether these frames are ones the graphs run: up to WINDOW_BUCKETS[-1] positions each
        (decode steps, verify windows), over this pool, within MAX_GRAPH_POSITIONS once padded."""
        if self.failed is not None or len(segments) > BATCH_BUCKETS[-1]:
            return False
        longest = stop = 0
        for seg in segments:
            if not isinstance(seg.kv, BlockTableKV) or seg.kv.pool is not self.pool or seg.inputs.shape[0] == 0:
                return False  # (an empty frame: the eager pass says what is wrong with it)
            longest = max(longest, seg.inputs.shape[0])
            stop = max(stop, seg.pos_start + seg.inputs.shape[0])
        window = bucket(longest, WINDOW_BUCKETS)
        batch = bucket(len(segments), BATCH_BUCKETS)
        blocks = bucket(-(-stop // self.pool.block_tokens), self.table_buckets)
        return window is not None and batch is not None and blocks is not None and \
            batch * window <= MAX_GRAPH_POSITIONS and self._fits(batch, blocks)

    def _fits(self, batch: int, blocks: int) -> bool:
        """Whether a bucket's gather of keys and values stays within GATHER_LIMIT_BYTES."""
        return batch * blocks * self.pool.block_tokens * self._position_bytes <= GATHER_LIMIT_BYTES

    def run(self, segments: list[Segment]) -> list[torch.Tensor | None] | None:
        """What forward_batch returns for these frames (takes() said yes), or None where the
        step could not be captured (the caller runs them eagerly)."""
        rt, size = self.runtime, self.pool.block_tokens
        counts = [seg.inputs.shape[0] for seg in segments]
        for seg, count in zip(segments, counts, strict=True):
            rt.check_positions(seg.kv, seg.pos_start, count)
        stop = max(seg.pos_start + count for seg, count in zip(segments, counts, strict=True))
        batch, window = bucket(len(segments), BATCH_BUCKETS), bucket(max(counts), WINDOW_BUCKETS)
        blocks = bucket(-(-stop // size), self.table_buckets)
        assert batch is not None and window is not None and blocks is not None  # takes() bounded them
        entry = self._entry(batch, window, blocks)
        if entry is None:
            return None
        self._fill(entry, segments, counts, window, blocks)
        if entry.graph is not None:
            entry.graph.replay()
            assert entry.outputs is not None
            out = entry.outputs[: len(segments) * window].clone()  # the graph's buffer is the next replay's
        else:
            out = self._step(entry)[: len(segments) * window]
        for seg in segments:
            seg.kv.end()
        rows = out.split(window)  # each frame's window of rows, the padding past its count
        if not rt.is_last:
            return [row[:count] for row, count in zip(rows, counts, strict=True)]
        wanted = {"all": lambda row, count: row[:count], "last": lambda row, count: row[count - 1:count],
                  "none": lambda row, count: None}
        return [wanted[seg.logits](row, count) for seg, row, count in zip(segments, rows, counts, strict=True)]

    # ---- inputs -------------------------------------------------------------------------------

    def _fill(self, entry: _Graph, segments: list[Segment], counts: list[int], window: int, blocks: int) -> None:
        """The frames' positions, token ids (or hidden rows) and tables into the static buffers;
        the padding rows at position 0 of the scratch block."""
        rt, scratch, size = self.runtime, self._scratch, self.pool.block_tokens
        rows = []
        for seg, count in zip(segments, counts, strict=True):
            kv = seg.kv
            assert isinstance(kv, BlockTableKV)
            tokens = _token_ids(seg.inputs, rt.vocab_size) if rt.is_first else []
            used = kv.blocks[: -(-(seg.pos_start + count) // size)]
            rows.append([count, seg.pos_start, *tokens, *[0] * (window - len(tokens)), *used,
                         *[scratch] * (blocks - len(used))])
        rows.extend([[0, 0, *[0] * window, *[scratch] * blocks]] * (entry.meta.shape[0] - len(rows)))
        entry.meta.copy_(torch.tensor(rows, dtype=torch.long))
        if entry.hidden is not None:
            for index, (seg, count) in enumerate(zip(segments, counts, strict=True)):
                if seg.inputs.dim() != 2 or seg.inputs.shape[1] != rt.hidden_size:
                    raise ValueError(f"hidden must be [T, {rt.hidden_size}], got {tuple(seg.inputs.shape)}")
                entry.hidden[index * window: index * window + count].copy_(seg.inputs)

    def _entry(self, batch: int, window: int, blocks: int) -> _Graph | None:
        key = (batch, window, blocks)
        if key not in self._graphs:
            rt = self.runtime
            meta = torch.zeros((batch, 2 + window + blocks), dtype=torch.long, device=rt.device)
            meta[:, 2 + window:] = self._scratch
            hidden = None if rt.is_first else torch.zeros((batch * window, rt.hidden_size), dtype=rt.dtype,
                                                          device=rt.device)
            entry = _Graph(window, meta, hidden)
            if self.capture:
                try:
                    self._capture(entry)
                except Exception as err:  # noqa: BLE001 (a capture is an optimisation: eager serves instead)
                    self.failed = f"{type(err).__name__}: {err}"
                    log.warning("decode graphs: capturing %d rows of %d positions over %d blocks failed, the "
                                "stage runs eagerly: %s", batch, window, blocks, self.failed)
                    return None
            self._graphs[key] = entry
        return self._graphs[key]

    def _capture(self, entry: _Graph) -> None:
        """Warm the step up on a side stream (allocations, library handles), then record it."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(entry)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads of the process (a frontend's sampling, an embedded stage's
        # neighbours) may use CUDA while this one records.
        with torch.cuda.graph(graph, pool=self._memory, capture_error_mode="thread_local"):
            entry.outputs = self._step(entry)
        entry.graph = graph
        self.captured += 1

    # ---- the step -----------------------------------------------------------------------------

    def _step(self, entry: _Graph) -> torch.Tensor:
        """Every row's frame from the static buffers alone: hidden [B T, H], or float32 logits
        [B T, V] on the last stage (row b's positions at b T ... b T + T - 1, its padding after)."""
        rt, pool = self.runtime, self.pool
        size = pool.block_tokens
        meta = entry.meta
        batch, window = meta.shape[0], entry.window
        counts, starts = meta[:, 0], meta[:, 1]
        tokens, tables = meta[:, 2:2 + window], meta[:, 2 + window:]
        span = tables.shape[1] * size
        offsets = torch.arange(window, device=meta.device)
        real = offsets[None, :] < counts[:, None]  # [B, T]: the frame's own positions, not padding
        # Padding attends as its row's first position does, and writes into the scratch block.
        positions = starts[:, None] + torch.where(real, offsets[None, :], 0)  # [B, T]
        if rt.is_first:
            assert rt._embed is not None
            x = rt._embed(tokens.reshape(-1))[None]
            if rt._hooks.embedding_multiplier is not None:
                x = x * rt._hooks.embedding_multiplier
        else:
            assert entry.hidden is not None
            x = entry.hidden[None]
        cos, sin = (t.index_select(1, positions.reshape(-1)) for t in rt._rope_tables[None])  # type: ignore[union-attr]
        slots = tables.gather(1, positions // size) * size + positions % size
        write = torch.where(real, slots, self._scratch * size + offsets[None, :]).reshape(-1)
        read = (tables[:, :, None] * size + self._block_positions).reshape(-1)
        allowed = _allowed(positions, span, self._windows)  # per window: [B, T, L]
        rot = rotary((cos, sin))
        for index, lean in enumerate(rt._lean):
            assert lean is not None  # covers(): every layer is lean
            q, k, v = (rows.transpose(1, 2) for rows in lean.pre_attention(x, rot))  # [1, heads, T, D]
            layer = pool.store[index]
            layer.index_copy_(2, write, torch.stack((k[0], v[0])).to(layer.dtype))
            gathered = layer.index_select(2, read).unflatten(2, (batch, span)).transpose(1, 2)  # [2, B, kv, L, D]
            attended = _attend(q, gathered[0], gathered[1], allowed[self._windows[index]], lean.scaling)
            x = lean.post_attention(x, attended.to(x.dtype))
        if not rt.is_last:
            return x[0]
        return rt._logits(x)

def _token_ids(inputs: torch.Tensor, vocab_size: int) -> list[int]:
    tokens = inputs.reshape(-1).tolist()
    if inputs.dtype not in (torch.int64, torch.int32) or not all(0 <= t < vocab_size for t in tokens):
        raise ValueError(f"token ids must be integers in [0, {vocab_size})")
    return tokens


def _allowed(positions: torch.Tensor, span: int, windows: list[int | None]) -> dict[int | None, torch.Tensor]:
    """Per distinct sliding window, which of the table's `span` positions each row's positions
    [B, T] attend: [B, T, L]."""
    columns = torch.arange(span, device=positions.device)
    upto = columns <= positions[..., None]
    out: dict[int | None, torch.Tensor] = {}
    for window in set(windows):
        out[window] = upto if window is None else upto & (columns > positions[..., None] - window)
    return out


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, scaling: float
            ) -> torch.Tensor:
    """Each row's queries q [1, heads, B T, D] over its gathered keys and values [B, kv_heads, L, D],
    where `allowed` [B, T, L]: the attention output [1, B T, heads * D]. Grouped queries are
    packed per key head (rows g T + t), so no key is copied per group; scores and softmax in
    float32. Values no position of the row reads are zeroed (a slot nobody wrote may hold NaN)."""
    batch, kv_heads, span, dim = keys.shape
    heads, window = q.shape[1], allowed.shape[1]
    groups = heads // kv_heads
    queries = q[0].unflatten(1, (batch, window)).transpose(0, 1).reshape(batch, kv_heads, groups * window, dim)
    scores = torch.matmul(queries.float(), keys.float().transpose(-1, -2)) * scaling  # [B, kv, g T, L]
    mask = allowed[:, None, None].expand(batch, 1, groups, window, span).reshape(batch, 1, groups * window, span)
    scores = scores.masked_fill(~mask, float("-inf"))
    values = values.masked_fill(~allowed.any(dim=1)[:, None, :, None], 0)
    out = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)  # [B, kv, g T, D]
    # [B, kv, g, T, D] -> [B, T, kv, g, D] -> [1, B T, heads D], as transformers' attention returns
    return out.unflatten(2, (groups, window)).permute(0, 3, 1, 2, 4).reshape(1, batch * window, heads * dim)
