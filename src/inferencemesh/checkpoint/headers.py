"""A checkpoint's safetensors headers and shard index, checked as the safetensors library checks
them before it maps a file, so that a bad file is refused when it is read (by `plan`, and before a
stage loads), in one line naming the file and the tensor."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from inferencemesh.checkpoint.errors import CheckpointError, shown
from inferencemesh.checkpoint.facts import DTYPE_BYTES, TensorInfo

SAFETENSORS_INDEX = "model.safetensors.index.json"
SINGLE_SAFETENSORS = "model.safetensors"
# The most a safetensors header may take (the safetensors library's own limit).
MAX_HEADER_BYTES = 100 * 1000 * 1000
# Safetensors dtypes a checkpoint may carry that no stage loads yet (other 8-bit floats, 4- and
# 6-bit floats): refused by name, "not supported yet", never a KeyError. F8_E4M3 is served
# inside a quantized checkpoint (checkpoint/quantization.py).
UNSUPPORTED_DTYPES = ("F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "U16", "U32", "U64", "C64")


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
        raise CheckpointError(f"{where}: tensor {shown(name)}: its header entry is not an object")
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        known = isinstance(dtype, str) and dtype in UNSUPPORTED_DTYPES
        raise CheckpointError(
            f"{where}: tensor {shown(name)} has dtype {shown(dtype, 24)}, which "
            + ("InferenceMesh cannot load yet (of 8-bit floats only F8_E4M3 is served, in FP8 checkpoints)"
               if known else "is not a safetensors dtype InferenceMesh knows")
            + f"; supported: {', '.join(DTYPE_BYTES)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise CheckpointError(f"{where}: tensor {shown(name)} has shape {shown(shape, 40)}, not a list of "
                              "non-negative integers")
    info = TensorInfo(name, dtype, tuple(shape), shard)
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)):
        raise CheckpointError(f"{where}: tensor {shown(name)} has data_offsets {shown(offsets, 40)}, not two "
                              "non-negative integers")
    begin, end = offsets
    if end - begin != info.nbytes:
        raise CheckpointError(f"{where}: tensor {shown(name)}: its data_offsets [{begin}, {end}) span "
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
            raise CheckpointError(f"{path}: tensor {shown(name)}: its data_offsets [{span[0]}, {span[1]}) reach "
                                  f"past the file's {body} bytes of tensor data (a truncated or forged file)")
        tensors[name] = info
        spans.append((*span, name))
    reached = 0
    for begin, end, name in sorted(spans):
        if begin != reached:
            how = "overlaps the tensor before it" if begin < reached else "leaves a gap before it"
            raise CheckpointError(f"{path}: tensor {shown(name)}: its data_offsets [{begin}, {end}) {how} "
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
            raise CheckpointError(f"{path}: tensor {shown(name)} is mapped to {shown(shard)}, not a .safetensors "
                                  "file beside the index")
    return dict(wmap)


def refuse_without_safetensors(where: str | Path, files: list[str]) -> None:
    if not any(f.endswith(".safetensors") for f in files):
        pickled = [f for f in files if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
        gguf = sorted(f for f in files if f.endswith(".gguf"))
        if gguf:
            raise CheckpointError(f"{where}: GGUF files ({', '.join(gguf[:2])}) are not served: give the Hugging "
                                  "Face safetensors checkpoint they were converted from (16-bit, or a "
                                  "compressed-tensors W4A16/W8A16/FP8 export)")
        detail = f" (found only pickle-based weights: {', '.join(sorted(pickled)[:3])})" if pickled else ""
        raise CheckpointError(
            f"{where}: no safetensors weights{detail}. InferenceMesh loads safetensors only and never "
            "unpickles model files; convert the checkpoint to safetensors first."
        )
