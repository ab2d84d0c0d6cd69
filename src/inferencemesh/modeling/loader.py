"""Load one stage's slice of a Hugging Face causal LM: its layer range, plus the end-stage tensors.

Only what the stage runs is ever read: from a hub repo, only the config/tokenizer files and the
safetensors shards holding this stage's tensors are downloaded (found through
model.safetensors.index.json); the modules are built on the meta device and the tensors,
read with safetensors.safe_open from those shards only, are assigned into them. The whole
model is never materialised. Pickle-based weights are refused. A quantized checkpoint's linear
layers are read as they are stored and swapped for QuantizedLinear (modeling/quantized.py):
they stay quantized in memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from inferencemesh.checkpoint.errors import CheckpointError
from inferencemesh.checkpoint.facts import CheckpointFacts, TensorInfo, classify
from inferencemesh.checkpoint.headers import (
    SAFETENSORS_INDEX,
    SINGLE_SAFETENSORS,
    read_index,
    refuse_without_safetensors,
)
from inferencemesh.checkpoint.hub import CONFIG_FILES, hub_errors
from inferencemesh.checkpoint.read import check_source, is_local, read_local
from inferencemesh.checkpoint.validate import check_supported, config_of
from inferencemesh.compute_dtype import choose_dtype
from inferencemesh.modeling import attention, families
from inferencemesh.modeling.quantized import QuantizedLinear
from inferencemesh.modeling.quantized_load import quantizer, swap_quantized

log = logging.getLogger(__name__)

Progress = Callable[[str, float], None]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class StageModules:
    """The modules one stage runs, with real weights on the target device."""

    facts: CheckpointFacts
    config: object  # the transformers PretrainedConfig
    model_dir: Path
    embed: nn.Embedding | None  # first stage only
    layers: nn.ModuleList  # decoder layers [layer_start, layer_end), built with their global layer_idx
    norm: nn.Module | None  # last stage only
    lm_head: nn.Linear | None  # last stage only (its weight is the embedding matrix when tied)
    rotary: nn.Module
    dtype: torch.dtype
    device: torch.device


def resolve_dtype(name: str, config_dtype: str) -> torch.dtype:
    """'auto' means the checkpoint's declared dtype; otherwise one of float32|float16|bfloat16."""
    key = config_dtype if name == "auto" else name
    key = str(key).removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"unsupported dtype {key!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[key]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _noop(state: str, fraction: float) -> None:
    pass


# --------------------------------------------------------------------------- locating files


def locate(
    source: str | Path,
    layer_start: int,
    layer_end: int,
    *,
    revision: str | None = None,
    cache_dir: str | None = None,
    on_progress: Progress = _noop,
) -> tuple[Path, CheckpointFacts]:
    """A directory holding the config and every shard this stage reads, and the checkpoint's facts.

    A local directory is used as is. Anything else is a hub repo id: see _download. Either way
    only the headers of the stage's own shards are read, so facts.tensors covers those shards
    (shards holding none of the stage's tensors need not even be present).
    """
    check_source(source)
    if not is_local(source):
        with hub_errors(str(source)):
            return _download(
                str(source), layer_start, layer_end, revision=revision, cache_dir=cache_dir, on_progress=on_progress
            )
    model_dir = Path(source)
    config = _read_config(model_dir / "config.json", model_dir)
    files = [p.name for p in model_dir.iterdir()]
    shards = _stage_shards(model_dir, config, files, layer_start, layer_end, model_dir)
    facts = read_local(model_dir, headers_of=shards)
    _check_range(facts, layer_start, layer_end, model_dir)
    return model_dir, facts


def _read_config(path: Path, where: str | Path) -> dict:
    if not path.exists():
        raise CheckpointError(f"{where}: no config.json (is this a Hugging Face model?)")
    config = config_of(path.read_text(), where)
    check_supported(config, where)  # before any weight is fetched
    return config


def _stage_shards(
    directory: Path, config: dict, repo_files: list[str], layer_start: int, layer_end: int, where: str | Path
) -> list[str]:
    """The safetensors files holding the stage's tensors, from the index's weight_map.

    repo_files (what the checkpoint holds, here or on the hub) decides between a sharded
    checkpoint, a single model.safetensors, and a refusal when there are no safetensors.
    """
    index = directory / SAFETENSORS_INDEX
    if index.exists():
        wmap = read_index(index)
        # Only names and shards matter to select files; shapes come from the headers later.
        placeholder = CheckpointFacts(config, {n: TensorInfo(n, "U8", (0,), s) for n, s in wmap.items()})
        _check_range(placeholder, layer_start, layer_end, where)
        return placeholder.shards_for(placeholder.stage_tensor_names(layer_start, layer_end))
    if SINGLE_SAFETENSORS in repo_files:
        return [SINGLE_SAFETENSORS]
    refuse_without_safetensors(where, repo_files)
    raise CheckpointError(f"{where}: has safetensors files but neither {SAFETENSORS_INDEX} nor {SINGLE_SAFETENSORS}")


def _check_range(facts: CheckpointFacts, layer_start: int, layer_end: int, where: str | Path) -> None:
    if not 0 <= layer_start < layer_end <= facts.num_layers:
        raise CheckpointError(
            f"{where}: layer range [{layer_start}, {layer_end}) is not within [0, {facts.num_layers})"
        )


def _download(
    repo_id: str,
    layer_start: int,
    layer_end: int,
    *,
    revision: str | None,
    cache_dir: str | None,
    on_progress: Progress,
) -> tuple[Path, CheckpointFacts]:
    """Fetch config/tokenizer files and the index first, then only the shards this stage reads.

    Each shard is its own snapshot_download call (allow_patterns = that one file), which keeps
    the request minimal and lets progress be reported per shard. With HF_HUB_OFFLINE=1 the
    same calls resolve against the local Hugging Face cache.
    """
    from huggingface_hub import snapshot_download

    on_progress("downloading", 0.0)
    snapshot = Path(
        snapshot_download(
            repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=[*CONFIG_FILES, SAFETENSORS_INDEX]
        )
    )
    # The snapshot folder is named by the resolved commit: pinning it keeps every later call on
    # the same revision and spares them a round trip to resolve a branch name.
    commit = snapshot.name
    config = _read_config(snapshot / "config.json", repo_id)
    files = [] if (snapshot / SAFETENSORS_INDEX).exists() else _repo_files(repo_id, commit, cache_dir, snapshot)
    shards = _stage_shards(snapshot, config, files, layer_start, layer_end, repo_id)
    for i, shard in enumerate(shards):
        log.info("%s: downloading %s (%d/%d)", repo_id, shard, i + 1, len(shards))
        snapshot_download(repo_id, revision=commit, cache_dir=cache_dir, allow_patterns=[shard])
        on_progress("downloading", (i + 1) / len(shards))

    # Headers of the shards this stage holds only: the other shards are never fetched.
    facts = read_local(snapshot, headers_of=shards)
    _check_range(facts, layer_start, layer_end, repo_id)
    return snapshot, facts


def _repo_files(repo_id: str, commit: str, cache_dir: str | None, snapshot: Path) -> list[str]:
    """The repo's file list: the tree listing huggingface_hub cached, else what the snapshot holds."""
    try:
        from huggingface_hub import get_cached_repo_tree

        return [f.path for f in get_cached_repo_tree(repo_id, revision=commit, cache_dir=cache_dir)]
    except Exception:  # older huggingface_hub, or no cached listing: fall back to the local snapshot
        return [p.name for p in snapshot.iterdir()]


# --------------------------------------------------------------------------- building modules


def load_stage(
    source: str | Path,
    layer_start: int,
    layer_end: int,
    *,
    revision: str | None = None,
    dtype: str = "auto",
    device: str = "auto",
    cache_dir: str | None = None,
    on_progress: Progress | None = None,
    quantization: str | None = None,
) -> StageModules:
    """Locate (download if needed) and load the modules of the stage holding layers [layer_start, layer_end).

    quantization (int8, int4, fp8): a 16-bit checkpoint's dense linear layers quantized weight-only
    one by one as they are read (checkpoint.quantization.quantized_at_load says which and how)."""
    from transformers import AutoConfig

    on_progress = on_progress or _noop
    model_dir, facts = locate(
        source, layer_start, layer_end, revision=revision, cache_dir=cache_dir, on_progress=on_progress
    )
    on_progress("loading", 0.0)
    config = AutoConfig.from_pretrained(model_dir)
    torch_device = resolve_device(device)
    choice = choose_dtype(dtype, facts.checkpoint_dtype, on_cpu=torch_device.type == "cpu")
    log.info("layers %d:%d compute in %s on %s", layer_start, layer_end, choice, torch_device)
    torch_dtype = resolve_dtype(choice.name, facts.checkpoint_dtype)
    model = _build_on_meta(config, torch_dtype, facts, source)
    quantized = [m for m in facts.quantized_modules() if _in_stage(m + ".weight", layer_start, layer_end,
                                                                    facts.num_layers)]
    at_load = quantizer(model, facts, quantization, torch_dtype, torch_device, source,
                        first=layer_start == 0, last=layer_end == facts.num_layers)
    tensors = _read_tensors(model_dir, facts, layer_start, layer_end, torch_dtype, torch_device, on_progress,
                            keep_dtype=tuple(m + "." for m in quantized), consume=at_load)
    swap_quantized(model, tensors, facts, quantized, torch_dtype, torch_device, source)
    # its own (quantized) matrix, never the embedding's: the checkpoint's, or quantized as it was read
    head_quantized = isinstance(getattr(model, "lm_head", None), QuantizedLinear)
    tied_head = None if head_quantized else _take_tied_head(tensors, facts, layer_start, layer_end, source)
    _assign(model, tensors, torch_dtype, source)
    if not head_quantized:
        _tie_head(model, facts, layer_start, layer_end, tied_head)
    _check_loaded(model, facts, layer_start, layer_end, source)
    return _stage_modules(model, facts, config, model_dir, layer_start, layer_end, torch_dtype, torch_device)


def _build_on_meta(config: Any, dtype: torch.dtype, facts: CheckpointFacts, source: str | Path) -> Any:
    """The family's own causal LM, parameters on the meta device (nothing allocated) in the compute
    dtype: the stage keeps the modules it runs, and the checkpoint's tensors for those are assigned
    into them through transformers' own key conversion (MoE experts stored one by one are fused
    into the module's expert tensors as from_pretrained fuses them)."""
    config._attn_implementation = "eager"  # built as eager (a family refusing sdpa, Gemma2, still builds) ...
    model = families.build_causal_lm(config)
    # ... and run through our registered name (see attention.py): transformers' sdpa attention
    # (eager where scores are soft-capped), fed the runtime's sdpa-style boolean masks.
    config._attn_implementation = attention.NAME
    if (why := families.layout_refusal(model, config)) is not None:
        raise CheckpointError(f"{source}: {facts.model_type} cannot be split into stages: {why}")
    for module in model.modules():  # the compute dtype, still on meta (free): loading keeps a parameter's dtype
        for name, param in module._parameters.items():
            if param is not None and param.is_floating_point() and param.dtype != dtype:
                module._parameters[name] = nn.Parameter(param.to(dtype), requires_grad=False)
    return model


def _take_tied_head(tensors: dict[str, torch.Tensor], facts: CheckpointFacts, layer_start: int, layer_end: int,
                    source: str | Path) -> torch.Tensor | None:
    """On the last stage: the LM head's matrix when it is the embedding's (tied), taken out of
    tensors when this stage has no embedding of its own to share it with; None otherwise."""
    if layer_end != facts.num_layers or not (facts.tie_word_embeddings or "lm_head.weight" not in tensors):
        return None
    if not facts.tie_word_embeddings:
        raise CheckpointError(f"{source}: no lm_head.weight and tie_word_embeddings is false")
    tensors.pop("lm_head.weight", None)
    if "model.embed_tokens.weight" not in tensors:
        raise CheckpointError(f"{source}: no model.embed_tokens.weight, which the tied LM head is")
    # A tied head is the embedding matrix: read as the embedding's, shared by _tie_head.
    return tensors.pop("model.embed_tokens.weight") if layer_start != 0 else None


def _tie_head(model: Any, facts: CheckpointFacts, layer_start: int, layer_end: int,
              tied_head: torch.Tensor | None) -> None:
    """On the last stage, a tied LM head becomes the embedding matrix: the first stage's own
    embedding (the very tensor, held once), or the matrix _take_tied_head set aside."""
    if layer_end != facts.num_layers:
        return
    if layer_start == 0 and facts.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    elif tied_head is not None:
        model.lm_head.weight = nn.Parameter(tied_head, requires_grad=False)


def _check_loaded(model: nn.Module, facts: CheckpointFacts, layer_start: int, layer_end: int,
                  source: str | Path) -> None:
    """Refuse a stage with a parameter the checkpoint did not give (still on the meta device)."""
    # Named as the checkpoint names them (model.layers.N.…), so a user can look for them.
    unloaded = [name for name, p in model.named_parameters() if p.device.type == "meta"
                and _in_stage(name, layer_start, layer_end, facts.num_layers)]
    if unloaded:
        raise CheckpointError(f"{source}: the checkpoint has no tensor {', '.join(unloaded[:3])}"
                              f"{f' (and {len(unloaded) - 3} more)' if len(unloaded) > 3 else ''}, which "
                              f"layers {layer_start}:{layer_end} need")


def _stage_modules(model: Any, facts: CheckpointFacts, config: Any, model_dir: Path, layer_start: int,
                   layer_end: int, dtype: torch.dtype, device: torch.device) -> StageModules:
    """The loaded model's modules this stage runs, on the device, for inference; the rest is dropped."""
    base = model.model
    first, last = layer_start == 0, layer_end == facts.num_layers
    embed = base.embed_tokens if first else None
    layers = nn.ModuleList(base.layers[layer_start:layer_end])
    norm = base.norm if last else None
    lm_head = model.lm_head if last else None
    stage_modules = [m for m in (embed, layers, norm, lm_head) if m is not None]
    for module in stage_modules:
        module.to(device)  # buffers (computed at construction) join the loaded weights
    rotary = base.rotary_emb.to(device)  # small and computed, so built for real
    for module in stage_modules:
        module.eval().requires_grad_(False)
    return StageModules(facts, config, model_dir, embed, layers, norm, lm_head, rotary, dtype, device)


def _in_stage(name: str, layer_start: int, layer_end: int, num_layers: int) -> bool:
    """Whether the stage holding layers [layer_start, layer_end) runs the parameter `name`."""
    group = classify(name)
    return ((group.kind == "layer" and layer_start <= group.layer < layer_end)
            or (group.kind == "embed" and layer_start == 0)
            or (group.kind in ("norm", "head") and layer_end == num_layers))


def _assign(model: nn.Module, tensors: dict[str, torch.Tensor], dtype: torch.dtype, source: str | Path) -> None:
    """Assign checkpoint tensors into the meta-built model, keys converted as transformers'
    from_pretrained converts them (renamings, per-expert tensors merged into fused ones)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.utils import logging as hf_logging

    # Tensors stored under the module's own names are assigned as they are (no copy); only the
    # rest (per-expert tensors to fuse, renamed keys) go through the conversion, which copies.
    own = dict(model.named_parameters(remove_duplicate=False))
    direct = {name: tensors.pop(name) for name in [n for n in tensors if n in own]}
    for name, tensor in direct.items():  # one line naming the tensor, not load_state_dict's multi-line report
        if tensor.shape != own[name].shape:
            raise CheckpointError(f"{source}: tensor {name} has shape {list(tensor.shape)}, but the model its "
                                  f"config.json describes has {list(own[name].shape)} there")
    model.load_state_dict(direct, assign=True, strict=False)
    direct.clear()
    if not tensors:
        return
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        mapping: Any = get_model_conversion_mapping(model)  # type: ignore[arg-type]
        load = LoadStateDictConfig(weight_mapping=mapping, dtype=dtype)
        info, _ = convert_and_load_state_dict_in_model(model, tensors, load)  # type: ignore[arg-type]
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    unexpected = sorted(getattr(info, "unexpected_keys", None) or [])
    if unexpected:
        log.debug("%s: checkpoint tensors the model has no place for: %s", source, unexpected[:10])
    tensors.clear()


def _read_tensors(
    model_dir: Path,
    facts: CheckpointFacts,
    layer_start: int,
    layer_end: int,
    dtype: torch.dtype,
    device: torch.device,
    on_progress: Progress,
    keep_dtype: tuple[str, ...] = (),
    consume: Callable[[str, torch.Tensor], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Read this stage's tensors, shard by shard, converted to dtype and placed on device; those
    named with a keep_dtype prefix (quantized layers' weights and scales) keep theirs, and those
    `consume` takes (quantized as they are read) are not returned."""
    names = facts.stage_tensor_names(layer_start, layer_end)
    total = sum(facts.tensors[n].nbytes for n in names) or 1
    done, reported = 0, 0.0
    out: dict[str, torch.Tensor] = {}
    for shard in facts.shards_for(names):
        wanted = [n for n in names if facts.tensors[n].shard == shard]
        for name in wanted:
            # get_tensor returns a view of the memory-mapped shard, and the mapping stays alive
            # (every page touched counted as resident) while any view does. Copying into memory
            # the stage owns, and closing the shard per tensor, means the load never holds more
            # than one tensor's worth of file pages on top of the stage's own weights.
            try:
                with safe_open(str(model_dir / shard), framework="pt", device="cpu") as f:
                    tensor = f.get_tensor(name)
            except Exception as err:  # noqa: BLE001 - the file changed under us, or the library refuses it
                raise CheckpointError(f"{model_dir / shard}: tensor {name} cannot be read "
                                      f"({type(err).__name__}: {' '.join(str(err).split())[:200]})") from None
            target = dtype if tensor.is_floating_point() and not name.startswith(keep_dtype) else tensor.dtype
            if consume is None or not consume(name, tensor):
                out[name] = tensor.to(device=device, dtype=target, copy=True)
            del tensor
            done += facts.tensors[name].nbytes
            if done / total - reported >= 0.05 or done == total:  # a few updates, not one per tensor
                reported = done / total
                on_progress("loading", reported)
    return out
