"""A stage's KV memory as one pool of fixed-size blocks, and the cache object of one session's
frame over its block table (docs/design/kv-blocks.md).

The pool is one tensor [layers, 2 (keys, values), kv_heads, slots, head_dim], slots = blocks x
block_tokens, allocated once with torch.empty (the OS commits a page when it is first written, so
an idle pool costs address space, not memory). Block b holds slots [b B, b B + B). The frontend
decides which blocks a session's positions live in; the stage writes and reads where the frame's
table says. The last stage also keeps each slot's token id, so a session's token history (what the
penalties read) is its table's slots, whoever computed them.

BlockTableKV speaks what the runtime asks of a cache (see kv.CacheKV): the new rows go into their
slots, and attention gets the session's keys and values [0, stop) as a view of the pool when the
table's blocks are consecutive ids, else in one index_select of its slots (its index built once
per frame, not per layer).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inferencemesh.modeling.attention import KeysValues, KVSpans
from inferencemesh.modeling.pages import keep_small_pages

NO_TOKEN = -1  # a token slot written by a frame that carried no token ids
# A table in a few runs of consecutive blocks (a shared prefix's, then the session's own) is read
# as one view per run, attended where it lies (attention.KVSpans), instead of gathered into one
# copy, for frames of a few queries (decode steps, verify windows) from this many positions on.
# One layer, fp32, one thread, 2 runs, against the gather: bundled shape (6 heads over 2), one query:
# 600 positions 92 us against 110, 1,508: 158 against 289, 3,000: 253 against 520; llama-150m's
# (12 heads) 1,508 positions: 1 query 293 against 2,715, 4 queries 1,457 against 3,680. With more
# queries (a prefill chunk) the gather wins: 16 queries of the bundled shape, 1,289 against 926.
SPLIT_MIN_POSITIONS = 512
SPLIT_MAX_QUERIES = 8
MAX_SPLIT_RUNS = 4
# Queries a session's frame may have for the native attention over the tables (native/paged_attention.c):
# decode steps, verify windows and short prompt pieces. It was 2-5x sdpa's speed up to 64 (one thread,
# keys and values cold: at 64 queries over 300 positions 645 against 1,322 us for 12 heads); longer
# prompt chunks keep sdpa's flash kernel.
PAGED_MAX_QUERIES = 64


class KVPool:
    """The KV blocks of layers [layer_offset, layer_offset + num_layers) of one stage."""

    def __init__(self, num_layers: int, layer_offset: int, kv_heads: int, head_dim: int, *, num_blocks: int,
                 block_tokens: int, dtype: torch.dtype, device: torch.device, scratch: bool = False) -> None:
        """scratch: one block more, past the num_blocks a table may name, that fixed-shape steps'
        padding rows write into (modeling/decode_graphs.py): scratch_block is its id."""
        if num_blocks < 1 or block_tokens < 1:
            raise ValueError(f"a KV pool needs blocks ({num_blocks}) of at least one position ({block_tokens})")
        self.num_blocks, self.block_tokens = num_blocks, block_tokens
        self.layer_offset = layer_offset
        self.slots = num_blocks * block_tokens
        self.scratch_block = num_blocks if scratch else None
        stored = self.slots + (block_tokens if scratch else 0)
        self.store = torch.empty((num_layers, 2, kv_heads, stored, head_dim), dtype=dtype, device=device)
        keep_small_pages(self.store)  # committed as blocks are written, not 2 MiB at a time (pages.py)
        # Token id per slot, on the CPU (the penalties read it as a list); int32 as the wire's ids.
        self.tokens = torch.full((self.slots,), NO_TOKEN, dtype=torch.int32)

    @property
    def dtype(self) -> torch.dtype:
        return self.store.dtype

    @property
    def device(self) -> torch.device:
        return self.store.device

    def nbytes(self) -> int:
        """Bytes of the keys and values (allocated, not necessarily committed by the OS yet)."""
        return self.store.numel() * self.store.element_size()

    def slot_index(self, blocks: Sequence[int], start: int, stop: int, device: torch.device | None = None
                   ) -> torch.Tensor:
        """The slots of positions [start, stop) under table `blocks`, as an int64 tensor."""
        size = self.block_tokens
        first, last = start // size, -(-stop // size)
        table = torch.tensor(blocks[first:last], dtype=torch.long)
        slots = (table[:, None] * size + torch.arange(size)).flatten()
        offset = start - first * size
        return slots[offset : offset + stop - start].to(device or self.device)

    def write_tokens(self, blocks: Sequence[int], start: int, token_ids: Sequence[int] | None, count: int) -> None:
        """Record the ids of positions [start, start + count) (NO_TOKEN for each when not given)."""
        if count == 1:  # a decode step: one slot, found and written without building tensors
            size = self.block_tokens
            token = token_ids[0] if token_ids is not None and len(token_ids) == 1 else NO_TOKEN
            self.tokens[blocks[start // size] * size + start % size] = token
            return
        slots = self.slot_index(blocks, start, start + count, torch.device("cpu"))
        if token_ids is not None and len(token_ids) == count:
            self.tokens[slots] = torch.tensor(list(token_ids), dtype=torch.int32)
        else:
            self.tokens[slots] = NO_TOKEN

    def read_tokens(self, blocks: Sequence[int], stop: int) -> list[int]:
        """The token ids of positions [0, stop) under table `blocks` (NO_TOKEN where none was given)."""
        if stop == 0:
            return []
        return self.tokens[self.slot_index(blocks, 0, stop, torch.device("cpu"))].tolist()


def consecutive(blocks: Sequence[int], count: int) -> bool:
    """Whether the table's first `count` entries are b, b + 1, ..., b + count - 1."""
    if count <= 1:
        return True
    first = blocks[0]
    return blocks[count - 1] == first + count - 1 and list(blocks[:count]) == list(range(first, first + count))


def runs_of(blocks: Sequence[int], count: int, most: int) -> list[tuple[int, int]] | None:
    """The table's first `count` entries as runs of consecutive ids, (first id, length) each, or
    None when there are more than `most`."""
    runs: list[tuple[int, int]] = []
    for block in blocks[:count]:
        if runs and block == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        elif len(runs) == most:
            return None
        else:
            runs.append((block, 1))
    return runs


class BlockTableKV:
    """One session's frame over its block table: the cache object the runtime hands its layers.

    pos_start: where the frame's positions start; positions before it are read from the pool as
    the table says (the stage has checked that this stream wrote them). count: the frame's tokens.
    """

    def __init__(self, pool: KVPool, blocks: Sequence[int], pos_start: int, count: int) -> None:
        self.pool = pool
        self.blocks = blocks if isinstance(blocks, list) else list(blocks)
        self._length = pos_start
        self._start, self._stop = pos_start, pos_start + count
        self._base: int | None = None  # consecutive blocks: the slot of position 0
        self._runs: list[tuple[int, int]] | None = None  # else a few runs of blocks, read run by run
        self._read: torch.Tensor | None = None  # else the slots of [0, stop), gathered
        self._write: torch.Tensor | None = None  # the slots of [start, stop) (not consecutive)

    @property
    def length(self) -> int:
        """Positions the frame may read before its own."""
        return self._length

    @property
    def room(self) -> int:
        """Positions the table covers: the most a frame over it may reach."""
        return len(self.blocks) * self.pool.block_tokens

    @property
    def window(self) -> tuple[int, int]:
        """The positions [start, stop) the frame writes (begin's)."""
        return self._start, self._stop

    def truncate(self, length: int) -> None:
        """pos_start is authoritative: positions past it are simply overwritten later."""
        if length < 0:
            raise ValueError(f"cannot truncate to a negative length ({length})")
        self._length = min(self._length, length)

    def begin(self, start: int, count: int) -> None:
        """Open the write window [start, start + count), and plan how its layers read: one view, a
        view per run of consecutive blocks (a long table in a few runs), or one gather."""
        stop = start + count
        if stop > self.room:
            raise ValueError(f"positions up to {stop} need more than the table's {len(self.blocks)} blocks")
        self._start, self._stop = start, stop
        size = self.pool.block_tokens
        used = -(-stop // size)
        self._base = self._runs = self._read = self._write = None
        if consecutive(self.blocks, used):
            self._base = self.blocks[0] * size if self.blocks else 0
            return
        if stop >= SPLIT_MIN_POSITIONS and count <= SPLIT_MAX_QUERIES:
            self._runs = runs_of(self.blocks, used, MAX_SPLIT_RUNS)
        if self._runs is not None:
            self._write = self.pool.slot_index(self.blocks, start, stop)
        else:
            self._read = self.pool.slot_index(self.blocks, 0, stop)
            self._write = self._read[start:stop]

    def end(self) -> None:
        self._length = self._stop

    def write_slots(self) -> torch.Tensor:
        """The pool slots of the write window [start, stop) (for a pass that writes every segment at once)."""
        if self._base is not None:
            return torch.arange(self._base + self._start, self._base + self._stop, device=self.pool.device)
        assert self._write is not None, "write_slots() before begin()"
        return self._write

    def read(self, layer: torch.Tensor) -> KeysValues:
        """The keys and values of positions [0, stop) in `layer` (the pool's [2, kv_heads, slots,
        head_dim] for one layer), each [1, kv_heads, stop, head_dim]: a view, or one gather; or,
        for a long table in a few runs, a view per run (KVSpans, which attention merges)."""
        if self._base is not None:
            window = layer.narrow(2, self._base, self._stop)
            return window[0:1], window[1:2]
        if self._runs is not None:
            size, position, spans = self.pool.block_tokens, 0, KVSpans([], [], [])
            for first, length in self._runs:
                window = layer.narrow(2, first * size, min(length * size, self._stop - position))
                spans.keys.append(window[0:1])
                spans.values.append(window[1:2])
                spans.starts.append(position)
                position += window.shape[2]
            return spans, None
        assert self._read is not None, "read() before begin()"
        gathered = layer.index_select(2, self._read)
        return gathered[0:1], gathered[1:2]

    def write(self, rows: torch.Tensor, layer_idx: int) -> KeysValues:
        """This layer's new keys and values [2, kv_heads, T, head_dim] (in the pool's dtype) into their
        slots; returns the keys and values of positions [0, stop) (see read)."""
        layer = self.pool.store[layer_idx - self.pool.layer_offset]
        if self._base is not None:
            layer[:, :, self._base + self._start : self._base + self._stop].copy_(rows)
        else:
            assert self._write is not None, "write() before begin()"
            layer.index_copy_(2, self._write, rows.to(layer.dtype))
        return self.read(layer)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object,
               **kwargs: object) -> KeysValues:
        """The transformers Cache protocol (a single-frame pass): new rows [1, kv_heads, T, head_dim] each."""
        return self.write(torch.cat((key_states, value_states)).to(self.pool.dtype), layer_idx)


class PassWrites:
    """The slots every segment of a batched pass writes, when all of them are frames over one pool:
    each layer's new rows then go in with one index_copy_, not one copy per session (at 48 sessions
    the per-session copies were a tenth of a stage's step)."""

    def __init__(self, caches: Sequence[BlockTableKV]) -> None:
        self.pool = caches[0].pool
        self.caches = caches
        self.slots = torch.cat([cache.write_slots() for cache in caches])

    @staticmethod
    def over_one_pool(caches: Sequence[object]) -> bool:
        first = caches[0]
        return isinstance(first, BlockTableKV) and all(
            isinstance(c, BlockTableKV) and c.pool is first.pool for c in caches)

    def write(self, rows: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Every segment's new rows [2, kv_heads, T_total, head_dim] (the pool's dtype, in segment
        order) into their slots; returns the layer's [2, kv_heads, slots, head_dim] to read from."""
        layer = self.pool.store[layer_idx - self.pool.layer_offset]
        layer.index_copy_(2, self.slots, rows)
        return layer


class PagedFrames:
    """Where a pass's frames (all over one pool, begun) write and read, as the native attention over
    block tables takes them (native_kernels.paged_attention, which writes each layer's new rows too):
    every table in one int32 tensor, and per frame (its table's offset there, its start, its count of
    queries, its first row in the pass). Built once a pass; each layer is then one call for every session."""

    def __init__(self, caches: Sequence[BlockTableKV]) -> None:
        self.pool = caches[0].pool
        tables: list[int] = []
        frames: list[tuple[int, int, int, int]] = []
        row = 0
        for cache in caches:
            start, stop = cache.window
            frames.append((len(tables), start, stop - start, row))
            tables.extend(cache.blocks[: -(-stop // self.pool.block_tokens)])
            row += stop - start
        self.tables = torch.tensor(tables, dtype=torch.int32)
        self.frames = torch.tensor(frames, dtype=torch.int64)

    @classmethod
    def of(cls, caches: Sequence[object]) -> PagedFrames | None:
        """The pass's PagedFrames, or None where the native attention does not take it: caches not all
        frames over one pool, or a frame of more than PAGED_MAX_QUERIES queries."""
        if not PassWrites.over_one_pool(caches):
            return None
        frames: Sequence[BlockTableKV] = caches  # type: ignore[assignment]
        if any(cache.window[1] - cache.window[0] > PAGED_MAX_QUERIES for cache in frames):
            return None
        return cls(frames)

    def layer(self, layer_idx: int) -> torch.Tensor:
        """The pool's [2, kv_heads, slots, head_dim] of a layer."""
        return self.pool.store[layer_idx - self.pool.layer_offset]
