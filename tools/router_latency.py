"""The latency `inferencemesh router` adds: per request (time to the first response byte through
the router minus straight to the replica) and per token (the gaps between a stream's chunks through
the router against straight), measured interleaved (direct, routed, direct, routed, ...) over many
requests on kept-alive connections, so that every path sees the same machine load.

    python tools/router_latency.py [--frontend URL] [--requests 400] [--json docs/benchmarks/router-latency.json]
    python tools/router_latency.py --transport h11 --transport git:REV --transport httpcore \
        --json docs/benchmarks/router-transports.json

Without --frontend it runs its own upstream: a minimal ASGI server (no framework, so that its own
time is small) that answers a JSON completion at once or streams CHUNKS SSE events GAP_S apart.
With --frontend (a real `inferencemesh frontend`/`serve` endpoint) it sends small greedy
completions. The router is the real program (`python -m inferencemesh router`), a process of its own.
With --transport (repeated) one router per transport runs, each with that HTTP client to the
replica, all interleaved in one run with the direct path: `h11` (router/transport.py), `httpcore`
(httpx's own transport), `git:REV` (router/transport.py as it was at that git revision).
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
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

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


def rotated(names: list[str], i: int) -> list[str]:
    """Round i starts one path later than round i - 1: each path goes first, second, ... as often."""
    k = i % len(names)
    return names[k:] + names[:k]


def measure(paths: dict[str, str], requests: int, payload: dict, stream_payload: dict,
            stream_requests: int) -> dict[str, dict[str, list[float]]]:
    """Interleaved: TTFB of `requests` requests on each path (name -> URL), round by round, then
    `stream_requests` streams on each; per path its samples (a round's samples share an index)."""
    samples: dict[str, dict[str, list[float]]] = {name: {"ttfb": [], "gaps": [], "delays": []} for name in paths}
    with httpx.Client(timeout=60) as client:
        for url in paths.values():  # warm-up: connections open, code paths hot
            for _ in range(20):
                ttfb(client, url, payload)
        for i in range(requests):
            for name in rotated(list(paths), i):
                samples[name]["ttfb"].append(ttfb(client, paths[name], payload))
        for i in range(stream_requests):
            for name in rotated(list(paths), i):
                got = samples[name]
                got["gaps"].extend(gaps(client, paths[name], stream_payload, got["delays"]))
    return samples


def direct_summary(direct: dict[str, list[float]]) -> dict:
    delivery = {"event_delivery_direct": summary(direct["delays"])} if direct["delays"] else {}
    return {"ttfb_direct": summary(direct["ttfb"]), "inter_chunk_gap_direct": summary(direct["gaps"]), **delivery}


def added(routed: dict[str, list[float]], direct: dict[str, list[float]]) -> dict:
    """A router's path against the direct one: its summaries, and what it adds."""
    paired = [r - d for r, d in zip(routed["ttfb"], direct["ttfb"], strict=True)]
    ms = lambda f, key: (f(routed[key]) - f(direct[key])) * 1e3  # noqa: E731
    result = {
        "ttfb_routed": summary(routed["ttfb"]),
        "added_per_request_ms": {"median_of_paired_differences": statistics.median(paired) * 1e3,
                                 "difference_of_medians": ms(statistics.median, "ttfb"),
                                 "difference_of_means": ms(statistics.fmean, "ttfb")},
        "inter_chunk_gap_routed": summary(routed["gaps"]),
        "added_per_token_ms": {"difference_of_mean_gaps": ms(statistics.fmean, "gaps"),
                               "difference_of_median_gaps": ms(statistics.median, "gaps")},
    }
    if routed["delays"] and direct["delays"]:
        result["event_delivery_routed"] = summary(routed["delays"])
        result["added_delivery_per_event_ms"] = {"difference_of_medians": ms(statistics.median, "delays"),
                                                 "difference_of_means": ms(statistics.fmean, "delays")}
    return result


def compared(routers: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Each router's added latency as a ratio of the first's (ratios hold on a busy machine where
    absolute numbers do not)."""
    base_name = next(iter(routers))
    pick = {"added_per_request": lambda r: r["added_per_request_ms"]["median_of_paired_differences"],
            "routed_ttfb_p50": lambda r: r["ttfb_routed"]["p50_ms"],
            "added_delivery_per_event": lambda r: r.get("added_delivery_per_event_ms", {}).get(
                "difference_of_medians", float("nan")),
            "client_cpu_per_request": lambda r: r.get("client_cpu_us_per_request", float("nan"))}
    return {name: {f"{what}_ratio_to_{base_name}": measure_of(result) / measure_of(routers[base_name])
                   for what, measure_of in pick.items()}
            for name, result in routers.items() if name != base_name}


def router_overhead(base: str) -> dict[str, float]:
    """The router's own histogram: its time from a request's body to sending it upstream."""
    text = httpx.get(f"{base}/metrics").text
    total = float(re.search(r"^inferencemesh_router_overhead_seconds_sum (\S+)", text, re.M).group(1))
    count = float(re.search(r"^inferencemesh_router_overhead_seconds_count (\S+)", text, re.M).group(1))
    return {"requests": count, "mean_ms": total / count * 1e3}


# ---- routers with another transport (run as `router_latency.py --serve-router PORT ...`) ----------


def transport_factory(spec: str) -> Callable[[], httpx.AsyncBaseTransport]:
    """`h11`: router/transport.py's; `httpcore`: httpx's own; `git:REV`: router/transport.py at REV."""
    from inferencemesh.router.app import CONNECT_TIMEOUT_S, replica_transport

    if spec == "h11":
        return replica_transport
    if spec == "httpcore":
        return httpx.AsyncHTTPTransport
    if not spec.startswith("git:"):
        raise SystemExit(f"--transport {spec}: h11, httpcore or git:REV")
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{spec[4:]}:src/inferencemesh/router/transport.py"],
                            check=True, capture_output=True, text=True).stdout
    module = types.ModuleType("router_transport_at_revision")
    sys.modules[module.__name__] = module
    exec(compile(source, f"{spec}:router/transport.py", "exec"), module.__dict__)  # noqa: S102 - our own history
    found = next(value for value in vars(module).values() if isinstance(value, type)
                 and issubclass(value, httpx.AsyncBaseTransport) and value is not httpx.AsyncBaseTransport)
    return lambda: found(connect_timeout=CONNECT_TIMEOUT_S)


def client_cpu(specs: list[str], url: str, payload: dict, rounds: int = 10, block: int = 300) -> dict[str, float]:
    """This process's CPU time per request through each transport alone (the upstream is another
    process): the median of `rounds` interleaved blocks of `block` requests, in microseconds. Less
    at the mercy of a busy machine than latency is."""
    body = json.dumps(payload).encode()
    headers = [(b"host", urlsplit(url).netloc.encode()), (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]

    async def one_block(transport: httpx.AsyncBaseTransport) -> float:
        started = time.process_time()
        for _ in range(block):
            request = httpx.Request("POST", url, headers=headers, stream=httpx.ByteStream(body))
            response = await transport.handle_async_request(request)
            async for _ in response.aiter_raw():
                pass
            await response.aclose()
        return (time.process_time() - started) / block * 1e6

    async def interleaved() -> dict[str, float]:
        transports = {spec: transport_factory(spec)() for spec in specs}
        per: dict[str, list[float]] = {spec: [] for spec in specs}
        for transport in transports.values():  # warm-up
            await one_block(transport)
        for i in range(rounds):
            for spec in rotated(specs, i):
                per[spec].append(await one_block(transports[spec]))
        for transport in transports.values():
            await transport.aclose()
        return {spec: statistics.median(values) for spec, values in per.items()}

    return asyncio.run(interleaved())


def serve_router(port: int, spec: str, upstream: str) -> None:
    from inferencemesh.config import RouterConfig
    from inferencemesh.programs.router import router_server

    config = RouterConfig(host="127.0.0.1", port=port, frontends=(upstream,))
    router_server(config, transport=transport_factory(spec)).run()


def start_routers(stack: contextlib.ExitStack, transports: list[str], upstream: str) -> dict[str, str]:
    """name -> base URL of each router started: the program itself, or one per transport."""
    routers = {}
    for spec in transports or ["router"]:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        argv = ([sys.executable, "-m", "inferencemesh", "router", "--host", "127.0.0.1", "--port", str(port),
                 "--frontends", upstream] if spec == "router" else
                [sys.executable, __file__, "--serve-router", str(port), "--transport", spec, "--upstream", upstream])
        stack.enter_context(process(argv, f"{base}/ready"))
        routers[spec] = base
    return routers


# ---- the run ---------------------------------------------------------------------------------------


def start_upstream(stack: contextlib.ExitStack, frontend: str | None) -> tuple[str, dict, dict, str]:
    """The upstream's base URL, the payloads of a request and of a stream, and what it is."""
    if frontend:
        upstream = frontend.rstrip("/")
        model = httpx.get(f"{upstream}/v1/models").json()["data"][0]["id"]
        payload = {"model": model, "prompt": "def add(a, b):", "max_tokens": 1, "temperature": 0, "stream": True}
        return upstream, payload, {**payload, "max_tokens": 32}, "inferencemesh frontend"
    port = free_port()
    upstream = f"http://127.0.0.1:{port}"
    stack.enter_context(process([sys.executable, __file__, "--serve-upstream", str(port)], f"{upstream}/metrics"))
    return (upstream, {"prompt": "def add(a, b):", "stream": False}, {"prompt": "def add(a, b):", "stream": True},
            f"minimal ASGI upstream ({CHUNKS} SSE chunks {GAP_S * 1e3:.0f} ms apart)")


def run(args: argparse.Namespace) -> dict:
    with contextlib.ExitStack() as stack:
        upstream, payload, stream_payload, kind = start_upstream(stack, args.frontend)
        routers = start_routers(stack, args.transport, upstream)
        load_before = os.getloadavg()
        paths = {"direct": f"{upstream}/v1/completions",
                 **{name: f"{base}/v1/completions" for name, base in routers.items()}}
        samples = measure(paths, args.requests, payload, stream_payload, args.stream_requests)
        results = {name: {**added(samples[name], samples["direct"]), "router_overhead_histogram":
                          router_overhead(base)} for name, base in routers.items()}
        if args.transport:
            cpu = client_cpu(args.transport, f"{upstream}/v1/completions", payload)
            for name, us in cpu.items():
                results[name]["client_cpu_us_per_request"] = us
    report = {"what": "latency the router adds: TTFB and inter-chunk gaps through the router vs straight to the "
                      "replica, interleaved, kept-alive connections; the router, the upstream and this client "
                      "are processes on one machine",
              "upstream": kind, "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                           "processor": platform.processor() or platform.machine(),
                                           "load_average_1m_before_after": [load_before[0], os.getloadavg()[0]]},
              "requests": args.requests, "stream_requests": args.stream_requests,
              **direct_summary(samples["direct"])}
    if not args.transport:  # one router: its numbers beside the direct path's
        return {**report, **results["router"]}
    return {**report, "transports": results, "compared": compared(results)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frontend", help="a real frontend's base URL (default: this tool's own upstream)")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--stream-requests", type=int, default=40)
    parser.add_argument("--transport", action="append", default=[],
                        help="h11, httpcore or git:REV; repeated: one router each, the first the baseline of ratios")
    parser.add_argument("--json", default=str(REPO / "docs" / "benchmarks" / "router-latency.json"))
    parser.add_argument("--serve-upstream", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve-router", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_upstream:
        serve_upstream(args.serve_upstream)
        return 0
    if args.serve_router:
        serve_router(args.serve_router, args.transport[0], args.upstream)
        return 0
    report = run(args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
