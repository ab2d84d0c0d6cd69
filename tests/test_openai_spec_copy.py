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


def test_only_an_echoed_first_token_may_have_a_null_logprob() -> None:
    from openai_spec import errors

    def body(token_logprobs: list) -> dict:
        return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                "choices": [{"index": 0, "text": "ab", "finish_reason": "length",
                             "logprobs": {"tokens": ["a", "b"], "token_logprobs": token_logprobs,
                                          "top_logprobs": [None, {"b": -0.5}], "text_offset": [0, 1]}}]}

    assert errors(body([None, -0.5]), "CreateCompletionResponse") == []
    assert errors(body([-0.1, None]), "CreateCompletionResponse")
    assert errors(body([None, "x"]), "CreateCompletionResponse")
