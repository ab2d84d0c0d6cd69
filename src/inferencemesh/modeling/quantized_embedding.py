"""An embedding table held quantized: each row dequantized as a lookup reads it (the values a
linear weight of that shape would have, modeling/quantized.py's quantized_values)."""

from __future__ import annotations

import torch
from torch import nn

from inferencemesh.checkpoint.quantization import WeightQuant
from inferencemesh.modeling.quantized import quantized_values, unsigned_nibbles


class QuantizedEmbedding(nn.Module):
    """An embedding table [rows, hidden] held quantized (quantized_values: the values a linear
    weight of that shape would have), its rows dequantized as a lookup reads them: INT8 and FP8 a
    byte a value, INT4 two (the even column in the low nibble), one float32-computed scale per row
    or per group of a row, kept in the compute dtype (held_embedding_bytes counts exactly these).
    embed_scale: the multiplier of a scaled embedding (Gemma 3's), applied as it applies it."""

    values: torch.Tensor
    scale: torch.Tensor

    def __init__(self, quant: WeightQuant, weight: torch.Tensor, dtype: torch.dtype, device: torch.device,
                 embed_scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.quant, self.compute_dtype = quant, dtype
        self.num_embeddings, self.embedding_dim = weight.shape
        q, scale = quantized_values(quant, weight)
        if quant.kind == "int" and quant.bits == 4:
            unsigned = unsigned_nibbles(q)
            q = (unsigned[:, 0::2] & 0x0F | unsigned[:, 1::2] << 4).to(torch.uint8)
        self.register_buffer("values", q.to(device))
        self.register_buffer("scale", scale.to(device, dtype))
        self.embed_scale = None if embed_scale is None else float(embed_scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self._rows(ids.reshape(-1)).view(*ids.shape, self.embedding_dim)
        return out * torch.tensor(self.embed_scale, dtype=out.dtype) if self.embed_scale is not None else out

    def dequantized(self) -> torch.Tensor:
        """The whole table in the compute dtype, unscaled (a new tensor: for checks, never per call)."""
        return self._rows(torch.arange(self.num_embeddings, device=self.values.device))

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        # FP8 rows gathered as their bytes: CUDA's index_select is not built for float8 in every torch
        rows = self.values.view(torch.uint8).index_select(0, ids).view(self.values.dtype)
        if rows.dtype == torch.uint8:  # INT4: each byte two signed values (stored plus 8)
            rows = torch.stack([rows & 0x0F, rows >> 4], -1).reshape(len(ids), -1).to(torch.float32) - 8
        # multiplied in float32, as a dequantized matrix (q x scale) is made
        scale = self.scale.index_select(0, ids).to(torch.float32)
        grouped = rows.to(torch.float32).view(len(ids), scale.shape[1], -1) * scale[..., None]
        return grouped.view(len(ids), self.embedding_dim).to(self.compute_dtype)
