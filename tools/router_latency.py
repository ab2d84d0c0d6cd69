"""The latency `inferencemesh router` adds: per request (time to the first response byte through
the router minus straight to the replica) and per token (the gaps between a stream's chunks through
the router against straight), measured interleaved (direct, routed, direct, routed, ...) over many
requests on kept-alive connections, so that both paths see the same machine load.

    python tools/router_latency.py [--frontend URL] [--requests 400] [--json docs/benchmarks/router-latency.json]

Without --frontend it runs its own upstream: a minimal ASGI server (no framework, so that its own
time is small) that answers a JSON completion at once or streams CHUNKS SSE events GAP_S apart.
With --frontend (a real `inferencemesh frontend`/`serve` endpoint) it sends small greedy
completions. The router is the real program (`python -m inferencemesh router`), a process of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
CHUNKS, GAP_S = 32, 0.005


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the upstream (run as `router_latency.py --serve-upstream PORT`) ---------------------------


async def upstream_app(scope: dict, receive, send) -> None:  # noqa: ANN001 - plain ASGI
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/metrics":
        page = b"# TYPE inferencemesh_num_requests_waiting gauge\ninferencemesh_num_requests_waiting 0\n"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": page})
        return
    stream = b'"stream": true' in body or b'"stream":true' in body
    if not stream:
        answer = b'{"id": "x", "choices": [{"text": "ok"}]}'
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for i in range(CHUNKS):  # each event says when it left (CLOCK_MONOTONIC: one clock for every process)
        event = f'data: {{"i": {i}, "t": {time.monotonic()!r}}}\n\n'.encode()
        await send({"type": "http.response.body", "body": event, "more_body": True})
        await asyncio.sleep(GAP_S)
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def serve_upstream(port: int) -> None:
    import uvicorn

    uvicorn.run(upstream_app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# ---- processes ------------------------------------------------------------------------------------


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} never answered")
        time.sleep(0.1)


@contextmanager
def process(argv: list[str], ready_url: str) -> Iterator[subprocess.Popen]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_ready(ready_url, proc)
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


# ---- measurements ----------------------------------------------------------------------------------


def ttfb(client: httpx.Client, url: str, payload: dict) -> float:
    started = time.perf_counter()
    with client.stream("POST", url, json=payload) as response:
        chunks = response.iter_raw()
        next(chunks)
        first = time.perf_counter() - started
        for _ in chunks:
            pass
    return first


SENT_AT = re.compile(rb'"t": ([0-9.]+)')


def gaps(client: httpx.Client, url: str, payload: dict, delays: list[float]) -> list[float]:
    """The gaps between a stream's chunks; `delays` gets each event's time from leaving the
    upstream to arriving here (events of this tool's own upstream only)."""
    times = []
    with client.stream("POST", url, json=payload) as response:
        for chunk in response.iter_raw():
            now = time.monotonic()
            times.append(now)
            delays.extend(now - float(sent) for sent in SENT_AT.findall(chunk))
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"mean_ms": statistics.fmean(values) * 1e3, "p50_ms": pick(0.5) * 1e3, "p90_ms": pick(0.9) * 1e3,
            "p99_ms": pick(0.99) * 1e3}


def measure(direct: str, routed: str, requests: int, payload: dict, stream_payload: dict,
            stream_requests: int) -> dict:
    """Interleaved: TTFB of `requests` requests each way, then `stream_requests` streams each way."""
    with httpx.Client(timeout=60) as client:
        for url in (direct, routed):  # warm-up: connections open, code paths hot
            for _ in range(20):
                ttfb(client, url, payload)
        d_first, r_first, paired = [], [], []
        for i in range(requests):
            order = (direct, routed) if i % 2 else (routed, direct)
            first = {url: ttfb(client, url, payload) for url in order}
            d_first.append(first[direct])
            r_first.append(first[routed])
            paired.append(first[routed] - first[direct])
        d_gaps, r_gaps, d_delays, r_delays = [], [], [], []
        for i in range(stream_requests):
            order = (direct, routed) if i % 2 else (routed, direct)
            for url in order:
                if url == direct:
                    d_gaps.extend(gaps(client, url, stream_payload, d_delays))
                else:
                    r_gaps.extend(gaps(client, url, stream_payload, r_delays))
    delivery = {}
    if d_delays and r_delays:
        delivery = {"event_delivery_direct": summary(d_delays), "event_delivery_routed": summary(r_delays),
                    "added_delivery_per_event_ms": {
                        "difference_of_medians": (statistics.median(r_delays) - statistics.median(d_delays)) * 1e3,
                        "difference_of_means": (statistics.fmean(r_delays) - statistics.fmean(d_delays)) * 1e3}}
    return {
        "requests": requests,
        "ttfb_direct": summary(d_first), "ttfb_routed": summary(r_first),
        "added_per_request_ms": {"median_of_paired_differences": statistics.median(paired) * 1e3,
                                 "difference_of_medians": (statistics.median(r_first)
                                                           - statistics.median(d_first)) * 1e3,
                                 "difference_of_means": (statistics.fmean(r_first) - statistics.fmean(d_first)) * 1e3},
        "stream_requests": stream_requests,
        "inter_chunk_gap_direct": summary(d_gaps), "inter_chunk_gap_routed": summary(r_gaps),
        "added_per_token_ms": {"difference_of_mean_gaps": (statistics.fmean(r_gaps) - statistics.fmean(d_gaps)) * 1e3,
                               "difference_of_median_gaps": (statistics.median(r_gaps)
                                                             - statistics.median(d_gaps)) * 1e3},
        **delivery,
    }


def router_overhead(base: str) -> dict[str, float]:
    """The router's own histogram: its time from a request's body to sending it upstream."""
    text = httpx.get(f"{base}/metrics").text
    total = float(re.search(r"^inferencemesh_router_overhead_seconds_sum (\S+)", text, re.M).group(1))
    count = float(re.search(r"^inferencemesh_router_overhead_seconds_count (\S+)", text, re.M).group(1))
    return {"requests": count, "mean_ms": total / count * 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frontend", help="a real frontend's base URL (default: this tool's own upstream)")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--stream-requests", type=int, default=40)
    parser.add_argument("--json", default=str(REPO / "docs" / "benchmarks" / "router-latency.json"))
    parser.add_argument("--serve-upstream", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_upstream:
        serve_upstream(args.serve_upstream)
        return 0
    with contextlib.ExitStack() as stack:
        if args.frontend:
            upstream = args.frontend.rstrip("/")
            model = httpx.get(f"{upstream}/v1/models").json()["data"][0]["id"]
            payload = {"model": model, "prompt": "def add(a, b):", "max_tokens": 1, "temperature": 0,
                       "stream": True}
            stream_payload = {**payload, "max_tokens": 32}
            kind = "inferencemesh frontend"
        else:
            port = free_port()
            upstream = f"http://127.0.0.1:{port}"
            stack.enter_context(process([sys.executable, __file__, "--serve-upstream", str(port)],
                                        f"{upstream}/metrics"))
            payload = {"prompt": "def add(a, b):", "stream": False}
            stream_payload = {"prompt": "def add(a, b):", "stream": True}
            kind = f"minimal ASGI upstream ({CHUNKS} SSE chunks {GAP_S * 1e3:.0f} ms apart)"
        router_port = free_port()
        base = f"http://127.0.0.1:{router_port}"
        stack.enter_context(process([sys.executable, "-m", "inferencemesh", "router", "--host", "127.0.0.1",
                                     "--port", str(router_port), "--frontends", upstream], f"{base}/ready"))
        load_before = os.getloadavg()
        results = measure(f"{upstream}/v1/completions", f"{base}/v1/completions", args.requests, payload,
                          stream_payload, args.stream_requests)
        results["router_overhead_histogram"] = router_overhead(base)
    report = {"what": "latency the router adds: TTFB and inter-chunk gaps through the router vs straight to the "
                      "replica, interleaved, kept-alive connections; the router, the upstream and this client "
                      "are processes on one machine",
              "upstream": kind, "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                           "processor": platform.processor() or platform.machine(),
                                           "load_average_1m_before_after": [load_before[0], os.getloadavg()[0]]},
              **results}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
