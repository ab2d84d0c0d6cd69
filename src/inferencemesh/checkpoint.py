"""What a checkpoint holds, learned without loading it: config, tensor names, shapes and bytes.

Both the planner (which needs per-layer byte counts) and the stage loader (which needs to
know which shard holds which tensor) start here. Only safetensors headers are read: a
checkpoint's weights are never materialised to describe it.
"""

from __future__ import annotations

import contextlib
import json
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

SAFETENSORS_INDEX = "model.safetensors.index.json"
SINGLE_SAFETENSORS = "model.safetensors"
CONFIG_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "model-package.json",
]
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
TORCH_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


class CheckpointError(ValueError):
    """The checkpoint cannot be served: unsupported family, pickle-only weights, missing files."""


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

    def layer_bytes(self, dtype_bytes: int | None = None) -> list[int]:
        sizes = [0] * self.num_layers
        for info in self.tensors.values():
            group = classify(info.name)
            if group.kind == "layer" and group.layer < self.num_layers:
                sizes[group.layer] += self._scaled(info, dtype_bytes)
        return sizes

    def group_bytes(self, kind: str, dtype_bytes: int | None = None) -> int:
        return sum(self._scaled(t, dtype_bytes) for t in self.tensors.values() if classify(t.name).kind == kind)

    def head_bytes(self, dtype_bytes: int | None = None) -> int:
        """Bytes the last stage holds for the LM head: a tied head reuses the embedding matrix."""
        head = self.group_bytes("head", dtype_bytes)
        return head if head else self.group_bytes("embed", dtype_bytes)

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

    @staticmethod
    def _scaled(info: TensorInfo, dtype_bytes: int | None) -> int:
        if dtype_bytes is None:
            return info.nbytes
        return info.nbytes // DTYPE_BYTES[info.dtype] * dtype_bytes


def read_safetensors_header(path: Path) -> dict:
    """The JSON header of a .safetensors file (8-byte little-endian length, then JSON)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > 100 * 1024 * 1024:
            raise CheckpointError(f"{path}: implausible safetensors header length {length}")
        return json.loads(f.read(length))


def _tensors_from_header(header: dict, shard: str) -> dict[str, TensorInfo]:
    return {
        name: TensorInfo(name, meta["dtype"], tuple(meta["shape"]), shard)
        for name, meta in header.items()
        if name != "__metadata__"
    }


def weight_map(model_dir: Path) -> dict[str, str]:
    """tensor name -> shard file, from the index or the single-file checkpoint."""
    index = model_dir / SAFETENSORS_INDEX
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    single = model_dir / SINGLE_SAFETENSORS
    if single.exists():
        return {name: SINGLE_SAFETENSORS for name in read_safetensors_header(single) if name != "__metadata__"}
    refuse_without_safetensors(model_dir, [p.name for p in model_dir.iterdir()])
    raise AssertionError("unreachable")


def refuse_without_safetensors(where: str | Path, files: list[str]) -> None:
    if not any(f.endswith(".safetensors") for f in files):
        pickled = [f for f in files if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
        detail = f" (found only pickle-based weights: {', '.join(sorted(pickled)[:3])})" if pickled else ""
        raise CheckpointError(
            f"{where}: no safetensors weights{detail}. InferenceMesh loads safetensors only and never "
            "unpickles model files; convert the checkpoint to safetensors first."
        )


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

    why = families.refusal(config)
    if why is not None:
        model_type = config.get("model_type", "")
        raise CheckpointError(f"{where}: model_type {model_type!r} cannot be served: {why} "
                              "(`inferencemesh models` lists the families served)")


def read_local(model_dir: str | Path, *, headers_of: list[str] | None = None) -> CheckpointFacts:
    """Describe a local checkpoint directory from config.json and the safetensors headers.

    headers_of limits which shards are opened (a stage only needs its own); by default all.
    """
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{model_dir}: no config.json (is this a Hugging Face model directory?)")
    config = config_of(config_path.read_text(), model_dir)
    check_supported(config, model_dir)
    wmap = weight_map(model_dir)
    shards = sorted(set(wmap.values())) if headers_of is None else headers_of
    facts = CheckpointFacts(config)
    for shard in shards:
        facts.tensors.update(_tensors_from_header(read_safetensors_header(model_dir / shard), shard))
    if headers_of is None:
        check_tensor_names(facts, model_dir)
    return facts


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


def read_hub(repo_id: str, *, revision: str | None = None, token: str | None = None) -> CheckpointFacts:
    """Describe a hub checkpoint from config.json and the safetensors headers only.

    Downloads config.json and reads shard headers through HTTP range requests
    (huggingface_hub.get_safetensors_metadata); no weights are fetched.
    """
    from huggingface_hub import HfApi, hf_hub_download

    config = config_of(Path(hf_hub_download(repo_id, "config.json", revision=revision, token=token)).read_text(),
                       repo_id)
    check_supported(config, repo_id)
    api = HfApi(token=token)
    files = api.list_repo_files(repo_id, revision=revision)
    refuse_without_safetensors(repo_id, files)
    meta = api.get_safetensors_metadata(repo_id, revision=revision)
    facts = CheckpointFacts(config)
    for shard, file_meta in meta.files_metadata.items():
        for name, tensor in file_meta.tensors.items():
            facts.tensors[name] = TensorInfo(name, tensor.dtype, tuple(tensor.shape), shard)
    check_tensor_names(facts, repo_id)
    return facts


def is_local(source: str | Path) -> bool:
    return Path(source).exists()


def check_source(source: str | Path) -> None:
    """Refuse a model argument that is meant as a path but names nothing (a hub id is
    `name` or `namespace/name`; anything else is taken for a path)."""
    text = str(source)
    if is_local(text):
        return
    if text.startswith(("/", ".", "~")) or text.count("/") > 1 or "\\" in text:
        raise CheckpointError(f"model path {text} does not exist (give a model directory with config.json "
                              "and safetensors weights, or a hub id such as namespace/name)")


@contextlib.contextmanager
def hub_errors(repo_id: str) -> Iterator[None]:
    """Turn huggingface_hub's failures into one CheckpointError a person can act on."""
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, OfflineModeIsEnabled

    try:
        yield
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as err:
        raise CheckpointError(
            f"cannot fetch {repo_id} from the model hub (it is unreachable or HF_HUB_OFFLINE is set, and the "
            "local cache lacks it): pass a local model directory, or populate the cache and set HF_HUB_OFFLINE=1"
        ) from err
    except HFValidationError as err:
        raise CheckpointError(f"{repo_id} is neither an existing directory nor a valid hub id ({err})") from err
    except OSError as err:  # requests' connection errors are OSErrors
        raise CheckpointError(f"cannot reach the model hub for {repo_id} ({type(err).__name__}): pass a local "
                              "model directory, or populate the cache and set HF_HUB_OFFLINE=1") from err


def fetch_config_dir(source: str, *, revision: str | None = None, cache_dir: str | None = None) -> Path:
    """A directory with the model's config and tokenizer files; a hub id fetches only those."""
    check_source(source)
    if is_local(source):
        return Path(source)
    from huggingface_hub import snapshot_download

    with hub_errors(source):
        return Path(snapshot_download(source, revision=revision, cache_dir=cache_dir, allow_patterns=CONFIG_FILES))


def read_checkpoint(source: str | Path, *, revision: str | None = None) -> CheckpointFacts:
    check_source(source)
    if is_local(source):
        return read_local(source)
    with hub_errors(str(source)):
        return read_hub(str(source), revision=revision)
