"""OpenAI's error body, shaped once (inferencemesh.openai_errors) for the frontend and the router:
it round-trips through JSON and through an SSE event, and matches OpenAI's ErrorResponse schema."""

from __future__ import annotations

import json

import pytest
from openai_spec import errors

from inferencemesh.openai_errors import error_body, error_json, sse_error_event


@pytest.mark.parametrize(("param", "code"), [(None, None), ("messages", "invalid_value"), (None, "replica_failed")])
def test_the_error_body_round_trips_and_matches_openais_schema(param: str | None, code: str | None) -> None:
    message = 'A message quoting "a client\'s" text: é, \u2028, {braces}'
    body = error_body(message, "invalid_request_error", param=param, code=code)
    assert body == {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}
    assert json.loads(error_json(message, "invalid_request_error", param=param, code=code)) == body
    assert not errors(body, "ErrorResponse")


def test_the_sse_error_event_is_one_whole_event_carrying_the_same_body() -> None:
    event = sse_error_event("The replica r0 serving this stream failed.", "server_error", code="replica_failed")
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n\n") == 1
    assert json.loads(event.removeprefix(b"data: ")) == error_body(
        "The replica r0 serving this stream failed.", "server_error", code="replica_failed")


def test_the_frontend_and_the_router_answer_the_same_shape() -> None:
    from inferencemesh.frontend.openai.errors import APIError

    err = APIError(400, "bad", param="n", code="invalid_value")
    assert err.body() == error_body("bad", "invalid_request_error", param="n", code="invalid_value")
