"""The models shipped inside the package (trained by tools/train_bundled_models.py).

`imesh-code-target` is the default model of `inferencemesh serve`; `imesh-code-draft` is its
speculative draft, declared in the target's model-package.json.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

DEFAULT_MODEL = "imesh-code-target"
DRAFT_MODEL = "imesh-code-draft"
SCHEME = "bundled://"


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
    """A model argument as given by a user -> a local path or hub id.

    None means the bundled default; `bundled://NAME` names a bundled model (the operator and
    the images use that form, since the package path differs between machines).
    """
    if source is None:
        return str(bundled_path())
    if source.startswith(SCHEME):
        return str(bundled_path(source[len(SCHEME) :]))
    return source
