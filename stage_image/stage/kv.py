"""Per-session KV cache for one stage's layers.

One preallocated key and value buffer per layer, [1, kv_heads, capacity, head_dim], grown
geometrically (never re-concatenated per token) up to the stage's max_context. Truncation only
moves the length: a frame whose pos_start is behind the cache rolls back in O(1), and the
positions behind the new length are simply overwritten by the next write.

The object also speaks the part of the transformers Cache protocol that decoder layers use:
attention calls update(key, value, layer_idx) with the new rows and gets back the keys and
values of every position so far. The runtime opens a write window with begin() before running
its layers and commits it with end().
"""

from __future__ import annotations

import torch

INITIAL_CAPACITY = 256


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
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
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
        return sum(t.numel() * t.element_size() for t in self._keys + self._values)

    def release(self) -> None:
        """Free the buffers. The session may be used again; it starts empty."""
        self._keys, self._values = [], []
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
        b, heads, _, dim = self._shape
        keep = self._length

        def grown(old: torch.Tensor | None) -> torch.Tensor:
            new = torch.empty((b, heads, capacity, dim), dtype=self._dtype, device=self._device)
            if old is not None and keep:
                new[:, :, :keep].copy_(old[:, :, :keep])
            return new

        old_k = self._keys or [None] * self._num_layers
        old_v = self._values or [None] * self._num_layers
        self._keys = [grown(t) for t in old_k]
        self._values = [grown(t) for t in old_v]
        self._capacity = capacity

    # ------------------------------------------------------------------ transformers Cache protocol

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the window's new rows for this layer; return keys and values of all positions so far."""
        i = layer_idx - self._layer_offset
        keys, values = self._keys[i], self._values[i]
        start, stop = self._start, self._stop
        keys[:, :, start:stop].copy_(key_states)
        values[:, :, start:stop].copy_(value_states)
        return keys[:, :, :stop], values[:, :, :stop]


def gather_padded(views: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sessions' keys and values of one layer, each [1, kv_heads, length_i, head_dim] (what
    update() returns), as [N, kv_heads, longest, head_dim] tensors with zeros past each length:
    the form attention.PaddedAttention takes. Zeros, not garbage: a masked key still meets its
    value in the weighted sum (0 * NaN would poison the row)."""
    first = views[0][0]
    longest = max(k.shape[2] for k, _ in views)
    shape = (len(views), first.shape[1], longest, first.shape[3])
    keys = torch.zeros(shape, dtype=first.dtype, device=first.device)
    values = torch.zeros(shape, dtype=first.dtype, device=first.device)
    for i, (k, v) in enumerate(views):
        keys[i, :, : k.shape[2]].copy_(k[0])
        values[i, :, : v.shape[2]].copy_(v[0])
    return keys, values
