"""Which speculative strategy runs: decided once, here, for the frontend and the operator alike.

The rule: explicit configuration (the CLI's --speculative / --draft, or the InferenceMesh's
spec.speculative) > the model package's declared default (model-package.json) > auto. A draft
the package declares is skipped with --no-draft / noDraft. A draft that cannot be loaded means
serving without speculation and saying why, never failing start-up (`without_draft`).

The frontend calls `choose_speculation` and then loads the draft it names; the operator calls
the same function to report in the mesh's status what the frontend will run. Pure: no torch,
no I/O beyond reading model-package.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from inferencemesh.protocol.transport import MAX_WINDOW

PACKAGE_FILE = "model-package.json"


@dataclass(frozen=True)
class WindowPolicy:
    adaptive: bool = True
    initial: int = 4
    minimum: int = 1
    maximum: int = 8

    @classmethod
    def parse(cls, text: str | None, default: WindowPolicy | None = None) -> WindowPolicy:
        """'6' (fixed) or 'adaptive:INITIAL:MIN:MAX'."""
        if not text:
            return default or cls()
        if text.isdigit():
            k = int(text)
            return cls(adaptive=False, initial=k, minimum=k, maximum=k).checked()
        parts = text.split(":")
        if parts[0] != "adaptive" or len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
            raise ValueError(f"window {text!r}: use a number (fixed) or adaptive:INITIAL:MIN:MAX")
        return cls(True, int(parts[1]), int(parts[2]), int(parts[3])).checked()

    @classmethod
    def from_package(cls, spec: dict) -> WindowPolicy:
        return cls(
            adaptive=spec.get("default", "adaptive") == "adaptive",
            initial=int(spec.get("initial_window", 4)),
            minimum=int(spec.get("min_window", 1)),
            maximum=int(spec.get("max_window", 8)),
        ).checked()

    def checked(self) -> WindowPolicy:
        if not 1 <= self.minimum <= self.initial <= self.maximum <= MAX_WINDOW:
            raise ValueError(f"window sizes need 1 <= min <= initial <= max <= {MAX_WINDOW}, got {self}")
        return self

    def flag(self) -> str:
        """The --window text that parses back to this policy."""
        return f"adaptive:{self.initial}:{self.minimum}:{self.maximum}" if self.adaptive else str(self.initial)


# ---- what a model package declares ------------------------------------------------------------


class PackageError(ValueError):
    """model-package.json is malformed."""


@dataclass(frozen=True)
class DeclaredStrategy:
    name: str
    type: str  # "draft-model" | "ngram"
    draft_model: str | None = None
    window: WindowPolicy = field(default_factory=WindowPolicy)


def read_package_default(model_dir: Path) -> DeclaredStrategy | None:
    """The default strategy a model package declares, or None. Unknown fields are ignored.

    A relative draft path is resolved against the package's directory."""
    path = model_dir / PACKAGE_FILE
    if not path.exists():
        return None
    try:
        spec = json.loads(path.read_text())["generation"]["speculative_decoding"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise PackageError(f"{path}: no readable generation.speculative_decoding ({err})") from err
    if not isinstance(spec, dict) or "default" not in spec:
        raise PackageError(f"{path}: generation.speculative_decoding needs a 'default'")
    name = spec["default"]
    strategy = (spec.get("strategies") or {}).get(name)
    if not isinstance(strategy, dict):
        raise PackageError(f"{path}: default strategy {name!r} is not in 'strategies'")
    kind = strategy.get("type")
    if kind not in ("draft-model", "ngram"):
        raise PackageError(f"{path}: strategy {name!r} has unknown type {kind!r} (draft-model or ngram)")
    try:
        window = WindowPolicy.from_package(strategy.get("window_policy") or {})
    except (ValueError, TypeError) as err:
        raise PackageError(f"{path}: strategy {name!r} has a bad window_policy ({err})") from err
    draft = strategy.get("draft_model")
    if kind == "draft-model":
        if not isinstance(draft, str) or not draft:
            raise PackageError(f"{path}: draft-model strategy {name!r} needs 'draft_model'")
        relative = (model_dir / draft).resolve()
        draft = str(relative) if relative.exists() or draft.startswith(".") else draft
    return DeclaredStrategy(str(name), kind, draft, window)


# ---- the decision --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpeculativeChoice:
    strategy: str  # what runs: draft | ngram | auto | none
    reason: str  # one CamelCase word, for a status condition or a metric label
    message: str  # the sentence a person reads
    draft: str | None = None  # the draft model to load, when strategy is draft
    window: WindowPolicy = field(default_factory=WindowPolicy)

    def without_draft(self, why: str) -> SpeculativeChoice:
        """The draft named here cannot be used: serve without speculation, and say why."""
        return replace(self, strategy="none", reason="DraftUnavailable", draft=None,
                       message=f"draft model {self.draft} could not be loaded ({why}); serving without speculation")


def choose_speculation(*, strategy: str | None, draft: str | None = None, no_draft: bool = False,
                       window: str | None = None, declared: DeclaredStrategy | None = None,
                       package_error: str | None = None) -> SpeculativeChoice:
    """The strategy from the explicit settings (None: not set) and the package's declaration.

    `window` (the --window text) overrides any window policy; `package_error` is why a present
    model-package.json was ignored, which the message then repeats."""
    note = f"; model package ignored: {package_error}" if package_error else ""
    override = WindowPolicy.parse(window) if window else None

    def pick(name: str, reason: str, message: str, *, source: str | None = None,
             policy: WindowPolicy | None = None) -> SpeculativeChoice:
        return SpeculativeChoice(name, reason, message + note, source, override or policy or WindowPolicy())

    explicit = strategy or ("draft" if draft else None)
    if explicit == "none":
        return pick("none", "Disabled", "speculation is off (strategy none)")
    if explicit in ("ngram", "auto"):
        return pick(explicit, "Requested", f"strategy {explicit} configured explicitly")
    package_draft = declared if declared is not None and declared.type == "draft-model" else None
    if explicit == "draft":
        if draft:
            return pick("draft", "Requested", f"draft model {draft} configured explicitly", source=draft)
        if package_draft is not None:
            return pick("draft", "Requested", f"strategy draft with the model package's draft "
                        f"{package_draft.draft_model}", source=package_draft.draft_model, policy=package_draft.window)
        return pick("none", "DraftUnresolved", "strategy draft, but no draft model is named and the model package "
                    "declares none: serving without speculation")
    if declared is not None and declared.type == "ngram":
        return pick("ngram", "PackageDefault", f"n-gram speculation declared by the model package ({declared.name})",
                    policy=declared.window)
    if package_draft is not None:
        if no_draft:
            return pick("auto", "NoDraft", f"the package's draft {package_draft.name!r} is turned off (noDraft): "
                        "n-gram speculation gated on prompt shape")
        return pick("draft", "PackageDefault", f"draft model {package_draft.draft_model} declared by the model "
                    f"package ({package_draft.name})", source=package_draft.draft_model, policy=package_draft.window)
    return pick("auto", "Auto", "no strategy configured and none declared: n-gram speculation gated on prompt shape")


def choose_for_model(model_dir: Path | None, *, strategy: str | None, draft: str | None = None,
                     no_draft: bool = False, window: str | None = None) -> SpeculativeChoice:
    """choose_speculation with the declaration read from `model_dir` (None: the package is unreadable)."""
    declared, package_error = None, None
    if model_dir is not None:
        try:
            declared = read_package_default(model_dir)
        except PackageError as err:
            package_error = str(err)
    return choose_speculation(strategy=strategy, draft=draft, no_draft=no_draft, window=window,
                              declared=declared, package_error=package_error)


def draft_dtype(dtype: str | None, on_cpu: bool) -> str | None:
    """The dtype the frontend computes its draft model in: float32 on CPU, whose single-row matmuls
    of a draft's size run faster than bfloat16 there (frontend/engine/proposers/draft_model.py loads it so, and the
    planner counts it so beside an embedded first stage); else the model's dtype."""
    return "float32" if on_cpu else dtype
