"""CheckpointFacts: what a checkpoint holds (config, tensor names, dtypes, shapes, bytes), from metadata."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inferencemesh.checkpoint.quantization import QuantizedModule

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1}
TORCH_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    shard: str  # file name within the checkpoint

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for dim in self.shape:
            n *= dim
        return n


@dataclass(frozen=True)
class TensorGroup:
    """Where a tensor belongs in a layer split."""

    kind: str  # "layer" | "embed" | "norm" | "head" | "other"
    layer: int = -1


def classify(name: str) -> TensorGroup:
    match = _LAYER_KEY.match(name)
    if match:
        return TensorGroup("layer", int(match.group(1)))
    if name.startswith("model.embed_tokens."):
        return TensorGroup("embed")
    if name.startswith("model.norm."):
        return TensorGroup("norm")
    if name.startswith("lm_head."):
        return TensorGroup("head")
    return TensorGroup("other")


@dataclass
class CheckpointFacts:
    """Everything the planner and loader need to know about a checkpoint, from metadata only."""

    config: dict
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "")

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))

    @property
    def num_kv_heads(self) -> int:
        return int(self.config.get("num_key_value_heads") or self.config["num_attention_heads"])

    @property
    def head_dim(self) -> int:
        return int(self.config.get("head_dim") or self.hidden_size // int(self.config["num_attention_heads"]))

    @property
    def checkpoint_dtype(self) -> str:
        """The torch dtype name the config declares (float32 when it declares none)."""
        return str(self.config.get("dtype") or self.config.get("torch_dtype") or "float32")

    def quantized_modules(self) -> dict[str, QuantizedModule]:
        """The linear layers the checkpoint holds quantized (checkpoint/quantization.py), by module name."""
        from inferencemesh.checkpoint.quantization import quantized_modules

        return quantized_modules(self.config, self.tensors)

    def layer_bytes(self, dtype_bytes: int | None = None, quantize: str | None = None) -> list[int]:
        """Bytes per layer: as stored (dtype_bytes None), or as a stage computing in dtype_bytes-wide
        floats holds them (a quantized linear layer as modeling/quantized.py lays it out; with
        quantize, a 16-bit checkpoint's linear layers quantized so as they are read)."""
        from inferencemesh.checkpoint.quantization import held_bytes, quantized_at_load

        sizes = [0] * self.num_layers
        quantized = self.quantized_modules() if dtype_bytes is not None else {}
        for info in self.tensors.values():
            group = classify(info.name)
            if group.kind == "layer" and group.layer < self.num_layers:
                at_load = quantized_at_load(info.name, info.shape, quantize) if quantize and dtype_bytes else None
                if at_load and dtype_bytes:
                    sizes[group.layer] += held_bytes(at_load, info.shape[0], info.shape[1], dtype_bytes)
                else:
                    sizes[group.layer] += self._held(info, dtype_bytes, quantized)
        return sizes

    def group_bytes(self, kind: str, dtype_bytes: int | None = None, quantize: str | None = None, *,
                    as_head: bool = False) -> int:
        """Bytes of a group's tensors (see layer_bytes; with quantize, the embedding or head
        quantized as it is read). as_head: the embedding's matrix as the LM head a tied model's
        last stage makes of it."""
        from inferencemesh.checkpoint.quantization import (
            HEAD_WEIGHT,
            held_bytes,
            held_embedding_bytes,
            quantized_at_load,
        )

        quantized = self.quantized_modules() if dtype_bytes is not None else {}
        total = 0
        for info in self.tensors.values():
            if classify(info.name).kind != kind:
                continue
            table = kind == "embed" and not as_head
            at_load = quantized_at_load(HEAD_WEIGHT if as_head else info.name, info.shape, quantize) \
                if quantize and dtype_bytes else None
            if at_load and dtype_bytes:
                rows, columns = info.shape
                total += held_embedding_bytes(at_load, rows, columns, dtype_bytes) if table \
                    else held_bytes(at_load, rows, columns, dtype_bytes)
            else:
                total += self._held(info, dtype_bytes, quantized)
        return total

    def head_bytes(self, dtype_bytes: int | None = None, quantize: str | None = None) -> int:
        """Bytes the last stage holds for the LM head: a tied head is the embedding matrix (as it is,
        or quantized as a head)."""
        head = self.group_bytes("head", dtype_bytes, quantize)
        return head if head else self.group_bytes("embed", dtype_bytes, quantize, as_head=True)

    def shards_for(self, names: list[str]) -> list[str]:
        return sorted({self.tensors[n].shard for n in names})

    def stage_tensor_names(self, layer_start: int, layer_end: int) -> list[str]:
        """The tensors a stage holding layers [layer_start, layer_end) must load."""
        first, last = layer_start == 0, layer_end == self.num_layers
        keep = []
        for name in self.tensors:
            group = classify(name)
            if (
                (group.kind == "layer" and layer_start <= group.layer < layer_end)
                or (group.kind == "embed" and (first or (last and self.tie_word_embeddings)))
                or (group.kind in ("norm", "head") and last)
            ):
                keep.append(name)
        return sorted(keep)

    @classmethod
    def _held(cls, info: TensorInfo, dtype_bytes: int | None, quantized: dict[str, QuantizedModule]) -> int:
        """A tensor's bytes in a stage: a quantized layer's all counted on its weight, its other tensors 0."""
        from inferencemesh.checkpoint.quantization import held_on, module_of

        module = module_of(info.name) if quantized else None
        if dtype_bytes is None or module not in quantized:
            return cls._scaled(info, dtype_bytes)
        return held_on(info.name, info.shape, quantized[module], dtype_bytes)  # type: ignore[index]

    @staticmethod
    def _scaled(info: TensorInfo, dtype_bytes: int | None) -> int:
        if dtype_bytes is None:
            return info.nbytes
        return info.nbytes // DTYPE_BYTES[info.dtype] * dtype_bytes
