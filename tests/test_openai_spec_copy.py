"""The OpenAI spec the suite validates against is the repository's own copy (a clone needs
nothing beside it), and validation through it really rejects a bad body."""

from __future__ import annotations

from pathlib import Path

import pytest
from openai_spec import spec_path, validate

REPO = Path(__file__).resolve().parents[1]


def test_the_spec_is_inside_the_repository_with_its_licence() -> None:
    path = spec_path()
    assert path.is_file() and path.resolve().is_relative_to(REPO)
    assert "MIT License" in (path.parent / "LICENSE").read_text()


def test_validation_from_the_copy_rejects_a_bad_body() -> None:
    good = {"object": "list", "data": [{"id": "m", "object": "model", "created": 1, "owned_by": "me"}]}
    validate(good, "ListModelsResponse")
    with pytest.raises(Exception, match="created"):
        validate({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "x"}]}, "ListModelsResponse")
