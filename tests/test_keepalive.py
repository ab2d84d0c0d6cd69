"""Idle stage streams stay up: both ends of a stage stream agree on keepalive pings
(protocol/transport.py), so a stage never answers a quiet stream's pings with GOAWAY
"too_many_pings", and the next request pays no replay."""

from __future__ import annotations

import asyncio

import pytest
from mesh_helpers import collect
from tiny_models import write_tiny_model
from wire import StageServers

from inferencemesh.frontend.engine.engine import EngineOptions, PipelineEngine
from inferencemesh.frontend.engine.pipeline import GrpcPipeline
from inferencemesh.protocol import transport

PROMPT = [3, 14, 15, 92, 65, 35]
PING_MS = 200  # the interval, shortened from the production one so that many pass in the test
IDLE_S = 6.0  # gRPC sends at most one ping a second however short the interval: several pass here


@pytest.fixture
def mesh(tmp_path, monkeypatch):
    monkeypatch.setattr(transport, "KEEPALIVE_MS", PING_MS)  # both ends read it: the servers and every channel
    model = write_tiny_model(tmp_path / "m", "llama", num_layers=2, shards=1, hidden_size=32, intermediate_size=64)
    servers = StageServers(model, [(0, 1), (1, 2)])
    yield servers
    servers.close()


def test_a_mesh_left_idle_past_many_ping_intervals_keeps_its_streams(mesh) -> None:
    async def go() -> tuple[list[int], list[int], int]:
        pipeline = GrpcPipeline(mesh.addresses)
        engine = PipelineEngine(pipeline, EngineOptions("t", max_context=128))
        try:
            before = await collect(engine, PROMPT, 8, temperature=0.0)
            stream = pipeline.scheduler
            await asyncio.sleep(IDLE_S)  # the streams stay open, quiet
            assert stream.failure is None, f"the idle stream broke: {stream.failure}"
            after = await collect(engine, PROMPT, 8, temperature=0.0)
            assert pipeline.scheduler is stream  # the same stream carried the next request
            return before, after, engine.recoveries
        finally:
            await engine.close()

    before, after, recoveries = asyncio.run(go())
    assert after == before and recoveries == 0
