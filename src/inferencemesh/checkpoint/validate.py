"""Whether a checkpoint can be served: its config (a JSON object, a family that can be split into
stages, unquantized or in a served quantized format: checkpoint/quantization.py) and its tensor
names (the standard layout's, by which layers are counted and selected)."""

from __future__ import annotations

import json
from pathlib import Path

from inferencemesh.checkpoint.errors import CheckpointError, shown
from inferencemesh.checkpoint.facts import CheckpointFacts
from inferencemesh.checkpoint.quantization import module_of, refusal


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

    why_not = refusal(config)
    if why_not is not None:
        raise CheckpointError(f"{where}: {why_not}")
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


def check_quantized(facts: CheckpointFacts, where: str | Path) -> None:
    """Refuse quantized tensors the config does not explain (8-bit floats without a
    quantization_config, a scale of the wrong shape or missing), in one line."""
    try:
        quantized = facts.quantized_modules()
    except CheckpointError as err:
        raise CheckpointError(f"{where}: {err}") from None
    for info in facts.tensors.values():
        if info.dtype == "F8_E4M3" and module_of(info.name) not in quantized:
            raise CheckpointError(f"{where}: tensor {shown(info.name)} is F8_E4M3, but config.json has no "
                                  "quantization_config saying how it is scaled (an FP8 checkpoint names its format "
                                  "there: compressed-tensors or fp8)")
