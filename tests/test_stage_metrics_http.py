"""A stage's /metrics binds where its gRPC does, and idle connections cost no thread each."""

from __future__ import annotations

import asyncio
import threading
import urllib.request

import pytest
from tiny_models import write_tiny_model

from inferencemesh.config import StageConfig
from inferencemesh.modeling.runtime import StageRuntime
from inferencemesh.stage.server import start_stage_server


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("m") / "m", "llama", num_layers=2, shards=1,
                            hidden_size=32, intermediate_size=64)


def test_metrics_bind_the_stages_host_and_idle_connections_hold_no_threads(tiny) -> None:
    async def go() -> None:
        options = StageConfig(model=str(tiny), layers=(0, 2), stage_index=0, num_stages=1, host="127.0.0.1", port=0,
                              max_context=64)
        server, service, _ = await start_stage_server(options, runtime=StageRuntime(tiny, 0, 2, max_context=64))
        try:
            host, port = service.metrics.serve(0)
            assert host == "127.0.0.1"  # loopback, as its gRPC: not every interface
            threads = threading.active_count()
            idle = [await asyncio.open_connection(host, port) for _ in range(20)]  # connect, say nothing
            await asyncio.sleep(0.2)
            assert threading.active_count() <= threads + 1  # (+1: the executor thread urlopen runs on below)
            page = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://{host}:{port}/metrics",
                                                                          timeout=5).read().decode())
            assert "inferencemesh_stage_state" in page
            for _, writer in idle:
                writer.close()
        finally:
            await server.stop(0)
            await service.close()

    asyncio.run(go())
