"""The types checkpoint/quantization.py and its format readers share: how a linear layer's weight
is quantized (WeightQuant), a quantized module found in a checkpoint (QuantizedModule), and what
is read of a tensor's header (TensorInfo)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


class TensorInfo(Protocol):
    """What is read of a tensor here (facts.TensorInfo; not imported: facts counts bytes with this module)."""

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class WeightQuant:
    """How one linear layer's weight is quantized."""

    kind: str  # "int" | "float" | "mxfp4"
    bits: int  # 4 | 8
    strategy: str  # "tensor" | "channel" | "group" | "block"
    group_size: int = 0  # "group": inputs per scale
    block: tuple[int, int] = (0, 0)  # "block": [outputs, inputs] per scale
    symmetric: bool = True
    packed: bool = False  # int32 words of `bits`-bit values (pack-quantized)
    scale_name: str = "weight_scale"  # transformers' fp8 stores the scale's inverse name, same meaning
    layout: str = ""  # "" (compressed-tensors, fp8), "awq", "gptq" (zeros stored minus one), "gptq_v2", "mxfp4"
    act_order: bool = False  # GPTQ desc_act: groups are not contiguous inputs; a permutation is held

    @property
    def name(self) -> str:
        return {"float": "fp8", "mxfp4": "mxfp4"}.get(self.kind, f"int{self.bits}")

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        """The [rows, columns] the scales must have (a tensor's or channel's may drop dims)."""
        if self.strategy == "group":
            return out_features, in_features // self.group_size
        if self.strategy == "block":
            return math.ceil(out_features / self.block[0]), math.ceil(in_features / self.block[1])
        return (out_features, 1) if self.strategy == "channel" else (1, 1)


@dataclass(frozen=True)
class QuantizedModule:
    quant: WeightQuant
    out_features: int
    in_features: int
