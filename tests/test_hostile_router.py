"""Hostile cases against the router (issue 33: findings 4, 5, 9 and the router's part of 15), through
the real `inferencemesh router` program in front of two real `inferencemesh frontend` processes
(the bundled model, each its whole pipeline in-process), and slow requests against a frontend's
real app and server limits. After every case the system is unharmed (tests/hostile.py)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from hostile import INNOCENT, MODEL, assert_unharmed, innocent_request, wait_for_idle
from router_upstream import free_port

pytestmark = pytest.mark.slow

MAX_SESSIONS = 4  # each frontend's
HEADER_TIMEOUT_S = 2.0  # the short deadlines the programs run with here (defaults: 10 s and 30 s)
BODY_TIMEOUT_S = 3.0
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@dataclass
class Program:
    """A program started here, its output collected as it runs."""

    args: list[str]
    port: int
    lines: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def start(self) -> Program:
        self.lines.clear()
        self.proc = proc = subprocess.Popen([sys.executable, "-m", "inferencemesh", *self.args], env=ENV, text=True,
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        threading.Thread(target=lambda: self.lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
        return self

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            assert self.proc is not None and self.proc.poll() is None, self.output
            assert time.monotonic() < deadline, f"not ready in {timeout}s:\n{self.output}"
            time.sleep(0.2)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def frontend(name: str) -> Program:
    port = free_port()
    return Program(["frontend", "--model", "bundled://imesh-code-target", "--stage-addresses", "",
                    "--first-stage-layers", "0:8", "--host", "127.0.0.1", "--port", str(port),
                    "--max-sessions", str(MAX_SESSIONS), "--speculative", "none", "--drain-timeout", "1",
                    "--header-timeout", str(HEADER_TIMEOUT_S), "--body-timeout", str(BODY_TIMEOUT_S),
                    "--served-model-name", MODEL], port)


@dataclass
class Mesh:
    router: Program
    frontends: dict[str, Program]

    def live(self) -> list[Program]:
        return [f for f in self.frontends.values() if f.alive()]

    def replicas(self) -> dict[str, dict]:
        return {r["name"]: r for r in httpx.get(f"{self.router.url}/router/replicas", timeout=5).json()["replicas"]}


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    frontends = {"p0": frontend("p0"), "p1": frontend("p1")}
    port = free_port()
    router = Program(["router", "--host", "127.0.0.1", "--port", str(port), "--load-poll-interval", "0.5",
                      "--header-timeout", str(HEADER_TIMEOUT_S), "--body-timeout", str(BODY_TIMEOUT_S),
                      "--frontends", ",".join(f"{n}={f.url}" for n, f in frontends.items())], port)
    try:
        for program in frontends.values():
            program.start()
        for program in frontends.values():
            program.wait_ready()
        router.start().wait_ready(30)
        yield Mesh(router, frontends)
    finally:
        for program in [router, *frontends.values()]:
            program.stop()


def unharmed(mesh: Mesh) -> None:
    """assert_unharmed through the router (an innocent request within 2 s, a burst of every live
    replica's sessions), and on each live frontend no request left running or waiting (the
    router's /metrics does not carry the frontends' gauges)."""
    live = mesh.live()
    assert_unharmed(mesh.router.url, MAX_SESSIONS * len(live))
    for program in live:
        left = wait_for_idle(program.url)
        assert not any(left.values()), f"{program.url}: {left}"


# ---- slow requests (finding 5) ---------------------------------------------------------------


def _slow_client(port: int, kind: str, result: dict[str, object], limit_s: float = 25.0) -> None:
    """A hostile client: `partial` sends a head and part of the body, then nothing; `slow-body` a head,
    then one body byte a second (each well within a per-chunk timeout); `slow-head` a line of its head
    every half second. Records how long until the server closed, and what it answered."""
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 200\r\n\r\n"
    body = json.dumps({"model": MODEL, "prompt": "x" * 300})[:200].encode()
    plan: list[tuple[float, bytes]]
    if kind == "partial":
        plan = [(0.0, head + body[:40])]
    elif kind == "slow-body":
        plan = [(0.0, head)] + [(1.0 + i, body[i:i + 1]) for i in range(len(body))]
    else:
        lines = head.split(b"\r\n")[:4]  # the head's lines without the blank one that ends it, then more
        plan = [(0.5 * i, line + b"\r\n") for i, line in enumerate(lines)] + [
            (2.0 + 0.5 * i, f"x-slow-{i}: 1\r\n".encode()) for i in range(60)]
    answer = b""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(0.05)
        started = time.monotonic()
        while time.monotonic() - started < limit_s:
            while plan and time.monotonic() - started >= plan[0][0]:
                with contextlib.suppress(OSError):  # closed under it: what it answered is read below
                    sock.sendall(plan.pop(0)[1])
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionError:
                break
            if not chunk:
                break
            answer += chunk
        result.update(kind=kind, elapsed=time.monotonic() - started, answer=answer)


def attack_with_slow_clients(port: int, innocent: Callable[[], float], deadlines: dict[str, float]) -> None:
    """The three slow clients at once, an innocent request answered meanwhile; each client is
    answered 408 (OpenAI's format) and cut off by its total deadline."""
    results: dict[str, dict[str, object]] = {kind: {} for kind in deadlines}
    threads = [threading.Thread(target=_slow_client, args=(port, kind, results[kind])) for kind in deadlines]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    latency = innocent()  # while every slow client holds its connection
    for thread in threads:
        thread.join(30)
    assert latency < 2.0, f"an innocent request took {latency:.2f}s during the attack"
    for kind, deadline in deadlines.items():
        got = results[kind]
        answer = got["answer"]
        assert isinstance(answer, bytes) and answer.startswith(b"HTTP/1.1 408"), (kind, answer[:200])
        head, _, body = answer.partition(b"\r\n\r\n")
        assert b"connection: close" in head.lower(), (kind, head)
        assert json.loads(body)["error"]["code"] == "request_timeout", (kind, body)
        elapsed = got["elapsed"]
        assert isinstance(elapsed, float)
        # The total deadline (from the head's first byte, or the body's head), not per chunk: a byte
        # a second would otherwise hold the connection for minutes.
        assert deadline - 0.3 < elapsed < deadline + 3.0, (kind, elapsed)


def test_slow_and_partial_requests_get_408_at_the_routers_total_deadline(mesh: Mesh) -> None:
    attack_with_slow_clients(mesh.router.port, lambda: innocent_request(mesh.router.url),
                             {"partial": BODY_TIMEOUT_S, "slow-body": BODY_TIMEOUT_S, "slow-head": HEADER_TIMEOUT_S})
    unharmed(mesh)


def test_slow_and_partial_requests_get_408_at_a_frontends_total_deadline(mesh: Mesh) -> None:
    target = mesh.live()[0]  # `inferencemesh frontend` with --header-timeout and --body-timeout
    attack_with_slow_clients(target.port, lambda: innocent_request(target.url),
                             {"partial": BODY_TIMEOUT_S, "slow-body": BODY_TIMEOUT_S, "slow-head": HEADER_TIMEOUT_S})
    assert_unharmed(target.url, MAX_SESSIONS)


# ---- router edges (finding 9) ----------------------------------------------------------------


def test_deep_json_huge_bodies_and_the_routers_event_loop(mesh: Mesh) -> None:
    router, p0 = mesh.router.url, mesh.frontends["p0"].url
    headers = {"content-type": "application/json"}
    # Nested beyond any parser's depth: the frontend's own OpenAI-format 400, not a plain-text 500.
    nested = b'{"model": "' + MODEL.encode() + b'", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    direct = httpx.post(f"{p0}/v1/completions", content=nested, headers=headers, timeout=30)
    through = httpx.post(f"{router}/v1/completions", content=nested, headers=headers, timeout=30)
    assert direct.status_code == 400 and direct.headers["content-type"] == "application/json"
    assert (through.status_code, through.json()) == (direct.status_code, direct.json())

    # Between the frontends' limit (1 MiB) and the router's (4 MiB): the frontend's 413, every time
    # (it refuses from the head; the router used to take the reset under its body for a dead replica).
    big = json.dumps({"model": MODEL, "prompt": "x" * (2 * 1024 * 1024), "max_tokens": 1}).encode()
    with httpx.Client(timeout=30) as client:
        statuses = [client.post(f"{router}/v1/completions", content=big, headers=headers).status_code
                    for _ in range(12)]
    assert statuses == [413] * 12, statuses
    assert all(r["up"] for r in mesh.replicas().values()), "a refusal is not a dead replica"

    # Beyond the router's limit: refused from the declared length, before a byte of the body is sent.
    with socket.create_connection(("127.0.0.1", mesh.router.port)) as sock:
        sock.settimeout(10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 5000000\r\n\r\n")
        answer = b""
        with contextlib.suppress(ConnectionError):
            while chunk := sock.recv(65536):
                answer += chunk
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_too_large"

    # The router's own work per request is bounded: 4 MB conversations of tiny messages (their
    # key cost about 1 s of the event loop each) while /health is asked every 20 ms.
    many = json.dumps({"model": MODEL, "max_tokens": 1,
                       "messages": [{"role": "user", "content": "a"}] * 120_000}).encode()
    assert 3_500_000 < len(many) < 4 * 1024 * 1024
    gaps: list[float] = []
    stop = threading.Event()

    def ping() -> None:
        with httpx.Client(timeout=10) as client:
            while not stop.is_set():
                started = time.perf_counter()
                client.get(f"{router}/health")
                gaps.append(time.perf_counter() - started)
                time.sleep(0.02)

    pinger = threading.Thread(target=ping)
    pinger.start()
    try:
        with httpx.Client(timeout=30) as client:
            for _ in range(3):
                assert client.post(f"{router}/v1/chat/completions", content=many, headers=headers).status_code == 413
    finally:
        stop.set()
        pinger.join()
    assert max(gaps) < 0.25, f"/health waited {max(gaps):.2f}s behind a 4 MB body"
    unharmed(mesh)


# ---- access log (finding 15, the router's part) ----------------------------------------------


def test_the_routers_load_polls_are_not_access_logged(mesh: Mesh) -> None:
    time.sleep(2.0)  # the router reads each frontend's /metrics every 0.5 s
    assert httpx.get(f"{mesh.frontends['p0'].url}/v1/models/nothing").status_code == 404
    logged = mesh.frontends["p0"].output
    assert "GET /metrics" not in logged, logged[-2000:]
    assert "GET /v1/models/nothing HTTP/1.1\" 404" in logged  # other lines, and errors, stay
    # an error of a quiet path stays too
    from inferencemesh.http_server import QuietScrapes

    quiet = QuietScrapes()
    record = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:1", "GET", "/metrics", "1.1", 500), None)
    assert quiet.filter(record)
    record.args = ("127.0.0.1:1", "GET", "/metrics", "1.1", 200)
    assert not quiet.filter(record)


# ---- a replica killed mid-stream (finding 4) -------------------------------------------------


def _running(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("inferencemesh_num_requests_running"))


def test_a_replica_killed_mid_stream(mesh: Mesh) -> None:
    """SIGKILL of one replica's frontend with streams and a non-streamed request on it and a stream
    on the other: its streams end with an OpenAI error event (the openai client raises), the
    non-streamed request is answered by the other replica, the other's stream finishes, new
    requests go to the survivor at once; the replica is used again once it is back."""
    client = openai.OpenAI(base_url=f"{mesh.router.url}/v1", api_key="unused", max_retries=0, timeout=60)
    prefix = "".join(f"def helper_{i}(x):\n    return x * {i}\n\n" for i in range(8))  # several blocks
    before = {name: r["routed"] for name, r in mesh.replicas().items()}
    client.completions.create(model=MODEL, prompt=prefix, max_tokens=1)
    victim = next(name for name, r in mesh.replicas().items() if r["routed"] > before[name])
    survivor = next(name for name in mesh.frontends if name != victim)
    long = {"model": MODEL, "max_tokens": 200, "temperature": 0, "extra_body": {"ignore_eos": True}}

    def stream(prompt: str, started: threading.Event) -> tuple[str, str | None]:
        """('error', message) when the openai client raised, else ('done', finish_reason)."""
        finish = None
        try:
            for chunk in client.completions.create(prompt=prompt, stream=True, **long):
                started.set()
                finish = chunk.choices[0].finish_reason or finish if chunk.choices else finish
        except openai.APIError as err:
            return "error", err.message
        finally:
            started.set()
        return "done", finish

    def whole(prompt: str) -> tuple[int, str]:
        raw = client.completions.with_raw_response.create(prompt=prompt, **long)
        return raw.status_code, raw.parse().choices[0].finish_reason

    flags = [threading.Event() for _ in range(3)]
    with ThreadPoolExecutor(4) as pool:
        on_victim = [pool.submit(stream, prefix + f"def main_{i}(", flags[i]) for i in range(2)]
        not_streamed = pool.submit(whole, prefix + "def other(")  # its prefix: all three go there
        deadline = time.monotonic() + 30
        while _running(mesh.frontends[victim].url) < 3:
            assert time.monotonic() < deadline, mesh.replicas()
            time.sleep(0.05)
        on_survivor = pool.submit(stream, "import os\n" * 3, flags[2])  # no prefix: the least loaded
        for flag in flags:
            assert flag.wait(60), "a stream never started"
        assert _running(mesh.frontends[survivor].url) >= 1, mesh.replicas()
        process = mesh.frontends[victim].proc
        assert process is not None
        process.send_signal(signal.SIGKILL)
        process.wait(10)
        killed_at = time.monotonic()
        # new requests meanwhile: the survivor answers at once, none refused
        assert innocent_request(mesh.router.url) < 2.0
        results = [f.result(120) for f in on_victim]
        assert all(kind == "error" and "failed" in str(message) for kind, message in results), results
        assert on_survivor.result(120) == ("done", "length")
        assert not_streamed.result(120) == (200, "length")  # retried on the survivor before any byte went
    _the_survivor_serves_alone(mesh, victim, survivor, prefix, killed_at)
    _the_replica_is_used_again_once_back(mesh, client, victim)


def _the_survivor_serves_alone(mesh: Mesh, victim: str, survivor: str, prefix: str, killed_at: float) -> None:
    """The killed replica was retried away from and is down; the survivor serves every request."""
    retried = [line for line in httpx.get(f"{mesh.router.url}/metrics").text.splitlines()
               if line.startswith("inferencemesh_router_retries_total") and f'replica="{victim}"' in line]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in retried) >= 1, retried
    listed = mesh.replicas()
    assert not listed[victim]["up"] and listed[survivor]["up"], listed
    statuses = [httpx.post(f"{mesh.router.url}/v1/completions", json={**INNOCENT, "prompt": prefix + str(i)},
                           timeout=10).status_code for i in range(4)]
    assert statuses == [200] * 4 and time.monotonic() - killed_at < 60
    assert httpx.get(f"{mesh.router.url}/ready").status_code == 200
    unharmed(mesh)


def _the_replica_is_used_again_once_back(mesh: Mesh, client: openai.OpenAI, victim: str) -> None:
    """Back (a restarted frontend on the same port): up again once ready, and sent requests again."""
    mesh.frontends[victim].start().wait_ready()
    deadline = time.monotonic() + 10
    while not mesh.replicas()[victim]["up"]:
        assert time.monotonic() < deadline, mesh.replicas()
        time.sleep(0.1)
    routed = mesh.replicas()[victim]["routed"]
    # Concurrent requests that share nothing: the router's own in-flight count sends the second
    # to the replica the first did not take (sequential ones could all tie-break to one replica).
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda i: client.completions.create(model=MODEL, prompt=f"# again {i * 7919}\n",
                                                          max_tokens=16), range(6)))
    assert mesh.replicas()[victim]["routed"] > routed
    unharmed(mesh)
