"""CUDA graphs over a stage's decode step (docs/design/decode-hot-path.md, "On a GPU").

On a GPU the decode step of a model below tens of billions of parameters is host work: a 1B
Llama's step launched 687 kernels from Python for 1.8 ms of kernel time and took 12 ms (H200,
2026-11-27). A CUDA graph records the launches once and replays them with one call.

A graph needs fixed shapes and fixed addresses, so the step here is written for them:
- B rows, each one session's next position (a batch-size bucket, BATCH_BUCKETS; rows past the
  batch are padding), attending over a block table of N blocks (a length bucket: powers of two
  from MIN_TABLE_BLOCKS; the table's unused entries name the scratch block);
- everything that changes per step lives in static device buffers the host fills before a
  replay: one int64 tensor [B, 2 + N] (token id, position, block table) and, after the first
  stage, the hidden rows [B, H]. The write slots, the slots read, the rotary rows and the masks
  are computed from it inside the graph, so a step costs the host one or two copies and a replay;
- each layer writes its new keys and values with one index_copy_ into the pool, gathers the rows'
  keys and values through the table, and attends over them masked by position (the padding's
  values are zeroed, since a slot nobody wrote may hold anything, and 0 x NaN is NaN).
  The padding rows write into the pool's scratch block (KVPool(scratch=True)), which no table
  handed out by the frontend names.

It covers stages whose layers are all lean (modeling/lean_layers.py: the Llama shape) with one
precomputed rotary table, and frames of one token over the stage's pool (decode steps; a verify
window or a prompt chunk runs eagerly). A capture that fails is logged once and the stage runs
eagerly from then on: never a failed request.

The same step runs without capture where there is no GPU (DecodeGraphs(capture=False)), which is
how the tests check, on the CPU, that it computes what the eager pass computes.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from inferencemesh.modeling.kv_pool import BlockTableKV, KVPool

if TYPE_CHECKING:
    from inferencemesh.modeling.runtime import Segment, StageRuntime

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MIN_TABLE_BLOCKS = 16  # the shortest length bucket: 256 positions of 16-token blocks
ENV = "INFERENCEMESH_DECODE_GRAPHS"  # "0": a GPU stage decodes eagerly (to compare; vLLM's --enforce-eager)


def wanted(device: torch.device) -> bool:
    """Whether a stage on `device` decodes through graphs: on CUDA, unless ENV is "0"."""
    return device.type == "cuda" and os.environ.get(ENV, "1") != "0"


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

    meta: torch.Tensor  # [B, 2 + N] int64: token id, position, the block table
    hidden: torch.Tensor | None  # [B, H] after the first stage
    graph: torch.cuda.CUDAGraph | None = None
    outputs: torch.Tensor | None = None  # what the captured step wrote: [B, H] hidden or [B, V] logits


class DecodeGraphs:
    """The decode steps of one stage over one KV pool, in fixed-shape buckets (see the module docstring)."""

    def __init__(self, runtime: StageRuntime, pool: KVPool, *, capture: bool) -> None:
        if pool.scratch_block is None:
            raise ValueError("decode graphs need a KV pool with a scratch block (KVPool(scratch=True))")
        self.runtime, self.pool, self.capture = runtime, pool, capture
        size = pool.block_tokens
        most = -(-runtime.max_context // size)
        self.table_buckets = tuple(sorted({min(MIN_TABLE_BLOCKS << i, most) for i in range(most.bit_length() + 1)}))
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._memory = torch.cuda.graph_pool_handle() if capture else None  # one memory pool for every graph
        self.failed: str | None = None  # why capturing failed: the stage decodes eagerly from then on
        self.captured = 0
        # Computed once: the positions of a block, the layers' windows (one mask per distinct window).
        self._block_positions = torch.arange(size, device=pool.device)
        self._windows = runtime._windows
        self._scratch: int = pool.scratch_block

    def warm(self, max_rows: int) -> tuple[int, float]:
        """Capture every bucket a batch of up to max_rows frames can need (the stage's session
        limit), before the stage says ready, so that no request pays a capture; returns how many
        were captured and the seconds it took. Uncaptured (the CPU), only the buffers are made."""
        started = time.perf_counter()
        before = self.captured
        largest = bucket(min(max_rows, BATCH_BUCKETS[-1]), BATCH_BUCKETS) or BATCH_BUCKETS[-1]
        for batch in (b for b in BATCH_BUCKETS if b <= largest):
            for blocks in self.table_buckets:
                if self._entry(batch, blocks) is None:  # a failed capture: eager from here on
                    return self.captured - before, time.perf_counter() - started
        return self.captured - before, time.perf_counter() - started

    def takes(self, segments: list[Segment]) -> bool:
        """Whether these frames are decode steps the graphs can run: one token each, over this
        pool, at most the largest bucket of them."""
        if self.failed is not None or len(segments) > BATCH_BUCKETS[-1]:
            return False
        for seg in segments:
            if not isinstance(seg.kv, BlockTableKV) or seg.kv.pool is not self.pool or seg.logits == "all":
                return False
            if seg.inputs.shape[0] != 1:
                return False
        return True

    def run(self, segments: list[Segment]) -> list[torch.Tensor | None] | None:
        """What forward_batch returns for these frames (takes() said yes), or None where the
        step could not be captured (the caller runs them eagerly)."""
        rt, size = self.runtime, self.pool.block_tokens
        count = len(segments)
        stops = []
        for seg in segments:
            rt.check_positions(seg.kv, seg.pos_start, 1)
            stops.append(seg.pos_start + 1)
        batch = bucket(count, BATCH_BUCKETS)
        blocks = bucket(-(-max(stops) // size), self.table_buckets)
        assert batch is not None and blocks is not None  # takes() and check_positions bound them
        entry = self._entry(batch, blocks)
        if entry is None:
            return None
        self._fill(entry, segments, blocks)
        if entry.graph is not None:
            entry.graph.replay()
            assert entry.outputs is not None
            out = entry.outputs[:count].clone()  # the graph's buffer is the next replay's
        else:
            out = self._step(entry)[:count]
        for seg in segments:
            seg.kv.end()
        if not rt.is_last:
            return list(out.split(1))
        return [row if seg.logits != "none" else None for seg, row in zip(segments, out.split(1), strict=True)]

    # ---- inputs -------------------------------------------------------------------------------

    def _fill(self, entry: _Graph, segments: list[Segment], blocks: int) -> None:
        """The frames' token ids (or hidden rows), positions and tables into the static buffers,
        the padding rows at position 0 of the scratch block."""
        rt, scratch = self.runtime, self._scratch
        rows = []
        for seg in segments:
            kv = seg.kv
            assert isinstance(kv, BlockTableKV)
            token = 0
            if rt.is_first:
                token = _token_id(seg.inputs, rt.vocab_size)
            used = kv.blocks[: -(-(seg.pos_start + 1) // self.pool.block_tokens)]
            rows.append([token, seg.pos_start, *used, *[scratch] * (blocks - len(used))])
        rows.extend([[0, 0, *[scratch] * blocks]] * (entry.meta.shape[0] - len(rows)))
        entry.meta.copy_(torch.tensor(rows, dtype=torch.long))
        if entry.hidden is not None:
            hidden = torch.cat([seg.inputs for seg in segments])
            if hidden.dim() != 2 or hidden.shape[1] != rt.hidden_size:
                raise ValueError(f"hidden must be [1, {rt.hidden_size}] a frame, got {tuple(seg.inputs.shape)}")
            entry.hidden[: len(segments)].copy_(hidden)

    def _entry(self, batch: int, blocks: int) -> _Graph | None:
        key = (batch, blocks)
        if key not in self._graphs:
            rt = self.runtime
            meta = torch.zeros((batch, 2 + blocks), dtype=torch.long, device=rt.device)
            meta[:, 2:] = self._scratch
            hidden = None if rt.is_first else torch.zeros((batch, rt.hidden_size), dtype=rt.dtype, device=rt.device)
            entry = _Graph(meta, hidden)
            if self.capture:
                try:
                    self._capture(entry)
                except Exception as err:  # noqa: BLE001 (a capture is an optimisation: eager serves instead)
                    self.failed = f"{type(err).__name__}: {err}"
                    log.warning("decode graphs: capturing batch %d over %d blocks failed, the stage decodes "
                                "eagerly: %s", batch, blocks, self.failed)
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
        """One decode step of every row, from the static buffers alone: hidden [B, H], or float32
        logits [B, V] on the last stage."""
        rt, pool = self.runtime, self.pool
        size = pool.block_tokens
        meta = entry.meta
        positions, tables = meta[:, 1], meta[:, 2:]
        batch, span = tables.shape[0], tables.shape[1] * size
        if rt.is_first:
            assert rt._embed is not None
            x = rt._embed(meta[:, 0])[None]
            if rt._hooks.embedding_multiplier is not None:
                x = x * rt._hooks.embedding_multiplier
        else:
            assert entry.hidden is not None
            x = entry.hidden[None]
        cos, sin = (t.index_select(1, positions) for t in rt._rope_tables[None])  # type: ignore[union-attr]
        write = tables.gather(1, (positions // size)[:, None])[:, 0] * size + positions % size
        read = (tables[:, :, None] * size + self._block_positions).reshape(-1)
        allowed = _allowed(positions, span, self._windows)
        for index, lean in enumerate(rt._lean):
            assert lean is not None  # covers(): every layer is lean
            q, k, v = lean.pre_attention(x, cos, sin)
            layer = pool.store[index]
            layer.index_copy_(2, write, torch.stack((k[0], v[0])).to(layer.dtype))
            gathered = layer.index_select(2, read).unflatten(2, (batch, span)).transpose(1, 2)  # [2, B, kv, L, D]
            attended = _attend(q, gathered[0], gathered[1], allowed[self._windows[index]], lean.scaling)
            x = lean.post_attention(x, attended.to(x.dtype))
        if not rt.is_last:
            return x[0]
        return rt._logits(x)


def _token_id(inputs: torch.Tensor, vocab_size: int) -> int:
    token = int(inputs.reshape(-1)[0])
    if inputs.dtype not in (torch.int64, torch.int32) or not 0 <= token < vocab_size:
        raise ValueError(f"token ids must be integers in [0, {vocab_size})")
    return token


def _allowed(positions: torch.Tensor, span: int, windows: list[int | None]) -> dict[int | None, torch.Tensor]:
    """Per distinct sliding window, which of the table's `span` positions each row attends: [B, L]."""
    columns = torch.arange(span, device=positions.device)[None, :]
    upto = columns <= positions[:, None]
    out: dict[int | None, torch.Tensor] = {}
    for window in set(windows):
        out[window] = upto if window is None else upto & (columns > positions[:, None] - window)
    return out


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, scaling: float
            ) -> torch.Tensor:
    """Each row's query q [1, heads, B, D] over its gathered keys and values [B, kv_heads, L, D],
    where `allowed` [B, L]: the attention output [1, B, heads * D]. Grouped queries are packed per
    key head, so no key is copied per group; scores and softmax in float32."""
    batch, kv_heads, _, dim = keys.shape
    heads = q.shape[1]
    queries = q[0].transpose(0, 1).reshape(batch, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(queries.float(), keys.float().transpose(-1, -2)) * scaling  # [B, kv, groups, L]
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    values = values.masked_fill(~allowed[:, None, :, None], 0)
    out = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)  # [B, kv, groups, D]
    return out.reshape(1, batch, heads * dim)

