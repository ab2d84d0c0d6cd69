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

The stage itself keeps no per-session cache: its KV lives in one pool of blocks
(kv_pool.BlockTableKV). SessionKV serves a single model run outside a stage (the frontend's draft
model, tests). CacheKV is what the runtime asks of either.
"""

from __future__ import annotations

from typing import Protocol

import torch

from inferencemesh.modeling.attention import KeysValues

INITIAL_CAPACITY = 256


class CacheKV(Protocol):
    """What the runtime's forward passes ask of a session's cache (SessionKV, kv_pool.BlockTableKV)."""

    @property
    def length(self) -> int: ...

    @property
    def room(self) -> int: ...

    def truncate(self, length: int) -> None: ...

    def begin(self, start: int, count: int) -> None: ...

    def end(self) -> None: ...

    def write(self, rows: torch.Tensor, layer_idx: int) -> KeysValues: ...

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object,
               **kwargs: object) -> KeysValues: ...


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

    @property
    def room(self) -> int:
        """The most positions it can hold (it grows up to max_context)."""
        return self._max_context

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
        [layers, 2, kv_heads, stop - start, head_dim]."""
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
