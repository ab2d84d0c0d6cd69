"""A stage's probes, answered in-process on its HTTP port (stage/metrics_http.py): /live while the
event loop answers, /ready while grpc.health.v1 says SERVING, else 503 with why not. Real HTTP over
real sockets, as the kubelet asks."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from prometheus_client import CollectorRegistry
from tiny_models import write_tiny_model

from inferencemesh.config import StageConfig
from inferencemesh.modeling.runtime import StageRuntime
from inferencemesh.protocol.health import check
from inferencemesh.stage.metrics_http import MetricsEndpoint
from inferencemesh.stage.server import start_stage_server


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


def test_a_real_stage_is_ready_over_http_once_its_layers_are_loaded(tmp_path: Path) -> None:
    """Without a health source of its own the endpoint reads the lifecycle state the stage publishes:
    503 naming it while the layers load, 200 once they are (when grpc.health.v1 turns SERVING)."""
    model = write_tiny_model(tmp_path / "m", "llama", num_layers=2, shards=1, hidden_size=32, intermediate_size=64)

    async def go() -> None:
        options = StageConfig(model=str(model), layers=(0, 2), stage_index=0, num_stages=1, host="127.0.0.1",
                              port=0, max_context=64)
        server, service, port = await start_stage_server(options)  # loads on a thread of its own
        try:
            host, http_port = service.metrics.serve(0)
            answers: list[tuple[int, str]] = []
            while not answers or answers[-1][0] != 200:
                answers.append(await get(host, http_port, "/ready"))
                await asyncio.sleep(0.02)
            assert all(body.startswith("NOT_SERVING: ") and status == 503 for status, body in answers[:-1])
            assert answers[-1] == (200, "SERVING\n")
            assert await asyncio.to_thread(check, f"127.0.0.1:{port}")  # grpc.health.v1 agrees
            assert await get(host, http_port, "/live") == (200, "alive\n")
        finally:
            await server.stop(0)
            await service.close()

    asyncio.run(asyncio.wait_for(go(), 120))


def test_an_endpoint_with_no_stage_state_is_never_ready() -> None:
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


def test_ready_turns_503_draining_when_the_stage_stops_serving(tmp_path: Path) -> None:
    """/ready says what grpc.health.v1 says: SERVING, then NOT_SERVING once the stage stops (as a
    stage process does on SIGTERM, before its server goes), with why."""
    model = write_tiny_model(tmp_path / "m", "llama", num_layers=2, shards=1, hidden_size=32, intermediate_size=64)

    async def go() -> None:
        options = StageConfig(model=str(model), layers=(0, 2), stage_index=0, num_stages=1, host="127.0.0.1",
                              port=0, max_context=64)
        server, service, port = await start_stage_server(options, runtime=StageRuntime(model, 0, 2, max_context=64))
        try:
            host, http_port = service.metrics.serve(0)
            assert await get(host, http_port, "/ready") == (200, "SERVING\n")
            await service.mark_not_serving()
            assert await get(host, http_port, "/ready") == (503, "NOT_SERVING: draining: the stage is stopping\n")
            assert not await asyncio.to_thread(check, f"127.0.0.1:{port}")  # grpc.health.v1 agrees
            assert await get(host, http_port, "/live") == (200, "alive\n")  # draining is not dead
        finally:
            await server.stop(0)
            await service.close()

    asyncio.run(asyncio.wait_for(go(), 120))

