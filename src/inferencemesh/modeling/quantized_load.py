"""A stage's quantized linear layers, put in place as its tensors are read (modeling/loader.py
calls these): a quantized checkpoint's layers built from their tensors (swap_quantized), or a
16-bit checkpoint's dense linear layers (and its embedding and head, tied or not) quantized one by one
as they are read (quantizer)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from inferencemesh.checkpoint.errors import CheckpointError
from inferencemesh.checkpoint.facts import CheckpointFacts
from inferencemesh.checkpoint.quant_types import WeightQuant
from inferencemesh.checkpoint.quantization import (
    EMBEDDING_WEIGHT,
    HEAD_WEIGHT,
    LOAD_METHODS,
    quant_method,
    quantized_at_load,
)
from inferencemesh.modeling.quantized import quantize
from inferencemesh.modeling.quantized_embedding import QuantizedEmbedding
from inferencemesh.modeling.quantized_formats import build_quantized, fits


def quantizer(model: nn.Module, facts: CheckpointFacts, method: str | None, dtype: torch.dtype,
              device: torch.device, source: str | Path, *, first: bool,
              last: bool) -> Callable[[str, torch.Tensor], bool] | None:
    """With a quantization method: a function that takes a tensor just read and, when it is a dense
    linear layer's weight, swaps a QuantizedLinear of it into the model (True: consumed, so the
    float tensor is dropped at once and the stage never holds its layers in float). A tied
    embedding matrix read by the `last` stage becomes its LM head, quantized as a head (and the
    table too when the stage is also the `first`)."""
    if method is None:
        return None
    if method not in LOAD_METHODS:
        raise CheckpointError(f"quantization {method!r} is not one of {', '.join(LOAD_METHODS)}")
    if facts.quantized_modules() or quant_method(facts.config):
        raise CheckpointError(f"{source}: the checkpoint is quantized already ({quant_method(facts.config)}); "
                              f"serve it without --quantization")

    def consume(name: str, tensor: torch.Tensor) -> bool:
        if name == EMBEDDING_WEIGHT and last and facts.tie_word_embeddings:
            head = quantized_at_load(HEAD_WEIGHT, tuple(tensor.shape), method)
            if head is None:  # stays 16-bit (an INT4 group that does not divide it), tied as planned
                return False
            model.lm_head = quantize(head, tensor, dtype, device)
            if not first:
                return True  # only the head reads it here
        quant = quantized_at_load(name, tuple(tensor.shape), method)
        parent_name, _, child = name.removesuffix(".weight").rpartition(".")
        try:
            parent = model.get_submodule(parent_name) if quant else None
        except AttributeError:  # a name transformers renames as it loads: stays as it is, as planned
            parent = None
        linear = getattr(parent, child, None)
        if quant is not None and isinstance(linear, nn.Embedding):
            setattr(parent, child, _quantized_embedding(linear, quant, tensor, dtype, device, source))
            return True
        if quant is None or not isinstance(linear, nn.Linear):
            return False
        q = quantize(quant, tensor, dtype, device)
        if linear.bias is not None:  # its bias, read before or after it, is assigned into it later
            q.bias = linear.bias
        setattr(parent, child, q)
        return True

    return consume


def _quantized_embedding(embedding: nn.Embedding, quant: WeightQuant, weight: torch.Tensor, dtype: torch.dtype,
                         device: torch.device, source: str | Path) -> QuantizedEmbedding:
    """The table quantized, for a plain embedding or one that only scales its rows (Gemma 3's); the
    plan counted it quantized, so any other kind is refused rather than left in float."""
    scale = getattr(embedding, "embed_scale", None)
    plain = type(embedding) is nn.Embedding or (scale is not None and type(embedding).__name__.endswith(
        "ScaledWordEmbedding"))
    if not plain or embedding.max_norm is not None:
        raise CheckpointError(f"{source}: its embedding ({type(embedding).__name__}) cannot be quantized at load; "
                              "serve it without --quantization")
    return QuantizedEmbedding(quant, weight, dtype, device, embed_scale=scale)


def swap_quantized(model: nn.Module, tensors: dict[str, torch.Tensor], facts: CheckpointFacts, modules: list[str],
                    dtype: torch.dtype, device: torch.device, source: str | Path) -> None:
    """Replace each quantized linear layer (by its checkpoint name, which is its module path) with a
    QuantizedLinear built from its tensors, taken out of `tensors`."""
    described = facts.quantized_modules()
    for name in modules:
        parent_name, _, child = name.rpartition(".")
        try:
            parent = model.get_submodule(parent_name)
        except AttributeError:
            parent = None
        target = getattr(parent, child, None)
        spec = described[name]
        if not fits(spec, target):
            raise CheckpointError(f"{source}: quantized tensors of {name} ({spec.out_features}x{spec.in_features}) "
                                  "match no linear layer of that shape in the model (only linear layers named as "
                                  "the model names them are served quantized)")
        own = {key.removeprefix(name + "."): tensors.pop(key) for key in [k for k in tensors
                                                                          if k.startswith(name + ".")]}
        if "bias" in own:
            own["bias"] = own["bias"].to(dtype)
        setattr(parent, child, build_quantized(spec, own, target, dtype, device))
