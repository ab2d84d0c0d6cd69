"""Per-session KV cache for one stage's layers.

One preallocated buffer for every layer's keys and values, [layers, 2, kv_heads, capacity,
head_dim] (one tensor, so a batched pass moves a session's whole cache in one copy), grown
geometrically (never re-concatenated per token) up to the stage's max_context. Truncation only
moves the length: a frame whose pos_start is behind the cache rolls back in O(1), and the
positions behind the new length are simply overwritten by the next write.

The object also speaks the part of the transformers Cache protocol that decoder layers use:
attention calls update(key, value, layer_idx) with the new rows and gets back the keys and
values of every position so far. The runtime opens a write window with begin() before running
its layers and commits it with end().

PaddedBatch is the other way a batched pass attends: the sessions' caches gathered once per
pass into one zero-padded tensor, so each layer attends for all of them in one call.
"""

from __future__ import annotations

import math

import torch

from inferencemesh.planner import reserved_kv_positions

INITIAL_CAPACITY = 256


def prefix_cache_room(*, max_sessions: int, max_context: int, cache_tokens: int, live_sessions: int = 0) -> int:
    """KV positions a stage's prefix-cache entries may hold: those reserved for them alone
    (--prefix-cache-tokens) and every session slot no live session uses, max_context each. The
    planner reserves max_sessions x max_context + cache_tokens positions, so entries and live
    sessions together stay within it. The stage evicts entries past this (stage/sessions.py); the
    frontend bounds its index of them by the most it can be, with no live session
    (frontend/engine/prefix_cache.py)."""
    reserved = reserved_kv_positions(max_sessions=max_sessions, max_context=max_context, cache_tokens=cache_tokens)
    return reserved - live_sessions * max_context


class SessionKV:
    """The KV cache of one session for layers [layer_offset, layer_offset + num_layers)."""

    def __init__(
        self,
        num_layers: int,
        layer_offset: int,
        kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_context: int,
    ) -> None:
        self._num_layers = num_layers
        self._layer_offset = layer_offset
        self._shape = (1, kv_heads, 0, head_dim)
        self._dtype = dtype
        self._device = device
        self._max_context = max_context
        self._store: torch.Tensor | None = None  # [layers, 2 (keys, values), kv_heads, capacity, head_dim]
        self._capacity = 0
        self._length = 0
        # The write window [_start, _stop) of the forward in progress.
        self._start = 0
        self._stop = 0

    @property
    def length(self) -> int:
        """Positions held."""
        return self._length

    @property
    def capacity(self) -> int:
        return self._capacity

    def truncate(self, length: int) -> None:
        """Forget every position at or after `length` (no-op if the cache holds fewer)."""
        if length < 0:
            raise ValueError(f"cannot truncate to a negative length ({length})")
        if length < self._length:
            self._length = length

    def nbytes(self) -> int:
        return 0 if self._store is None else self._store.numel() * self._store.element_size()

    def release(self) -> None:
        """Free the buffers. The session may be used again; it starts empty."""
        self._store = None
        self._capacity = self._length = 0

    def copy_prefix(self, source: SessionKV, length: int) -> None:
        """Hold exactly `source`'s first `length` positions (a forked session's start): one copy
        of every layer's keys and values; `source` is left as it was."""
        store = source._store  # held here: the source may be released while this copies
        if length > source.length or (length and store is None):
            raise ValueError(f"cannot copy {length} positions of a cache that holds {source.length}")
        self._length = 0
        if length:
            if length > self._capacity:
                self._grow(length)
            assert store is not None  # checked above: a source with positions has its store
            self._allocated[..., :length, :].copy_(store[..., :length, :])
        self._length = length

    # ------------------------------------------------------------------ used by the runtime

    def begin(self, start: int, count: int) -> None:
        """Open the write window [start, start + count): the next layers write there."""
        stop = start + count
        if stop > self._capacity:
            self._grow(stop)
        self._start, self._stop = start, stop

    def end(self) -> None:
        """Commit the write window: the cache now holds exactly the positions before its end."""
        self._length = self._stop

    def _grow(self, needed: int) -> None:
        capacity = max(INITIAL_CAPACITY, self._capacity)
        while capacity < needed:
            capacity *= 2
        capacity = min(capacity, self._max_context)
        if capacity < needed:
            raise ValueError(f"{needed} positions exceed max_context {self._max_context}")
        _, heads, _, dim = self._shape
        store = torch.empty((self._num_layers, 2, heads, capacity, dim), dtype=self._dtype, device=self._device)
        if self._store is not None and self._length:
            store[..., : self._length, :].copy_(self._store[..., : self._length, :])
        self._store = store
        self._capacity = capacity

    @property
    def _allocated(self) -> torch.Tensor:
        assert self._store is not None, "the cache is read or written before room was made for it"
        return self._store

    def positions(self, start: int, stop: int) -> torch.Tensor:
        """Every layer's keys and values at positions [start, stop): a view
        [layers, 2, kv_heads, stop - start, head_dim] (PaddedBatch reads and writes through it)."""
        return self._allocated[..., start:stop, :]

    # ------------------------------------------------------------------ transformers Cache protocol

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the window's new rows for this layer; return keys and values of all positions so far."""
        layer = self._allocated[layer_idx - self._layer_offset]
        start, stop = self._start, self._stop
        layer[0:1, :, start:stop].copy_(key_states)
        layer[1:2, :, start:stop].copy_(value_states)
        return layer[0:1, :, :stop], layer[1:2, :, :stop]

    def write(self, rows: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """update() for a batched pass: this layer's new keys and values as one tensor
        [2, kv_heads, T, head_dim] already in the cache's dtype, written in one copy."""
        layer = self._allocated[layer_idx - self._layer_offset]
        stop = self._stop
        layer[:, :, self._start : stop].copy_(rows)
        return layer[0:1, :, :stop], layer[1:2, :, :stop]


class Scratch:
    """One flat buffer, reused pass after pass and grown to the largest asked for: a fresh
    tensor of tens of megabytes per pass costs more in page faults than the attention it feeds."""

    def __init__(self) -> None:
        self._flat: torch.Tensor | None = None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised tensor of `shape`, valid until the next take()."""
        numel = math.prod(shape)
        flat = self._flat
        if flat is None or flat.numel() < numel or flat.dtype != dtype or flat.device != device:
            flat = self._flat = torch.empty(numel, dtype=dtype, device=device)
        return flat[:numel].view(shape)

    def nbytes(self) -> int:
        return 0 if self._flat is None else self._flat.numel() * self._flat.element_size()


class PaddedBatch:
    """A batched pass's sessions, each with a frame of `count` tokens at its own start, attended
    together: their caches are gathered once per pass into one tensor
    [layers, 2, N, kv_heads, longest, head_dim] (zeros past each session's frame), each layer
    writes its new rows there in one indexed copy and attends over it in one call, and the new
    rows go back to the sessions' caches once, after the last layer (write_back).

    Zeros, not garbage, past a session's end: a masked key still meets its value in attention's
    weighted sum, where 0 * NaN would poison the row."""

    def __init__(self, caches: list[SessionKV], starts: list[int], count: int, scratch: Scratch) -> None:
        first = caches[0]
        self._caches, self._starts, self._count = caches, starts, count
        self._layer_offset = first._layer_offset
        longest = max(starts) + count
        _, heads, _, dim = first._shape
        self._rows = scratch.take((first._num_layers, 2, len(caches), heads, longest, dim), first._dtype,
                                  first._device)
        for i, (kv, start) in enumerate(zip(caches, starts, strict=True)):
            self._rows[:, :, i, :, :start].copy_(kv.positions(0, start))
            self._rows[:, :, i, :, start + count :].zero_()
        # Where each new row goes: session i's t-th token is row (i, starts[i] + t).
        offsets = torch.arange(count, device=first._device)
        self._session_index = torch.arange(len(caches), device=first._device).repeat_interleave(count)
        self._position_index = (torch.tensor(starts, device=first._device)[:, None] + offsets).flatten()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this layer's new rows (packed [1, kv_heads, N * count, head_dim], session after
        session); return its keys and values [N, kv_heads, longest, head_dim]."""
        keys, values = self._rows[layer_idx - self._layer_offset]
        # .to: a half-precision model's cache is float32 on CPU (attention.kv_cache_dtype).
        keys[self._session_index, :, self._position_index] = key_states[0].transpose(0, 1).to(keys.dtype)
        values[self._session_index, :, self._position_index] = value_states[0].transpose(0, 1).to(values.dtype)
        return keys, values

    def write_back(self) -> None:
        """Copy the pass's new rows, every layer's, into the sessions' own caches."""
        for i, (kv, start) in enumerate(zip(self._caches, self._starts, strict=True)):
            stop = start + self._count
            kv.positions(start, stop).copy_(self._rows[:, :, i, :, start:stop])
