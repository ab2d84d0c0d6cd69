"""gpt-oss's MoE experts kept in MXFP4: the checkpoint's blocks (e2m1 values, two a byte) and E8M0
scales held as stored, half a byte and 1/32 of a byte a weight, and dequantized an expert at a
time, a tile of rows at a time, only for the experts a pass routes tokens to.

Swapped in for transformers' GptOssExperts (the layer's `mlp.experts`) by the loader; the router,
the gate (GptOssExperts._apply_gate, transformers' own) and the rest of the layer stay
transformers'. The dequantization is transformers' own (integrations.mxfp4.convert_moe_packed_
tensors, the format's reader there), which gives a tile exactly the float weights transformers
computes with on a CPU (e2m1 x 2^k is exact in float32 and bfloat16). On CUDA the same path runs
(a Triton MXFP4 MoE kernel, as transformers' with `kernels` and vLLM's, is the later step).
"""

from __future__ import annotations

import torch
from torch import nn

from inferencemesh.checkpoint.errors import CheckpointError

TILE_VALUES = 1 << 20  # weights dequantized at a time (4 MiB in float32): an expert of gpt-oss-20b is 16 Mi


def fits_experts(target: object) -> bool:
    """Whether `target` is an experts module of gpt-oss's kind (fused [experts, in, out] weights and a gate)."""
    return isinstance(target, nn.Module) and all(hasattr(target, a) for a in (
        "gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias", "_apply_gate"))


class Mxfp4Experts(nn.Module):
    """GptOssExperts with its gate_up_proj and down_proj held in MXFP4."""

    gate_up_proj_blocks: torch.Tensor
    gate_up_proj_scales: torch.Tensor
    down_proj_blocks: torch.Tensor
    down_proj_scales: torch.Tensor
    gate_up_proj_bias: nn.Parameter
    down_proj_bias: nn.Parameter

    def __init__(self, experts: nn.Module, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.num_experts = int(experts.num_experts)  # type: ignore[arg-type]
        self.hidden_size, self.intermediate_size = int(experts.hidden_size), int(experts.intermediate_size)  # type: ignore[arg-type]
        self.alpha, self.limit = experts.alpha, experts.limit
        self._gate = type(experts)._apply_gate  # type: ignore[attr-defined]  # transformers' clamp and GLU
        self.compute_dtype = dtype
        for proj in ("gate_up_proj", "down_proj"):
            self.register_buffer(f"{proj}_blocks", tensors[f"{proj}_blocks"].to(device, torch.uint8).contiguous())
            self.register_buffer(f"{proj}_scales", tensors[f"{proj}_scales"].to(device, torch.uint8).contiguous())
            bias = tensors[f"{proj}_bias"].to(device, dtype)
            setattr(self, f"{proj}_bias", nn.Parameter(bias, requires_grad=False))

    @classmethod
    def from_checkpoint(cls, experts: object, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                        device: torch.device) -> Mxfp4Experts:
        """From the experts module the model built (its shapes) and the checkpoint's tensors by suffix."""
        assert isinstance(experts, nn.Module)
        e, h, i = int(experts.num_experts), int(experts.hidden_size), int(experts.intermediate_size)  # type: ignore[arg-type]
        for proj, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            want = {"blocks": (e, rows, cols // 32, 16), "scales": (e, rows, cols // 32), "bias": (e, rows)}
            for part, shape in want.items():
                got = tensors.get(f"{proj}_{part}")
                if got is None or tuple(got.shape) != shape:
                    found = "none" if got is None else list(got.shape)
                    raise CheckpointError(f"MXFP4 experts: {proj}_{part} is {found}, but {e} experts of {rows}x{cols} "
                                          f"need {list(shape)}")
        return cls(experts, tensors, dtype, device)

    def forward(self, hidden_states: torch.Tensor, router_indices: torch.Tensor | None = None,
                routing_weights: torch.Tensor | None = None) -> torch.Tensor:
        """GptOssExperts.forward's routing: each expert that a token is routed to runs on those tokens."""
        assert router_indices is not None and routing_weights is not None
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = torch.nn.functional.one_hot(router_indices, num_classes=self.num_experts).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert in hit[:, 0].tolist():
            top_k_pos, token_idx = torch.where(mask[expert])
            x = hidden_states[token_idx].to(self.compute_dtype)
            gate_up = self._matmul(x, expert, "gate_up_proj") + self.gate_up_proj_bias[expert]
            y = self._matmul(self._gate(self, gate_up), expert, "down_proj") + self.down_proj_bias[expert]
            out.index_add_(0, token_idx, (y * routing_weights[token_idx, top_k_pos, None]).to(hidden_states.dtype))
        return out

    def _matmul(self, x: torch.Tensor, expert: int, proj: str) -> torch.Tensor:
        """x @ W_expert^T, W dequantized a tile of output rows at a time by transformers' reader."""
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        blocks, scales = getattr(self, f"{proj}_blocks")[expert], getattr(self, f"{proj}_scales")[expert]
        rows, cols = blocks.shape[0], blocks.shape[1] * 32
        tile = max(1, TILE_VALUES // cols)
        out = torch.empty(x.shape[0], rows, dtype=x.dtype, device=x.device)
        for a in range(0, rows, tile):
            b = min(a + tile, rows)
            weight_t = convert_moe_packed_tensors(blocks[None, a:b], scales[None, a:b], dtype=x.dtype)[0]  # [in, rows]
            out[:, a:b] = x @ weight_t
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.buffers(), *self.parameters()])

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, mxfp4"
