"""A stage's probes, answered in-process on its HTTP port (stage/metrics_http.py): /live while the
event loop answers, /ready while grpc.health.v1 says SERVING, else 503 with why not. Real HTTP over
real sockets, as the kubelet asks."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from inferencemesh.stage.metrics_http import MetricsEndpoint


async def get(host: str, port: int, path: str, method: str = "GET") -> tuple[int, str]:
    """One HTTP/1.1 request as the kubelet sends it; (status, body)."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUser-Agent: kube-probe/1.20\r\n"
                 "Accept: */*\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    reply = await reader.read()
    writer.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body.decode()


def test_ready_says_why_not_live_answers_and_a_probe_costs_little() -> None:
    why_not = ["loading (40%)"]

    async def go() -> None:
        endpoint = MetricsEndpoint(CollectorRegistry(), readiness=lambda: why_not[0])
        host, port = endpoint.listen("127.0.0.1", 0)
        try:
            assert await get(host, port, "/ready") == (503, "NOT_SERVING: loading (40%)\n")
            assert await get(host, port, "/live") == (200, "alive\n")
            why_not[0] = ""
            assert await get(host, port, "/ready") == (200, "SERVING\n")
            assert await get(host, port, "/ready", "HEAD") == (200, "")
            assert (await get(host, port, "/ready", "POST"))[0] == 405
            assert (await get(host, port, "/healthz"))[0] == 404
            why_not[0] = "draining: the stage is stopping"
            assert await get(host, port, "/ready?verbose=1") == (503, "NOT_SERVING: draining: the stage is stopping\n")
            # What the kubelet pays per probe: a connection and one answer from the loop, no process.
            start = time.perf_counter()
            for _ in range(50):
                assert (await get(host, port, "/live"))[0] == 200
            assert (time.perf_counter() - start) / 50 < 0.05
        finally:
            endpoint.close()

    asyncio.run(go())


def test_an_endpoint_without_a_health_source_is_never_ready() -> None:
    async def go() -> None:
        endpoint = MetricsEndpoint(CollectorRegistry())
        host, port = endpoint.listen("127.0.0.1", 0)
        try:
            status, body = await get(host, port, "/ready")
            assert status == 503 and "no health" in body
            assert (await get(host, port, "/metrics"))[0] == 200
        finally:
            endpoint.close()

    asyncio.run(go())
