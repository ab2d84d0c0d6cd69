"""The checkpoint's tokenizer: its JSON files checked when a model is read, and loaded without its code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from inferencemesh.checkpoint.errors import CheckpointError, first_line

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


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
            raise CheckpointError(f"{path}: not JSON text ({first_line(err)})") from None
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
               if custom else f"its tokenizer cannot be loaded ({first_line(err)})")
        raise CheckpointError(f"{model_dir}: {why}") from None
