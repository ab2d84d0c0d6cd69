"""Whether a checkpoint can be served: its config (a JSON object, a family that can be split into
stages, unquantized) and its tensor names (the standard layout's, by which layers are counted and
selected)."""

from __future__ import annotations

import json
from pathlib import Path

from inferencemesh.checkpoint.errors import CheckpointError, shown
from inferencemesh.checkpoint.facts import CheckpointFacts


def config_of(text: str, where: str | Path) -> dict:
    """A config.json's object, or CheckpointError saying why it is not one."""
    try:
        config = json.loads(text)
    except ValueError as err:
        raise CheckpointError(f"{where}: config.json is not JSON ({err})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{where}: config.json is not a JSON object")
    return config


def check_supported(config: dict, where: str | Path) -> None:
    """Refuse, with the reason, a checkpoint whose family cannot be split into stages (see
    modeling/families.py: any decoder-only causal LM of the installed transformers with the
    standard embed -> layers -> norm -> head layout is served)."""
    from inferencemesh.modeling import families  # transformers and torch, only when a config is checked

    quantization = config.get("quantization_config")
    if quantization is not None:  # its tensors are not the layers' weights (qweight, scales): no stage finds them
        method = quantization.get("quant_method", "unnamed") if isinstance(quantization, dict) else "unnamed"
        raise CheckpointError(f"{where}: a quantized checkpoint (quantization_config: {shown(method, 40)}) "
                              "cannot be served yet; give its unquantized (float16, bfloat16 or float32) version")
    why = families.refusal(config)
    if why is not None:
        model_type = config.get("model_type", "")
        raise CheckpointError(f"{where}: model_type {model_type!r} cannot be served: {why} "
                              "(`inferencemesh models` lists the families served)")


def check_tensor_names(facts: CheckpointFacts, where: str | Path) -> None:
    """Refuse a checkpoint whose tensors are not named as the standard layout names them
    (model.embed_tokens., model.layers.N.): a plan counts and a stage selects its layers by
    these names (some families' checkpoints keep older names, transformer.h.N., that
    transformers renames only as it loads them)."""
    if not facts.tensors:
        return  # no weights at all: refused where they are looked for
    empty = [i for i, size in enumerate(facts.layer_bytes()) if not size]
    missing = (["model.embed_tokens."] if not facts.group_bytes("embed") else []) + \
        ([f"model.layers.{empty[0]}."] if empty else [])
    if missing:
        some = ", ".join(sorted(facts.tensors)[:3])
        raise CheckpointError(f"{where}: model_type {facts.model_type!r} cannot be served: its checkpoint has no "
                              f"tensors named {' or '.join(missing)} (it names them e.g. {some}), which is how a "
                              "plan counts and a stage selects its layers")
