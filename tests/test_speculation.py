"""The one speculation rule the frontend and the operator share: explicit > package > auto."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inferencemesh.bundled import DEFAULT_MODEL, DRAFT_MODEL, bundled_path
from inferencemesh.speculation import (
    DeclaredStrategy,
    PackageError,
    WindowPolicy,
    choose_for_model,
    choose_speculation,
    read_package_default,
)

PKG_DRAFT = DeclaredStrategy("pkg", "draft-model", "/models/draft", WindowPolicy(True, 2, 1, 6))
PKG_NGRAM = DeclaredStrategy("lookup", "ngram", None, WindowPolicy(False, 5, 5, 5))


@pytest.mark.parametrize(("settings", "declared", "expected"), [
    # explicit settings win over the package
    ({"strategy": "none"}, PKG_DRAFT, ("none", "Disabled", None)),
    ({"strategy": "ngram"}, PKG_DRAFT, ("ngram", "Requested", None)),
    ({"strategy": "auto"}, PKG_DRAFT, ("auto", "Requested", None)),
    ({"draft": "/d"}, PKG_NGRAM, ("draft", "Requested", "/d")),
    ({"strategy": "draft", "draft": "/d"}, PKG_DRAFT, ("draft", "Requested", "/d")),
    # strategy draft without a named draft takes the package's, or has none to run
    ({"strategy": "draft"}, PKG_DRAFT, ("draft", "Requested", "/models/draft")),
    ({"strategy": "draft"}, None, ("none", "DraftUnresolved", None)),
    ({"strategy": "draft"}, PKG_NGRAM, ("none", "DraftUnresolved", None)),
    # unset: the package's declaration, else auto
    ({}, PKG_DRAFT, ("draft", "PackageDefault", "/models/draft")),
    ({}, PKG_NGRAM, ("ngram", "PackageDefault", None)),
    ({"no_draft": True}, PKG_DRAFT, ("auto", "NoDraft", None)),
    ({"no_draft": True}, PKG_NGRAM, ("ngram", "PackageDefault", None)),
    ({}, None, ("auto", "Auto", None)),
])
def test_the_rule(settings: dict, declared, expected: tuple) -> None:
    choice = choose_speculation(strategy=settings.get("strategy"), draft=settings.get("draft"),
                                no_draft=settings.get("no_draft", False), declared=declared)
    assert (choice.strategy, choice.reason, choice.draft) == expected, choice.message


def test_windows_come_from_the_package_unless_overridden() -> None:
    assert choose_speculation(strategy=None, declared=PKG_DRAFT).window == PKG_DRAFT.window
    assert choose_speculation(strategy=None, declared=PKG_NGRAM).window == PKG_NGRAM.window
    assert choose_speculation(strategy=None, declared=PKG_DRAFT, window="3").window == WindowPolicy(False, 3, 3, 3)
    assert choose_speculation(strategy="draft", draft="/d", declared=PKG_DRAFT).window == WindowPolicy()
    for policy in (WindowPolicy(), WindowPolicy(False, 6, 6, 6), WindowPolicy(True, 2, 1, 3)):
        assert WindowPolicy.parse(policy.flag()) == policy


def test_an_unloadable_draft_means_no_speculation_with_the_reason() -> None:
    choice = choose_speculation(strategy=None, declared=PKG_DRAFT).without_draft("FileNotFoundError: gone")
    assert (choice.strategy, choice.reason, choice.draft) == ("none", "DraftUnavailable", None)
    assert "/models/draft" in choice.message and "gone" in choice.message


def test_the_bundled_package_declares_its_draft() -> None:
    choice = choose_for_model(bundled_path(DEFAULT_MODEL), strategy=None)
    assert (choice.strategy, choice.reason) == ("draft", "PackageDefault")
    assert Path(choice.draft).resolve() == bundled_path(DRAFT_MODEL).resolve()


def test_a_malformed_package_is_reported_and_ignored(tmp_path: Path) -> None:
    (tmp_path / "model-package.json").write_text(json.dumps({"generation": {"speculative_decoding": {
        "default": "x", "strategies": {"x": {"type": "draft-model"}}}}}))
    with pytest.raises(PackageError, match="needs 'draft_model'"):
        read_package_default(tmp_path)
    choice = choose_for_model(tmp_path, strategy=None)
    assert choice.strategy == "auto" and "model package ignored" in choice.message
