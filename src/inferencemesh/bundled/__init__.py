"""The models shipped inside the package (trained by tools/train_bundled_models.py).

`imesh-code-target` is the default model of `inferencemesh serve`; `imesh-code-draft` is its
speculative draft, declared in the target's model-package.json.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from inferencemesh.checkpoint.errors import CheckpointError

DEFAULT_MODEL = "imesh-code-target"
DRAFT_MODEL = "imesh-code-draft"
SCHEME = "bundled://"
# A folder of more models that bundled://NAME also names, searched before the package's own
# (tests give the operator small models this way).
EXTRA_DIR_ENV = "INFERENCEMESH_BUNDLED_DIR"


def bundled_path(name: str = DEFAULT_MODEL) -> Path:
    path = Path(str(resources.files(__name__) / name))
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"bundled model {name!r} is not installed at {path}")
    return path


def served_name(source: str | None, served_model_name: str | None = None) -> str:
    """The model name clients use, and the `model_name` label on the metrics of every process
    of a mesh (so dashboards can join them): the explicit name, else bundled://NAME -> NAME,
    a local path -> its folder's name, a hub id as given (vLLM's rule)."""
    if served_model_name:
        return served_model_name
    if source is None:
        return DEFAULT_MODEL
    if source.startswith(SCHEME):
        return source[len(SCHEME) :]
    if source.startswith(("/", ".", "~")) or Path(source).exists():
        return Path(source.rstrip("/")).name
    return source


def resolve_model(source: str | None) -> str:
    """A model argument as given by a user -> a local path or hub id: the one place that reads
    `bundled://`.

    None means the bundled default; `bundled://NAME` names a bundled model (the operator and
    the images use that form, since the package path differs between machines). NAME is one
    folder name: a path out of the package (`bundled://../../etc`) is refused, as is a name no
    bundled model has (CheckpointError, which the programs report in one line).
    """
    if source is None:
        return str(bundled_path())
    if not source.startswith(SCHEME):
        return source
    name = source[len(SCHEME):]
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise CheckpointError(f"{source!r}: a bundled model is named bundled://NAME")
    extra = os.environ.get(EXTRA_DIR_ENV)
    if extra and (Path(extra) / name).is_dir():
        return str(Path(extra) / name)
    try:
        return str(bundled_path(name))
    except FileNotFoundError as err:
        raise CheckpointError(f"{source!r}: no bundled model {name!r} in this package") from err
