"""The router (inferencemesh.router) as a client meets it: uvicorn on a free port in front of small
real upstream servers (tests/router_upstream.py), over real HTTP."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from router_upstream import ServerThread, Upstream, free_port, upstreams

from inferencemesh.config import RouterConfig
from inferencemesh.programs.router import router_server
from inferencemesh.router.app import RouterApp


@contextlib.contextmanager
def router(*urls: str, **settings: object) -> Iterator[tuple[str, RouterApp]]:
    port = free_port()
    config = RouterConfig(host="127.0.0.1", port=port, frontends=urls, **settings)  # type: ignore[arg-type]
    server = router_server(config, log_level="warning")
    with ServerThread(None, port=port, server=server):
        yield f"http://127.0.0.1:{port}", server.config.loaded_app.app if hasattr(
            server.config.loaded_app, "app") else server.config.loaded_app


def stream_bytes(url: str, payload: dict, headers: dict | None = None) -> tuple[int, dict[str, str], bytes]:
    with httpx.stream("POST", url, json=payload, headers=headers, timeout=10) as response:
        return response.status_code, dict(response.headers), b"".join(response.iter_raw())


def replica_of(base: str, payload: dict) -> str:
    response = httpx.post(f"{base}/v1/completions", json=payload, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()["replica"]


@pytest.fixture()
def two() -> Iterator[tuple[list[Upstream], str, RouterApp]]:
    with upstreams("a", "b") as ups, router(*(f"{u.name}={u.url}" for u in ups)) as (base, app):
        yield ups, base, app


def test_sse_is_relayed_byte_for_byte_and_unbuffered(two) -> None:
    ups, base, _ = two
    payload = {"prompt": "hello " * 50, "stream": True, "chunks": 6, "delay": 0.15}
    status, headers, through = stream_bytes(f"{base}/v1/completions", payload)
    replica = next(u for u in ups if u.name == headers["x-replica"])
    direct_status, direct_headers, direct = stream_bytes(f"{replica.url}/v1/completions", payload)
    assert (status, through) == (direct_status, direct) and through.endswith(b"data: [DONE]\n\n")
    for name in ("content-type", "x-replica"):
        assert headers[name] == direct_headers[name]
    assert "transfer-encoding" in headers or "content-length" in headers
    # unbuffered: the first event arrives long before the stream's 0.9 s end
    with httpx.stream("POST", f"{base}/v1/completions", json=payload, timeout=10) as response:
        started = time.monotonic()
        chunks = response.iter_raw()
        first = next(chunks)
        first_at = time.monotonic() - started
        rest = b"".join(chunks)
        total = time.monotonic() - started
    assert first.startswith(b"data: ") and first_at < 0.5 < total, (first_at, total)
    assert first + rest == direct


def test_a_long_shared_prefix_goes_to_the_same_replica(two) -> None:
    ups, base, app = two
    system = "You are a careful assistant. " * 40
    first = replica_of(base, {"prompt": system + "question one"})
    assert all(replica_of(base, {"prompt": system + f"question {i}"}) == first for i in range(8))
    hits = app.metrics.affinity_hits.labels(first, "characters")._value.get()  # these upstreams publish no KV events
    assert hits >= 8
    # prompts that share nothing spread over both replicas (the stable hash of each key)
    spread = {replica_of(base, {"prompt": f"{i} unrelated {i * 7919}"}) for i in range(16)}
    assert spread == {"a", "b"}


def test_a_far_busier_replica_loses_its_affinity(two) -> None:
    ups, base, app = two
    prompt = "def fibonacci(n):\n" * 30
    owner = replica_of(base, {"prompt": prompt})
    busy = next(u for u in ups if u.name == owner)

    def reports(waiting: float) -> None:  # on its /metrics; the router reads it within a poll interval
        busy.waiting = waiting
        deadline = time.monotonic() + 5
        while app.replicas.get(owner).waiting != waiting:
            assert time.monotonic() < deadline, "the router never read the replica's load"
            time.sleep(0.05)

    reports(3)  # slightly busier than the other (0): the prefix wins
    listed = httpx.get(f"{base}/router/replicas").json()["replicas"]
    assert {r["name"]: r["waiting"] for r in listed}[owner] == 3
    assert replica_of(base, {"prompt": prompt}) == owner
    reports(20)  # far busier (> 0 + 8 and > 0 * 1.5): the least loaded takes it
    assert replica_of(base, {"prompt": prompt}) != owner


@pytest.mark.parametrize("status", [503, 429])
def test_a_refusal_is_retried_on_the_other_replica_with_the_same_body(two, status: int) -> None:
    ups, base, app = two
    a, b = ups
    a.status = status
    bodies = [json.dumps({"prompt": f"request {i} " + "é" * i, "n": i}).encode() for i in range(12)]
    for body in bodies:
        response = httpx.post(f"{base}/v1/completions", content=body, headers={"content-type": "application/json",
                                                                               "authorization": "Bearer k"})
        assert response.status_code == 200 and response.json()["replica"] == "b"
    assert a.count() > 0, "the policy never tried a first: the test proves nothing"
    tried_on_a = {body for _, body, _ in a.received}
    replayed = [body for _, body, headers in b.received if body in tried_on_a]
    assert replayed and all(headers["authorization"] == "Bearer k" for _, _, headers in b.received)
    assert tried_on_a <= set(replayed)  # every body a refused reached b byte for byte
    assert app.metrics.retries.labels("a", str(status))._value.get() == a.count()


def test_when_every_replica_refuses_the_last_answer_comes_back(two) -> None:
    ups, base, _ = two
    for u in ups:
        u.status, u.retry_after = 429, "7"
    response = httpx.post(f"{base}/v1/completions", json={"prompt": "x"})
    assert response.status_code == 429 and response.headers["retry-after"] == "7"
    assert "says 429" in response.json()["error"]["message"]
    assert sum(u.count() for u in ups) == 2  # each tried once


def test_a_refused_connection_is_retried_and_its_replica_is_down() -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with upstreams("a") as (a,), router(f"dead={dead}", f"a={a.url}") as (base, app):
        for i in range(8):
            assert replica_of(base, {"prompt": f"p{i}"}) == "a"
        # down from its first refusal (a request's, or the load poller's): never tried again
        assert app.metrics.retries.labels("dead", "connect")._value.get() <= 1
        listed = {r["name"]: r for r in httpx.get(f"{base}/router/replicas").json()["replicas"]}
        assert not listed["dead"]["up"] and "connect" in listed["dead"]["down"].lower() and listed["a"]["up"]
        assert "inferencemesh_router_ready_replicas 1.0" in httpx.get(f"{base}/metrics").text
    with router(f"dead={dead}") as (base, _):
        response = httpx.post(f"{base}/v1/completions", json={"prompt": "x"})
        assert response.status_code == 503 and response.headers["retry-after"]
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_when_no_replica_could_be_reached_the_order_is_tried_once_more_after_a_pause(monkeypatch) -> None:
    """No replica reachable at the first try (a connection timing out on a saturated node while a
    rollout's pods load; here a port nobody listens on yet): after a pause the order is tried once
    more, and the replica that came up answers, a 200 instead of a 503."""
    import inferencemesh.router.app as router_app

    monkeypatch.setattr(router_app, "UNREACHABLE_PAUSE_S", 2.0)
    port, late = free_port(), Upstream("a")
    server = ServerThread(late.app(), port=port)
    with router(f"a=http://127.0.0.1:{port}") as (base, app), ThreadPoolExecutor(1) as pool:
        sent = pool.submit(httpx.post, f"{base}/v1/completions", json={"prompt": "x"}, timeout=20)
        failed_once = lambda: app.metrics.retries.labels("a", "connect")._value.get() >= 1  # noqa: E731
        deadline = time.monotonic() + 10
        while not failed_once() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert failed_once(), "the first try did not fail"
        with server:  # up during the pause
            response = sent.result()
    assert response.status_code == 200 and response.json()["replica"] == "a", response.text


def test_an_error_after_the_first_byte_is_not_retried_and_ends_the_stream_with_an_error_event(two) -> None:
    ups, base, app = two
    payload = {"prompt": "breaks", "stream": True, "chunks": 5, "fail_after": 2}
    with httpx.stream("POST", f"{base}/v1/completions", json=payload, timeout=10) as response:
        assert response.status_code == 200
        got = b"".join(response.iter_raw())  # the stream ends (no cut connection): with an error event
    events = [e for e in got.split(b"\n\n") if e]
    assert len(events) == 3 and b"[DONE]" not in got, got
    error = json.loads(events[-1].removeprefix(b"data: "))["error"]
    assert error["type"] == "server_error" and error["code"] == "replica_failed" and "failed" in error["message"]
    assert sum(u.count() for u in ups) == 1  # no second replica was asked
    broken = next(u.name for u in ups if u.count())
    deadline = time.monotonic() + 5  # down after the break, up again once its /ready answers
    while app.replicas.get(broken).down is not None:
        assert time.monotonic() < deadline, "the replica never came back up"
        time.sleep(0.05)


def test_an_answer_other_than_sse_that_breaks_off_is_cut_not_completed(two) -> None:
    """No error event fits a JSON (or any non-SSE) body: the client's connection is cut, so that
    it cannot take the part that came for the whole answer."""
    _, base, _ = two
    payload = {"prompt": "breaks", "stream": True, "chunks": 5, "fail_after": 2, "media_type": "application/json"}
    got = b""
    with pytest.raises(httpx.RemoteProtocolError), httpx.stream("POST", f"{base}/v1/completions", json=payload,
                                                                timeout=10) as response:
        assert response.status_code == 200
        for chunk in response.iter_raw():
            got += chunk
    assert got.count(b"data: ") == 2 and b"error" not in got


def test_a_client_that_goes_away_cancels_the_upstream_request(two) -> None:
    ups, base, app = two
    payload = {"prompt": "long", "stream": True, "chunks": 1000, "delay": 0.05}
    with httpx.stream("POST", f"{base}/v1/completions", json=payload, timeout=10) as response:
        next(response.iter_raw())
        replica = next(u for u in ups if u.name == response.headers["x-replica"])
    assert replica.cancelled.wait(5), "the replica kept streaming to nobody"
    deadline = time.monotonic() + 5
    while app.replicas.get(replica.name).in_flight:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_other_paths_and_headers_pass_through(two) -> None:
    ups, base, _ = two
    response = httpx.get(f"{base}/v1/models", headers={"authorization": "Bearer s3cret", "x-custom": "1"})
    assert response.status_code == 200 and response.json()["data"][0]["id"] == "m"
    _, _, headers = next(r for u in ups for r in u.received if r[0] == "/v1/models")
    assert headers["authorization"] == "Bearer s3cret" and headers["x-custom"] == "1"
    assert headers["host"] != base.removeprefix("http://")  # the replica's own host, not the router's
    assert "server" not in response.headers or response.headers.get_list("server") == ["uvicorn"]


def test_a_large_body_waits_for_100_continue_and_goes_through_whole(two) -> None:
    """A body of EXPECT_CONTINUE_BYTES or more goes once the replica says 100 Continue (uvicorn
    says it when its app reads the body): it arrives whole, and the next request is served too."""
    from inferencemesh.router.transport import EXPECT_CONTINUE_BYTES

    _, base, _ = two
    prompt = "é" * EXPECT_CONTINUE_BYTES
    with httpx.Client(timeout=10) as client:
        for _ in range(2):
            response = client.post(f"{base}/v1/completions", json={"prompt": prompt})
            assert response.status_code == 200 and response.json()["prompt"] == prompt
            assert replica_of(base, {"prompt": "small"})


def test_a_body_beyond_the_limit_is_refused_in_openai_format() -> None:
    with upstreams("a") as (a,), router(a.url, max_body_bytes=1000) as (base, _):
        response = httpx.post(f"{base}/v1/completions", json={"prompt": "x" * 2000})
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
        assert a.count() == 0


def test_a_router_whose_replicas_are_all_marked_down_stays_ready_and_still_serves(two) -> None:
    """Every router pod marks the same slow frontends down at once: were it to turn unready, the
    Service would be left with no router at all. It stays ready, and a request is still served."""
    ups, base, app = two
    for replica in app.replicas.current().values():
        replica.mark_down("connection timed out")
    ready = httpx.get(f"{base}/ready")
    assert ready.status_code == 200 and ready.json()["replicas"] == 2, ready.text
    response = httpx.post(f"{base}/v1/completions", json={"prompt": "after"}, timeout=10)
    assert response.status_code == 200 and response.json()["prompt"] == "after"
    assert sum(u.count() for u in ups) == 1


def test_a_replica_that_left_while_answering_leaves_no_series_behind(two) -> None:
    """A request a replica answers after it left the set (a rollout's drained pipeline finishing
    what it holds) counts nowhere: its series do not come back, one per rollout, for good."""
    ups, base, app = two
    a = next(u for u in ups if u.name == "a")
    app.replicas.update({"a": a.url})
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, f"{base}/v1/completions", json={"prompt": "p", "header_delay": 1.0},
                             timeout=10)
        deadline = time.monotonic() + 5
        while not a.count():
            assert time.monotonic() < deadline, "the request never reached replica a"
            time.sleep(0.02)
        app.replicas.update({"b": next(u.url for u in ups if u.name == "b")})  # a leaves while it answers
        assert answer.result().status_code == 200
    series = [line for line in httpx.get(f"{base}/metrics").text.splitlines() if not line.startswith("#")]
    assert not [line for line in series if 'replica="a"' in line], series


def test_ready_is_503_without_replicas_and_requests_get_openai_errors(two) -> None:
    _, base, app = two
    assert httpx.get(f"{base}/ready").status_code == 200 and httpx.get(f"{base}/health").status_code == 200
    app.replicas.update({})  # every replica gone (as an EndpointSlice watch would say)
    ready = httpx.get(f"{base}/ready")
    assert ready.status_code == 503 and ready.headers["retry-after"]
    response = httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 503 and response.headers["retry-after"]
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    text = httpx.get(f"{base}/metrics").text
    assert 'replica="a"' not in text and "inferencemesh_router_ready_replicas 0.0" in text


def test_metrics_parse_and_pass_promtool(two) -> None:
    ups, base, _ = two
    ups[0].status = 503
    for i in range(6):
        assert httpx.post(f"{base}/v1/completions", json={"prompt": f"m{i}" * 100}).status_code == 200
    text = httpx.get(f"{base}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("requests", "retries", "prefix_affinity_hits", "prefix_affinity_misses", "requests_in_flight",
                 "ready_replicas", "overhead_seconds", "replica_requests_waiting"):
        assert f"inferencemesh_router_{name}" in families, name
    routed = families["inferencemesh_router_requests"].samples
    assert sum(s.value for s in routed if s.labels == {"replica": "b", "outcome": "2xx"}) == 6
    overhead = families["inferencemesh_router_overhead_seconds"].samples
    assert next(s.value for s in overhead if s.name.endswith("_count")) == 6
    if shutil.which("promtool"):
        check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr


def test_docs_list_every_router_series() -> None:
    """docs/metrics.md names every series the router's registry exports (counters as _total)."""
    from pathlib import Path

    from inferencemesh.router.metrics import RouterMetrics

    docs = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    names = [family.name + ("_total" if family.type == "counter" else "")
             for family in RouterMetrics().registry.collect()]
    assert len(names) == 10 and all(name.startswith("inferencemesh_router_") for name in names), names
    assert [name for name in names if f"`{name}" not in docs] == []


def test_importing_the_router_loads_no_torch() -> None:
    code = ("import sys, inferencemesh.router.app, inferencemesh.programs.router; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@contextlib.contextmanager
def router_program(*frontends: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """`inferencemesh router` as a process, ready (its /ready 200); killed on the way out if it still runs."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "inferencemesh", "router", "--host", "127.0.0.1",
                             "--port", str(port), "--frontends", ",".join(frontends)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/ready").status_code == 200:
                    break
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_router_program_stops_on_sigterm_after_its_streams() -> None:
    """`inferencemesh router` as a pod runs it: SIGTERM lets a stream in flight finish, then it exits 0
    (not -15: uvicorn's re-raising of the signal is off, programs.router.RouterServer)."""
    import signal

    with upstreams("a") as (a,), router_program(a.url) as (base, proc):
        payload = {"prompt": "p", "stream": True, "chunks": 8, "delay": 0.1}
        with httpx.stream("POST", f"{base}/v1/completions", json=payload, timeout=10) as response:
            chunks = response.iter_raw()
            first = next(chunks)
            proc.send_signal(signal.SIGTERM)
            rest = b"".join(chunks)
        assert (first + rest).endswith(b"data: [DONE]\n\n")
        assert proc.wait(15) == 0, proc.stdout.read()


def test_a_second_signal_stops_the_router_at_once() -> None:
    """SIGTERM, then SIGINT (a second Ctrl-C) while a long stream runs: the router stops now, the
    stream is cut, and it still exits 0."""
    import signal

    with upstreams("a") as (a,), router_program(a.url) as (base, proc):
        payload = {"prompt": "p", "stream": True, "chunks": 100, "delay": 0.2}  # 20 s
        with httpx.stream("POST", f"{base}/v1/completions", json=payload, timeout=10) as response:
            chunks = response.iter_raw()
            next(chunks)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            assert proc.poll() is None  # the stream holds it
            started = time.monotonic()
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(httpx.HTTPError):
                rest = b"".join(chunks)
                assert not rest.endswith(b"data: [DONE]\n\n")
        assert proc.wait(10) == 0, proc.stdout.read()
        assert time.monotonic() - started < 5


def test_a_kept_alive_connection_the_replica_closed_is_replaced() -> None:
    """The replica drops idle connections after 1 s (uvicorn's keep-alive timeout): a request
    after that goes out on a new connection, on the same replica, not as an error or a retry."""
    up = Upstream("a")
    with ServerThread(up.app(), timeout_keep_alive=1) as server:
        up.port = server.port
        with router(up.url) as (base, app):
            assert replica_of(base, {"prompt": "one"}) == "a"
            time.sleep(1.5)  # the replica closed the router's idle connection
            for i in range(3):
                assert replica_of(base, {"prompt": f"again {i}"}) == "a"
            assert not any(s.value for f in text_string_to_metric_families(httpx.get(f"{base}/metrics").text)
                           if f.name == "inferencemesh_router_retries" for s in f.samples)


def test_chunked_and_sized_bodies_pass_through_with_their_framing(two) -> None:
    ups, base, _ = two
    sized = httpx.post(f"{base}/v1/completions", json={"prompt": "sized"})
    direct = httpx.post(f"{ups[0].url}/v1/completions", json={"prompt": "sized"})
    assert sized.headers["content-length"] == str(len(sized.content))
    assert json.loads(sized.content)["prompt"] == json.loads(direct.content)["prompt"] == "sized"
    head = httpx.request("HEAD", f"{base}/v1/models")
    assert head.status_code in (200, 405) and head.content == b""
