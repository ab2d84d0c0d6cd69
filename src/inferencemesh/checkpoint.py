"""What a checkpoint holds, learned without loading it: config, tensor names, shapes and bytes.

Both the planner (which needs per-layer byte counts) and the stage loader (which needs to
know which shard holds which tensor) start here. Only safetensors headers are read: a
checkpoint's weights are never materialised to describe it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import struct
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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


# The most a safetensors header may take (the safetensors library's own limit).
MAX_HEADER_BYTES = 100 * 1000 * 1000
# Safetensors dtypes a checkpoint may carry that no stage loads yet (8-bit floats, packed
# quantized formats): refused by name, "not supported yet", never a KeyError.
UNSUPPORTED_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "U16", "U32", "U64", "C64")


def _shown(text: object, limit: int = 80) -> str:
    """A name from a file, quoted and cut short: a hostile header's names may be long or span lines."""
    quoted = repr(str(text))
    return quoted if len(quoted) <= limit else quoted[:limit - 4] + "...'"


def read_safetensors_header(path: Path) -> dict:
    """The JSON header of a .safetensors file (8-byte little-endian length, then JSON), checked:
    a length that fits the file, JSON text of an object. Its entries are checked by
    safetensors_tensors."""
    return _read_header(path)[0]


def _read_header(path: Path) -> tuple[dict, int]:
    """read_safetensors_header's header, and the bytes of tensor data after it."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, shorter than its header length)")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES or length > size - 8:
                raise CheckpointError(f"{path}: safetensors header length {length} is implausible for a file of "
                                      f"{size} bytes (truncated or not a safetensors file)")
            text = f.read(length)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: the safetensors file is missing (the index names it)") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a directory, not a safetensors file") from None
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError; RecursionError: nesting
        detail = str(err).splitlines()[0][:120] if str(err) else type(err).__name__
        raise CheckpointError(f"{path}: the safetensors header is not JSON text ({detail})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    return header, size - 8 - length


def tensor_info(name: str, meta: object, shard: str, where: str | Path) -> tuple[TensorInfo, tuple[int, int]]:
    """One header entry as a TensorInfo, and its data offsets: a known dtype, a shape of
    non-negative integers, offsets that span exactly dtype x shape bytes."""
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where}: tensor {_shown(name)}: its header entry is not an object")
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        known = isinstance(dtype, str) and dtype in UNSUPPORTED_DTYPES
        raise CheckpointError(
            f"{where}: tensor {_shown(name)} has dtype {_shown(dtype, 24)}, which "
            + ("InferenceMesh cannot load yet (8-bit float and quantized checkpoints are not supported yet)"
               if known else "is not a safetensors dtype InferenceMesh knows")
            + f"; supported: {', '.join(DTYPE_BYTES)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise CheckpointError(f"{where}: tensor {_shown(name)} has shape {_shown(shape, 40)}, not a list of "
                              "non-negative integers")
    info = TensorInfo(name, dtype, tuple(shape), shard)
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)):
        raise CheckpointError(f"{where}: tensor {_shown(name)} has data_offsets {_shown(offsets, 40)}, not two "
                              "non-negative integers")
    begin, end = offsets
    if end - begin != info.nbytes:
        raise CheckpointError(f"{where}: tensor {_shown(name)}: its data_offsets [{begin}, {end}) span "
                              f"{end - begin} bytes, but {dtype} x {list(shape)} is {info.nbytes} bytes")
    return info, (begin, end)


def safetensors_tensors(path: Path, shard: str) -> dict[str, TensorInfo]:
    """The tensors a .safetensors file holds, from its header, checked as the safetensors library
    checks before it maps the file (so that a bad file is refused when it is read, by `plan` and
    before a stage loads, in one line naming the file and the tensor): every entry's dtype, shape
    and offsets (tensor_info), the tensors packed in the body from its start, without gaps or
    overlaps, ending exactly where the file ends."""
    header, body = _read_header(path)
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        info, span = tensor_info(name, meta, shard, path)
        if span[1] > body:
            raise CheckpointError(f"{path}: tensor {_shown(name)}: its data_offsets [{span[0]}, {span[1]}) reach "
                                  f"past the file's {body} bytes of tensor data (a truncated or forged file)")
        tensors[name] = info
        spans.append((*span, name))
    reached = 0
    for begin, end, name in sorted(spans):
        if begin != reached:
            how = "overlaps the tensor before it" if begin < reached else "leaves a gap before it"
            raise CheckpointError(f"{path}: tensor {_shown(name)}: its data_offsets [{begin}, {end}) {how} "
                                  "(the tensors must be packed one after another)")
        reached = end
    if reached != body:
        raise CheckpointError(f"{path}: the tensors' data ends at byte {reached} of a body of {body} bytes "
                              "(a truncated or padded file)")
    return tensors


def weight_map(model_dir: Path) -> dict[str, str]:
    """tensor name -> shard file, from the index or the single-file checkpoint."""
    index = model_dir / SAFETENSORS_INDEX
    if index.exists():
        return read_index(index)
    single = model_dir / SINGLE_SAFETENSORS
    if single.exists():
        return {name: SINGLE_SAFETENSORS for name in read_safetensors_header(single) if name != "__metadata__"}
    refuse_without_safetensors(model_dir, [p.name for p in model_dir.iterdir()])
    raise AssertionError("unreachable")


def read_index(path: Path) -> dict[str, str]:
    """model.safetensors.index.json's weight_map (tensor name -> shard file), checked: JSON, and
    each shard a .safetensors file beside the index (a name with a path in it could point a stage
    at any file on the machine)."""
    try:
        index = json.loads(path.read_text())
    except (ValueError, RecursionError) as err:
        raise CheckpointError(f"{path}: not JSON text ({str(err).splitlines()[0][:120] if str(err) else err!r})") \
            from None
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict):
        raise CheckpointError(f"{path}: has no weight_map object (tensor name -> shard file)")
    for name, shard in wmap.items():
        if not (isinstance(shard, str) and shard.endswith(".safetensors") and Path(shard).name == shard):
            raise CheckpointError(f"{path}: tensor {_shown(name)} is mapped to {_shown(shard)}, not a .safetensors "
                                  "file beside the index")
    return dict(wmap)


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

    quantization = config.get("quantization_config")
    if quantization is not None:  # its tensors are not the layers' weights (qweight, scales): no stage finds them
        method = quantization.get("quant_method", "unnamed") if isinstance(quantization, dict) else "unnamed"
        raise CheckpointError(f"{where}: a quantized checkpoint (quantization_config: {_shown(method, 40)}) "
                              "cannot be served yet; give its unquantized (float16, bfloat16 or float32) version")
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
        facts.tensors.update(safetensors_tensors(model_dir / shard, shard))
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
            entry = {"dtype": tensor.dtype, "shape": list(tensor.shape), "data_offsets": list(tensor.data_offsets)}
            facts.tensors[name] = tensor_info(name, entry, shard, f"{repo_id}/{shard}")[0]
    check_tensor_names(facts, repo_id)
    return facts


TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _first_line(err: BaseException, limit: int = 160) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:limit]}" if text else type(err).__name__


def check_tokenizer_files(model_dir: str | Path) -> None:
    """Refuse, in one line, tokenizer files that are not JSON objects: found when a model is read
    (`plan`, and `serve` before it starts anything), not when the frontend loads them."""
    for name in TOKENIZER_JSON_FILES:
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_bytes())
        except (ValueError, RecursionError) as err:
            raise CheckpointError(f"{path}: not JSON text ({_first_line(err)})") from None
        if not isinstance(data, dict):
            raise CheckpointError(f"{path}: not a JSON object")


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer, never its code (trust_remote_code=False: a tokenizer that
    transformers does not have built in is refused, never run), or CheckpointError in one line."""
    from transformers import AutoTokenizer

    check_tokenizer_files(model_dir)
    try:
        return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 - the tokenizers library's and transformers' many errors
        settings = Path(model_dir) / "tokenizer_config.json"
        custom = settings.is_file() and '"auto_map"' in settings.read_text(errors="replace")
        why = ("its tokenizer_config.json asks for the checkpoint's own tokenizer code (auto_map), which "
               "InferenceMesh never runs; give the model a tokenizer transformers has built in (a tokenizer.json)"
               if custom else f"its tokenizer cannot be loaded ({_first_line(err)})")
        raise CheckpointError(f"{model_dir}: {why}") from None


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


HUB_PROBE_TIMEOUT_S = 3.0
HUB_PROBE_TTL_S = 30.0  # a long-lived process (the operator) asks again after a while
PROXY_ENVS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
_hub_probe: tuple[float, str | None] | None = None  # (when asked, why unreachable or None)


def hub_unreachable() -> str | None:
    """Why the model hub cannot be reached from here (its host refuses a TCP connection, or has no
    address or route, within HUB_PROBE_TIMEOUT_S), or None: it can, HF_HUB_OFFLINE is set (nothing
    will be asked), or a proxy is configured (the proxy decides). Asked at most once per
    HUB_PROBE_TTL_S."""
    global _hub_probe
    from huggingface_hub import constants

    if constants.is_offline_mode() or any(os.environ.get(name) for name in PROXY_ENVS):
        return None
    if _hub_probe is None or time.monotonic() - _hub_probe[0] > HUB_PROBE_TTL_S:
        url = urllib.parse.urlsplit(constants.ENDPOINT)
        port = url.port or (443 if url.scheme == "https" else 80)
        why = None
        try:
            with socket.create_connection((url.hostname or "", port), timeout=HUB_PROBE_TIMEOUT_S):
                pass
        except OSError as err:
            why = f"{url.hostname}:{port}: {err.strerror or type(err).__name__}"
        _hub_probe = (time.monotonic(), why)
    return _hub_probe[1]


@contextlib.contextmanager
def _offline(on: bool) -> Iterator[None]:
    """huggingface_hub in offline mode meanwhile, as HF_HUB_OFFLINE=1 puts it (read on every
    request: constants.is_offline_mode): cached files are used, nothing is asked or retried."""
    from huggingface_hub import constants

    if not on or constants.HF_HUB_OFFLINE:
        yield
        return
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = False


@contextlib.contextmanager
def hub_errors(repo_id: str) -> Iterator[None]:
    """Turn huggingface_hub's failures into one CheckpointError a person can act on. When the hub
    cannot be reached (hub_unreachable: asked once), the calls inside run offline: a cached model
    still loads, an uncached one is refused at once with why, instead of after huggingface_hub's
    five retries with backoff (23 s)."""
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, OfflineModeIsEnabled

    unreachable = hub_unreachable()
    try:
        with _offline(unreachable is not None):
            yield
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as err:
        why = f"the model hub cannot be reached ({unreachable})" if unreachable else \
            "it is unreachable or HF_HUB_OFFLINE is set"
        raise CheckpointError(
            f"cannot fetch {repo_id} from the model hub ({why}, and the local cache lacks it): pass a local "
            "model directory, or populate the cache and set HF_HUB_OFFLINE=1"
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
        check_tokenizer_files(source)
        return read_local(source)
    with hub_errors(str(source)):
        return read_hub(str(source), revision=revision)
