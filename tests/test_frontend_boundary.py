"""Input validation at the HTTP boundary (issue 20): every value a request can carry is
range-checked where it enters, with a 400 naming the field, so the engine never sees a value the
stage wire cannot carry; and what OpenAI's schema accepts is accepted.

Each case runs against the fixture engine and against the real engine over real gRPC (a 2-stage
mesh of the bundled model), and after each one the server answers a normal request at once with
every engine slot free: one request never hurts another.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fixture_engine import build_fixture_model, serve
from mesh_helpers import start_mesh
from openai_spec import errors
from transformers import AutoTokenizer

from inferencemesh.bundled import DEFAULT_MODEL, bundled_path
from inferencemesh.frontend.engine.engine import EngineOptions, PipelineEngine
from inferencemesh.frontend.engine.pipeline import GrpcPipeline
from inferencemesh.frontend.openai.app import create_app
from inferencemesh.protocol.transport import MAX_LOGIT_BIAS_ENTRIES
from inferencemesh.sampling import MIN_REPETITION_PENALTY

TARGET = bundled_path(DEFAULT_MODEL)
MAX_SESSIONS = 8


@dataclass
class Server:
    url: str
    model: str
    engine: Any
    vocab_size: int

    def free(self) -> bool:
        """No engine slot is held: the fixture's open sessions, or the pipeline engine's admission."""
        if isinstance(self.engine, PipelineEngine):
            return self.engine.running == 0 and self.engine.free_slots == MAX_SESSIONS
        return self.engine.open_sessions == 0


@pytest.fixture(scope="module", params=["fixture", "mesh"])
def server(request) -> Iterator[Server]:
    if request.param == "fixture":
        fm = build_fixture_model()
        engine, tokenizer, name = fm.engine, fm.tokenizer, fm.name
        with serve(create_app(engine, tokenizer, served_model_name=name)) as url:
            yield Server(url, name, engine, len(tokenizer))
        return
    mesh = start_mesh(TARGET, 2, max_context=256, dtype="float32", max_sessions=MAX_SESSIONS)
    try:
        tokenizer = AutoTokenizer.from_pretrained(TARGET)
        engine = PipelineEngine(GrpcPipeline(mesh.addresses),
                                EngineOptions(DEFAULT_MODEL, max_context=256, max_sessions=MAX_SESSIONS))
        with serve(create_app(engine, tokenizer, served_model_name=DEFAULT_MODEL)) as url:
            yield Server(url, DEFAULT_MODEL, engine, len(tokenizer))
    finally:
        mesh.stop()


def post(server: Server, path: str, body: dict[str, Any] | bytes, timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"},
                      timeout=timeout)


def completion(server: Server, **fields: Any) -> dict[str, Any]:
    return {"model": server.model, "prompt": "def f():", "max_tokens": 3, **fields}


def assert_healthy(server: Server) -> None:
    """A normal request is answered at once (no slot was leaked), and every slot is free after it."""
    r = post(server, "/v1/completions", completion(server), timeout=15)
    assert r.status_code == 200, r.text
    assert server.free()


def assert_400(r: httpx.Response, param: str, says: str = "") -> None:
    assert r.status_code == 400, (r.status_code, r.text)
    body = r.json()
    assert not errors(body, "ErrorResponse"), body
    assert body["error"]["param"] == param, body
    assert says in body["error"]["message"], body


# --- values the wire cannot carry --------------------------------------------------------------


def test_negative_seeds_map_to_the_wire_deterministically(server: Server) -> None:
    """OpenAI's seed is any int64; the wire's is a uint64: a negative seed is taken modulo 2^64
    (its two's complement), with n > 1 too, and the same seed gives the same choices."""
    body = completion(server, n=4, seed=-1, temperature=1.0, max_tokens=6)
    first = post(server, "/v1/completions", body)
    assert first.status_code == 200, first.text
    again = post(server, "/v1/completions", body).json()
    assert_400(post(server, "/v1/completions", {**body, "seed": 2**63}), "seed")  # beyond OpenAI's int64
    texts = [c["text"] for c in first.json()["choices"]]
    assert texts == [c["text"] for c in again["choices"]]
    assert_healthy(server)


def test_top_k_beyond_int32_is_a_400(server: Server) -> None:
    assert_400(post(server, "/v1/completions", completion(server, top_k=2**31)), "top_k")
    assert post(server, "/v1/completions", completion(server, top_k=2**31 - 1)).status_code == 200
    assert_healthy(server)


@pytest.mark.parametrize("value", [5e-324, 1e-300, 0.0, 1e-7])
def test_repetition_penalty_below_the_floor_is_a_400(server: Server, value: float) -> None:
    assert_400(post(server, "/v1/completions", completion(server, repetition_penalty=value)), "repetition_penalty")
    assert_healthy(server)


@pytest.mark.parametrize("value", [MIN_REPETITION_PENALTY, 1e-6])
def test_repetition_penalty_at_the_floor_samples_finite_logits(server: Server, value: float) -> None:
    """The floor is one number for the API and the stages: a request at it is served, not refused
    by a stage after the float32 wire rounded it below a floor written in float64."""
    r = post(server, "/v1/completions", completion(server, repetition_penalty=value, temperature=1.0, seed=3, n=2))
    assert r.status_code == 200, r.text
    assert_healthy(server)


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty"])
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_floats_are_named_as_such(server: Server, field: str, literal: str) -> None:
    raw = json.dumps(completion(server)).encode()[:-1] + f', "{field}": {literal}}}'.encode()
    assert_400(post(server, "/v1/completions", raw), field, "must be a finite number")
    assert_healthy(server)


def test_more_logit_bias_entries_than_a_frame_carries_is_a_400(server: Server) -> None:
    """A Sampling message stays small (the plan's message limit counts MAX_LOGIT_BIAS_ENTRIES)."""
    bias = {str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES)}
    assert post(server, "/v1/completions", json.dumps(completion(server, logit_bias=bias)).encode()).status_code == 200
    too_many = {f"{i:05d}": 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}  # distinct keys, the same ids
    assert_400(post(server, "/v1/completions", json.dumps(completion(server, logit_bias=too_many)).encode()),
               "logit_bias", str(MAX_LOGIT_BIAS_ENTRIES))


def test_non_finite_logit_bias_is_a_400(server: Server) -> None:
    raw = json.dumps(completion(server)).encode()[:-1] + b', "logit_bias": {"5": NaN}}'
    assert_400(post(server, "/v1/completions", raw), "logit_bias.5", "must be a finite number")
    assert_healthy(server)


@pytest.mark.parametrize("key", ["2147483647", "99999999999999", "-1", "\u00b2", "\ud800", "1.0"])
def test_logit_bias_keys_outside_the_vocabulary_are_a_400(server: Server, key: str) -> None:
    raw = json.dumps(completion(server, logit_bias={key: 1})).encode()
    assert_400(post(server, "/v1/completions", raw), "logit_bias")
    assert_healthy(server)


@pytest.mark.parametrize("ids", [[2**31 - 1], [2**40], [-1]])
def test_stop_token_ids_outside_the_vocabulary_are_a_400(server: Server, ids: list[int]) -> None:
    r = post(server, "/v1/completions", completion(server, stop_token_ids=ids))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("stop_token_ids")
    assert_healthy(server)


# --- text that is not Unicode ------------------------------------------------------------------

SURROGATE_ESCAPE = b"\\ud800"  # JSON's escape of a lone surrogate
SURROGATE_BYTES = b"\xed\xa0\x80"  # its raw UTF-8-like bytes (Python's json decodes them the same)


def _raw(server: Server, template: bytes, bad: bytes) -> bytes:
    return template.replace(b"MODEL", server.model.encode()).replace(b"BAD", bad)


SURROGATE_CASES = [
    ("/v1/completions", b'{"model":"MODEL","prompt":"xBAD","max_tokens":2}', "prompt"),
    ("/v1/completions", b'{"model":"MODEL","prompt":["ok","xBAD"],"max_tokens":2}', "prompt.1"),
    ("/v1/completions", b'{"model":"MODEL","prompt":"xBAD","max_tokens":2,"stream":true}', "prompt"),
    ("/v1/completions", b'{"model":"MODEL","prompt":"x","stop":"BAD","max_tokens":2}', "stop"),
    ("/v1/completions", b'{"model":"aBAD","prompt":"x","max_tokens":2}', "model"),
    ("/v1/chat/completions", b'{"model":"MODEL","messages":[{"role":"user","content":"BAD"}],"max_tokens":2}',
     "messages.0.content"),
    ("/v1/chat/completions",
     b'{"model":"MODEL","messages":[{"role":"user","content":[{"type":"text","text":"BAD"}]}],"max_tokens":2,'
     b'"stream":true}', "messages.0.content.0.text"),
    ("/v1/chat/completions", b'{"model":"aBAD","messages":[{"role":"user","content":"x"}]}', "model"),
    ("/tokenize", b'{"prompt":"BAD"}', "prompt"),
    ("/tokenize", b'{"model":"MODEL","messages":[{"role":"user","content":"BAD"}]}', "messages.0.content"),
    ("/tokenize", b'{"model":"BAD","prompt":"x"}', "model"),
]


@pytest.mark.parametrize("bad", [SURROGATE_ESCAPE, SURROGATE_BYTES], ids=["escape", "bytes"])
@pytest.mark.parametrize(("path", "template", "param"), SURROGATE_CASES)
def test_lone_surrogates_are_a_400(server: Server, bad: bytes, path: str, template: bytes, param: str) -> None:
    assert_400(post(server, path, _raw(server, template, bad)), param, "lone surrogate")
    assert_healthy(server)


def test_invalid_utf8_and_odd_model_paths_are_not_5xx(server: Server) -> None:
    r = post(server, "/v1/completions", _raw(server, b'{"model":"MODEL","prompt":"xBAD"}', b"\xff\xfe"))
    assert r.status_code == 400, r.text
    r = httpx.get(server.url + "/v1/models/a%ED%A0%80", timeout=10)
    assert r.status_code == 404 and not errors(r.json(), "ErrorResponse"), r.text
    assert_healthy(server)


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/assistants"), ("GET", "/v2/models"),
                                              ("DELETE", "/v1/chat/completions")])
def test_a_path_the_server_does_not_serve_is_named_in_openais_error_format(server: Server, method: str,
                                                                          path: str) -> None:
    r = httpx.request(method, server.url + path, json={}, timeout=10)
    assert r.status_code in (404, 405) and not errors(r.json(), "ErrorResponse"), r.text
    assert f"({method} {path})" in r.json()["error"]["message"] and r.json()["error"]["code"] == "unknown_url"


# --- what OpenAI's schema accepts ------------------------------------------------------------


def test_top_p_zero_is_greedy(server: Server) -> None:
    greedy = post(server, "/v1/completions", completion(server, temperature=0, max_tokens=8)).json()
    nucleus = post(server, "/v1/completions", completion(server, top_p=0, temperature=1.5, seed=7, max_tokens=8))
    assert nucleus.status_code == 200, nucleus.text
    assert nucleus.json()["choices"][0]["text"] == greedy["choices"][0]["text"]
    assert_healthy(server)


def test_integral_floats_are_integers(server: Server) -> None:
    r = post(server, "/v1/completions", completion(server, max_tokens=4.0, n=2.0, seed=5.0, top_k=3.0,
                                                  ignore_eos=True))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    assert_400(post(server, "/v1/completions", completion(server, max_tokens=4.5)), "max_tokens")
    assert_healthy(server)


def test_prompt_null_starts_a_new_document(server: Server) -> None:
    for body in (completion(server, prompt=None), {"model": server.model, "max_tokens": 3}):
        r = post(server, "/v1/completions", body)
        assert r.status_code == 200, r.text
        assert not errors(r.json(), "CreateCompletionResponse")
    assert_healthy(server)


def test_assistant_content_null_is_accepted(server: Server) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                {"role": "user", "content": "again"}]
    r = post(server, "/v1/chat/completions", {"model": server.model, "messages": messages, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert not errors(r.json(), "CreateChatCompletionResponse")
    user_null = [{"role": "user", "content": None}]
    r = post(server, "/v1/chat/completions", {"model": server.model, "messages": user_null, "max_tokens": 3})
    assert_400(r, "messages.0", "content is required")
    assert_healthy(server)


# --- fuzzing with hostile values, against both engines ------------------------------------------

HOSTILE_FLOATS = [float("nan"), float("inf"), float("-inf"), 5e-324, 1e-310, -0.0, 0.0, 1.0, 2.0, 1e308]
HOSTILE_INTS = [-(2**63) - 1, -(2**63), -1, 0, 1, 3, 4.0, 2.5, 2**31 - 1, 2**31, 2**63, 2**64]
TEXTS = ["def f():", "x\ud800y", "\udfff", "<|im_end|>\n<|im_start|>system", "", "ok"]


def hostile_completion(server: Server) -> Any:
    """A completion body a client could send: the right model name (so generation is reached),
    and hostile values (non-finite and denormal floats, integral floats, ints the wire cannot
    carry, ids outside the vocabulary, lone surrogates, prompt lists past the free slots) in
    the fields that reach the engine."""
    from hypothesis import strategies as st

    vocab = server.vocab_size
    ids = st.sampled_from([0, 1, vocab - 1, vocab, 2**31 - 1, -1])
    prompt = st.one_of(st.sampled_from(TEXTS), st.lists(st.sampled_from(TEXTS), min_size=1, max_size=MAX_SESSIONS + 4),
                       st.lists(ids, min_size=1, max_size=6))
    optional = {
        "n": st.sampled_from([1, 2, 3, 2.0, MAX_SESSIONS + 1]),
        "temperature": st.sampled_from(HOSTILE_FLOATS), "top_p": st.sampled_from(HOSTILE_FLOATS),
        "presence_penalty": st.sampled_from(HOSTILE_FLOATS), "frequency_penalty": st.sampled_from(HOSTILE_FLOATS),
        "repetition_penalty": st.sampled_from(HOSTILE_FLOATS), "seed": st.sampled_from(HOSTILE_INTS),
        "top_k": st.sampled_from(HOSTILE_INTS),
        "logit_bias": st.dictionaries(ids.map(str), st.sampled_from(HOSTILE_FLOATS + [100, -100]), max_size=2),
        "stop_token_ids": st.lists(ids, max_size=2), "stop": st.sampled_from(TEXTS),
        "stream": st.booleans(), "ignore_eos": st.booleans(),
    }
    # max_tokens always set and small (or refused): an unset one runs to the context's end
    max_tokens = st.sampled_from([1, 3, 4.0, 0, -1, 2**31])
    return st.fixed_dictionaries({"model": st.just(server.model), "prompt": prompt, "max_tokens": max_tokens},
                                 optional=optional)


def test_hostile_bodies_never_5xx_and_leave_every_slot_free(server: Server) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(hostile_completion(server), st.one_of(st.none(), st.integers(0, 3)))
    def run(body: dict[str, Any], hang_up_after: int | None) -> None:
        if body.get("stream"):
            body.pop("n", None)  # streamed n > 1 is served too, but keeps examples quick
        # json.dumps writes NaN/Infinity literals and escapes lone surrogates, as a careless client would
        content = json.dumps(body).encode()
        if hang_up_after is not None:
            disconnect(server, content, hang_up_after)
            wait_free(server)
        else:
            r = post(server, "/v1/completions", content, timeout=60)
            assert r.status_code < 500, (r.status_code, r.text[:300])
            if r.status_code != 200:
                assert r.status_code in (400, 429), (r.status_code, r.text[:300])
                assert not errors(r.json(), "ErrorResponse"), r.text[:300]
        assert_healthy(server)

    run()


def disconnect(server: Server, content: bytes, lines: int) -> None:
    """A client that hangs up: after `lines` lines of a stream, or (a whole response) while it waits."""
    headers = {"content-type": "application/json"}
    try:
        with httpx.stream("POST", server.url + "/v1/completions", content=content, headers=headers,
                          timeout=httpx.Timeout(30, read=0.05 if lines == 0 else 30)) as r:
            assert r.status_code < 500, r.status_code
            for _, _line in zip(range(lines), r.iter_lines(), strict=False):
                pass
    except httpx.ReadTimeout:
        pass  # gone before the answer came


def wait_free(server: Server, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not server.free() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.free(), "a client that hung up still holds engine slots"


def test_a_client_that_disconnects_mid_stream_frees_its_slots(server: Server) -> None:
    body = completion(server, prompt=["def f():", "class A:"], n=2, max_tokens=64, stream=True, ignore_eos=True)
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first chunk, then hang up
    wait_free(server)
    assert_healthy(server)
