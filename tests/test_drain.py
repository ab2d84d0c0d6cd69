"""Drain, never drop: a real frontend process, signalled as Kubernetes signals a pod it deletes.

A module's stage process (stage 1 of the bundled model) and, per test, a frontend process with
stage 0 embedded, as `inferencemesh serve` and a pipeline's pods run them. SIGTERM makes the
frontend drain: /ready and new requests answer 503 ("draining", with Retry-After), the streams
in flight finish, then the process exits 0; a drain that runs past --drain-timeout cuts what is
left, and a second signal stops it at once. And an exit on a user's error leaves its one line in
the termination-message file (INFERENCEMESH_TERMINATION_LOG here, /dev/termination-log in a pod).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from mesh_helpers import QUIET_THREADS, free_ports_at, start_mesh
from openai_spec import errors

from inferencemesh.bundled import resolve_model
from inferencemesh.programs.process import write_termination_message

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
MODEL = resolve_model(None)
MAX_CONTEXT = 2048  # long streams: a fast CPU (native bf16) decodes 240 tokens within a 1 s drain timeout
STREAM_TOKENS = 600  # a stream that outlasts the drain checks made while it runs
PROMPT = "def add(a, b):\n"
ENV = {**os.environ, **QUIET_THREADS, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
       "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def mesh():
    mesh = start_mesh(MODEL, 2, max_context=MAX_CONTEXT, embed_first=True)  # stage 1; stage 0 is the frontend's
    yield mesh
    mesh.stop()


@dataclass
class Frontend:
    base: str
    proc: subprocess.Popen
    lines: list[str]

    def log(self) -> str:
        return "".join(self.lines)

    def model(self) -> str:
        return httpx.get(f"{self.base}/v1/models", timeout=10).json()["data"][0]["id"]


@contextlib.contextmanager
def frontend(mesh, *flags: str) -> Iterator[Frontend]:
    """`inferencemesh frontend` in front of the mesh's stage (stage 0 embedded), ready."""
    port = free_ports_at([0])
    start, end = mesh.first_stage_layers
    proc = subprocess.Popen(
        [sys.executable, "-m", "inferencemesh", "frontend", "--model", str(MODEL), "--stage-addresses",
         ",".join(mesh.addresses), "--first-stage-layers", f"{start}:{end}", "--max-context", str(MAX_CONTEXT),
         "--speculative", "none", "--host", "127.0.0.1", "--port", str(port), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    running = Frontend(f"http://127.0.0.1:{port}", proc, lines)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{running.base}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, running.log()
            time.sleep(0.2)
        yield running
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@dataclass
class Stream:
    """A streamed completion read on a thread: its text, finish reason and whether [DONE] came."""

    pieces: list[str] = field(default_factory=list)
    finish: str | None = None
    done: bool = False
    error: BaseException | None = None
    started: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def body(model: str, max_tokens: int) -> dict[str, object]:
    return {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}


def read_stream(base: str, request: dict[str, object], out: Stream) -> None:
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=request, timeout=60) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out.done = True
                    continue
                for choice in json.loads(line[len("data: "):])["choices"]:
                    out.pieces.append(choice["text"])
                    out.finish = choice.get("finish_reason") or out.finish
                out.started.set()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out.error = exc
    finally:
        out.started.set()
        out.ended.set()


def streaming(base: str, request: dict[str, object]) -> Stream:
    out = Stream()
    threading.Thread(target=read_stream, args=(base, request, out), daemon=True).start()
    assert out.started.wait(60) and out.error is None and out.pieces, out.error
    return out


def wait_draining(base: str) -> httpx.Response:
    deadline = time.monotonic() + 5
    while True:
        ready = httpx.get(f"{base}/ready", timeout=5)
        if ready.status_code != 200 or time.monotonic() > deadline:
            return ready
        time.sleep(0.02)


def test_sigterm_lets_a_stream_finish_and_refuses_new_work(mesh) -> None:
    with frontend(mesh) as front:
        model = front.model()
        alone = streaming(front.base, body(model, STREAM_TOKENS))
        assert alone.ended.wait(60) and alone.done and alone.error is None
        stream = streaming(front.base, body(model, STREAM_TOKENS))
        front.proc.send_signal(signal.SIGTERM)

        ready = wait_draining(front.base)
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "draining", ready.text
        assert not errors(ready.json(), "ErrorResponse")
        refused = httpx.post(f"{front.base}/v1/chat/completions", timeout=10, json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert refused.status_code == 503, refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        assert not errors(refused.json(), "ErrorResponse"), refused.text
        error = refused.json()["error"]
        assert error["type"] == "service_unavailable" and error["code"] == "draining"
        assert "shutting down" in error["message"] and "retry" in error["message"]
        # The socket stays open, and the other routes answer.
        assert httpx.get(f"{front.base}/health", timeout=5).status_code == 200
        assert httpx.get(f"{front.base}/v1/models", timeout=5).status_code == 200
        metrics = httpx.get(f"{front.base}/metrics", timeout=5).text.splitlines()
        assert [line.split()[-1] for line in metrics if line.startswith("inferencemesh_draining{")] == ["1.0"]
        assert not stream.ended.is_set() and front.proc.poll() is None  # all that while the stream ran

        assert stream.ended.wait(60)
        ended = time.monotonic()
        assert stream.error is None and stream.done and stream.finish == "length", stream.error
        assert stream.text == alone.text
        assert front.proc.wait(10) == 0, front.log()
        assert time.monotonic() - ended < 5
        assert "draining: 1 request(s) in flight" in front.log() and "drained in" in front.log(), front.log()


def test_a_drain_timeout_cuts_what_is_left(mesh) -> None:
    timeout = 1.0
    with frontend(mesh, "--drain-timeout", str(timeout)) as front:
        stream = streaming(front.base, body(front.model(), MAX_CONTEXT - 16))
        signalled = time.monotonic()
        front.proc.send_signal(signal.SIGTERM)
        assert front.proc.wait(30) == 0, front.log()
        took = time.monotonic() - signalled
        assert timeout <= took <= timeout + 4, took
        assert stream.ended.wait(10)
        assert not stream.done and stream.finish is None, "the stream ended before the drain timed out"
        assert "stopping with 1 request(s) still in flight" in front.log(), front.log()


def test_sigterm_with_nothing_in_flight_exits_at_once(mesh) -> None:
    with frontend(mesh) as front:
        streamed = streaming(front.base, body(front.model(), 8))
        assert streamed.ended.wait(30) and streamed.done
        signalled = time.monotonic()
        front.proc.send_signal(signal.SIGTERM)
        assert front.proc.wait(10) == 0, front.log()
        assert time.monotonic() - signalled < 3
        # (the request's last bytes may reach the client just before its handler returns: 0 or 1)
        assert "drained in" in front.log() and "still in flight" not in front.log(), front.log()


def test_a_second_signal_stops_the_drain_at_once(mesh) -> None:
    with frontend(mesh) as front:  # the default drain timeout: 30 s
        stream = streaming(front.base, body(front.model(), MAX_CONTEXT - 16))
        front.proc.send_signal(signal.SIGTERM)
        assert wait_draining(front.base).status_code == 503
        signalled = time.monotonic()
        front.proc.send_signal(signal.SIGINT)  # Ctrl-C, twice
        assert front.proc.wait(30) == 0, front.log()
        assert time.monotonic() - signalled < 3
        assert stream.ended.wait(10) and not stream.done
        assert "SIGINT during the drain: stopping now" in front.log(), front.log()


# ---- the termination message ----------------------------------------------------------------


def cli(tmp_path: Path, *argv: str) -> tuple[subprocess.CompletedProcess, Path]:
    log = tmp_path / "termination-log"
    log.write_text("")
    done = subprocess.run([sys.executable, "-m", "inferencemesh", *argv], capture_output=True, text=True,
                          timeout=120, env={**ENV, "INFERENCEMESH_TERMINATION_LOG": str(log)}, cwd=tmp_path)
    return done, log


def test_an_unknown_flag_leaves_its_line_in_the_termination_log(tmp_path: Path) -> None:
    done, log = cli(tmp_path, "stage", "--model", str(MODEL), "--layers", "0:1", "--stage-index", "0",
                    "--num-stages", "1", "--bogus-flag")
    assert done.returncode == 2
    line = done.stderr.strip().splitlines()[-1]
    assert "unrecognized arguments: --bogus-flag" in line
    assert log.read_text() == line + "\n"


def test_a_config_error_leaves_its_line_in_the_termination_log(tmp_path: Path) -> None:
    done, log = cli(tmp_path, "frontend", "--model", str(MODEL), "--stage-addresses", "127.0.0.1:9",
                    "--drain-timeout", "-1")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert log.read_text() == "inferencemesh frontend: error: --drain-timeout must be 0 or more, not -1.0\n"
    assert done.stderr.strip().splitlines()[-1] == log.read_text().strip()


def test_an_unwritable_termination_log_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERENCEMESH_TERMINATION_LOG", str(tmp_path / "no" / "such" / "dir" / "log"))
    write_termination_message("inferencemesh stage: error: something\n")  # no exception
    assert not (tmp_path / "no").exists()
    monkeypatch.setenv("INFERENCEMESH_TERMINATION_LOG", str(tmp_path / "log"))
    write_termination_message("first line\n  second line\n")
    assert (tmp_path / "log").read_text() == "first line second line\n"
