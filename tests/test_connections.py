"""Connections (issue 20): a client that never finishes its request head or its body is cut off,
the server serves a bounded number of connections, and an SSE stream waiting on a stalled pipeline
sends keep-alive comments so that a proxy's read timeout does not cut it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from fixture_engine import FixtureModel, build_fixture_model, serve
from mesh_helpers import start_mesh
from openai import OpenAI
from openai_spec import errors
from transformers import AutoTokenizer

from inferencemesh.bundled import DEFAULT_MODEL, bundled_path
from inferencemesh.frontend.engine.engine import EngineOptions, PipelineEngine
from inferencemesh.frontend.engine.pipeline import GrpcPipeline
from inferencemesh.frontend.openai.app import create_app
from inferencemesh.frontend.openai.http_server import MAX_INCOMPLETE_EVENT_BYTES
from inferencemesh.frontend.openai.sse import KEEPALIVE_COMMENT


@pytest.fixture(scope="module")
def fm() -> FixtureModel:
    return build_fixture_model()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _closed_by_server(sock: socket.socket, deadline: float) -> bool:
    """Whether the server closed sock (EOF or reset) before the deadline."""
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except ConnectionError:
        return True
    except TimeoutError:
        return False


def _completion(url: str, model: str, **fields) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": model, "prompt": "def f():", "max_tokens": 2, **fields},
                      timeout=30)


def test_silent_and_slow_loris_connections_are_closed(fm: FixtureModel) -> None:
    with serve(create_app(fm.engine, fm.tokenizer, served_model_name=fm.name), header_timeout_s=1.0) as url:
        port = _port(url)
        started = time.monotonic()
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
        for sock in socks[::2]:  # half send part of a request head, then nothing more
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        time.sleep(0.5)
        for sock in socks[::4]:  # and a quarter keep trickling header bytes
            sock.sendall(b"X-Slow: 1\r\n")
        deadline = started + 6.0
        closed = sum(_closed_by_server(sock, deadline) for sock in socks)
        for sock in socks:
            sock.close()
        assert closed == 300, f"{closed} of 300 connections were closed"
        assert _completion(url, fm.name).status_code == 200


def test_a_request_head_beyond_the_limit_is_refused_and_a_large_one_within_it_is_served(fm: FixtureModel) -> None:
    with serve(create_app(fm.engine, fm.tokenizer, served_model_name=fm.name)) as url:
        # within the limit: a 48 KiB header (a long bearer token, cookies) is served
        r = httpx.get(url + "/v1/models", headers={"X-Big": "a" * (48 * 1024)}, timeout=30)
        assert r.status_code == 200
        # beyond it: refused with a 4xx and the connection closed, not kept
        with socket.create_connection(("127.0.0.1", _port(url))) as sock:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
            for i in range(MAX_INCOMPLETE_EVENT_BYTES // 1024 + 2):
                sock.sendall(f"X-H{i}: {'b' * 1000}\r\n".encode())
            sock.settimeout(10)
            answer = b""
            with contextlib.suppress(ConnectionError):
                while chunk := sock.recv(4096):
                    answer += chunk
        assert answer.startswith(b"HTTP/1.1 4"), answer[:80]
        assert _completion(url, fm.name).status_code == 200


def test_a_request_longer_than_the_header_timeout_is_not_cut(fm: FixtureModel) -> None:
    fm.engine.step_delay_s = 0.4
    try:
        with serve(create_app(fm.engine, fm.tokenizer, served_model_name=fm.name), header_timeout_s=0.5) as url:
            r = _completion(url, fm.name, max_tokens=5, ignore_eos=True)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
            with httpx.Client(base_url=url, timeout=30) as http:  # a kept-alive connection's next request
                for _ in range(2):
                    assert http.get("/v1/models").status_code == 200
                    time.sleep(0.2)
    finally:
        fm.engine.step_delay_s = 0.0


def test_a_body_that_stops_arriving_gets_a_408(fm: FixtureModel) -> None:
    app = create_app(fm.engine, fm.tokenizer, served_model_name=fm.name, body_timeout_s=1.0)
    with serve(app) as url, socket.create_connection(("127.0.0.1", _port(url))) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\":")
        sock.settimeout(10)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), answer
        assert not errors(json.loads(body), "ErrorResponse")
        assert 0.9 < time.monotonic() - started < 8  # the timeout, not the connection's end (loaded CI: slack)
        assert _completion(url, fm.name).status_code == 200


def test_connections_beyond_the_limit_are_refused(fm: FixtureModel) -> None:
    with serve(create_app(fm.engine, fm.tokenizer, served_model_name=fm.name), limit_concurrency=4) as url:
        idle = [socket.create_connection(("127.0.0.1", _port(url))) for _ in range(4)]
        time.sleep(0.2)
        try:
            assert httpx.get(url + "/health", timeout=10).status_code == 503
        finally:
            for sock in idle:
                sock.close()
        time.sleep(0.2)
        assert _completion(url, fm.name).status_code == 200


def _keepalive_stream(url: str, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        return r.read().decode()


def _check_stream(raw: str) -> None:
    assert KEEPALIVE_COMMENT in raw, raw
    blocks = [b for b in raw.split("\n\n") if b and not b.startswith(":")]
    assert blocks[-1] == "data: [DONE]"
    for block in blocks[:-1]:
        assert not errors(json.loads(block.removeprefix("data: ")), "CreateChatCompletionStreamResponse"), block


def test_a_waiting_stream_sends_keepalive_comments(fm: FixtureModel) -> None:
    fm.engine.step_delay_s = 1.0
    try:
        app = create_app(fm.engine, fm.tokenizer, served_model_name=fm.name, sse_keepalive_s=0.2)
        with serve(app) as url:
            _check_stream(_keepalive_stream(url, fm.name))
            # clients ignore comments: the openai client reads the stream as usual
            client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            chunks = list(client.chat.completions.create(model=fm.name, messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=2, stream=True))
            assert chunks[-1].choices[0].finish_reason is not None
    finally:
        fm.engine.step_delay_s = 0.0
    assert fm.engine.open_sessions == 0


@pytest.fixture(scope="module")
def mesh() -> Iterator:
    mesh = start_mesh(bundled_path(DEFAULT_MODEL), 2, max_context=256, dtype="float32")
    yield mesh
    mesh.stop()


def test_a_stream_on_a_stalled_stage_sends_keepalive_comments(mesh) -> None:
    tokenizer = AutoTokenizer.from_pretrained(bundled_path(DEFAULT_MODEL))
    engine = PipelineEngine(GrpcPipeline(mesh.addresses), EngineOptions(DEFAULT_MODEL, max_context=256))
    app = create_app(engine, tokenizer, served_model_name=DEFAULT_MODEL, sse_keepalive_s=0.3)
    with serve(app) as url:
        assert _completion(url, DEFAULT_MODEL).status_code == 200  # connected and warm
        pid = mesh.processes[1].process.pid
        os.kill(pid, signal.SIGSTOP)  # the last stage stalls for 2 s
        resume = threading.Timer(2.0, os.kill, (pid, signal.SIGCONT))
        resume.start()
        try:
            raw = _keepalive_stream(url, DEFAULT_MODEL)
        finally:
            resume.cancel()
            os.kill(pid, signal.SIGCONT)
        _check_stream(raw)
        assert raw.count(KEEPALIVE_COMMENT) >= 3
        assert _completion(url, DEFAULT_MODEL).status_code == 200
