"""A model argument (a local directory or a hub id) -> its CheckpointFacts, from config.json and
the safetensors headers only, or a directory with its config and tokenizer files."""

from __future__ import annotations

from pathlib import Path

from inferencemesh.checkpoint.errors import CheckpointError
from inferencemesh.checkpoint.facts import CheckpointFacts
from inferencemesh.checkpoint.headers import refuse_without_safetensors, safetensors_tensors, tensor_info, weight_map
from inferencemesh.checkpoint.hub import CONFIG_FILES, hub_errors
from inferencemesh.checkpoint.tokenizer import check_tokenizer_files
from inferencemesh.checkpoint.validate import check_quantized, check_supported, check_tensor_names, config_of


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
    check_quantized(facts, model_dir)
    return facts


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
    check_quantized(facts, repo_id)
    return facts


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
