"""Bursts against real stage processes: accepted requests queue, excess gets 429, never a 5xx.

The stages' session limit is shared capacity. A frontend whose slot count equals it must not
see a stage refuse a session just freed by the previous request (the RELEASE acknowledgement
waits for every stage), and frontends sharing stages wait for room instead of failing.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from mesh_helpers import start_mesh
from tiny_models import write_tiny_model

from inferencemesh.frontend.engine.api import GenerationRequest
from inferencemesh.frontend.engine.engine import EngineOptions, PipelineEngine
from inferencemesh.frontend.engine.errors import EngineError, EngineOverloaded
from inferencemesh.frontend.engine.pipeline import GrpcPipeline
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol import stage_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow
STAGE_SESSIONS = 4
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    model = write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", num_layers=4)
    mesh = start_mesh(model, 2, max_sessions=STAGE_SESSIONS)
    yield mesh
    mesh.stop()


def open_sessions(addresses: list[str]) -> list[int]:
    counts = []
    for address in addresses:
        with grpc.insecure_channel(address) as channel:
            counts.append(pb_grpc.StageStub(channel).Info(pb.InfoRequest(), timeout=10).active_sessions)
    return counts


async def burst(engines: list[PipelineEngine], requests: int, new_tokens: int) -> list[object]:
    """All requests at once, spread over the engines; each result is its tokens or its exception."""
    async def one(i: int) -> list[int]:
        out: list[int] = []
        async for tokens in engines[i % len(engines)].generate(GenerationRequest(f"b-{i}", PROMPT, new_tokens,
                                                                                 temperature=0.0)):
            out.extend(tokens)
        return out

    return await asyncio.gather(*(one(i) for i in range(requests)), return_exceptions=True)


def run_burst(addresses: list[str], *, frontends: int, requests: int, new_tokens: int,
              queue_timeout_s: float = 60.0) -> list[object]:
    async def go() -> list[object]:
        engines = [PipelineEngine(GrpcPipeline(addresses),
                                  EngineOptions("t", max_context=256, max_sessions=STAGE_SESSIONS,
                                                queue_timeout_s=queue_timeout_s))
                   for _ in range(frontends)]
        try:
            return await burst(engines, requests, new_tokens)
        finally:
            for engine in engines:
                await engine.close()

    return asyncio.run(go())


def test_a_burst_queues_behind_the_stages_session_limit(mesh) -> None:
    results = run_burst(mesh.addresses, frontends=1, requests=6 * STAGE_SESSIONS, new_tokens=6)
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, failures[:3]
    assert len({tuple(r) for r in results}) == 1  # greedy, same prompt: one answer
    assert open_sessions(mesh.addresses) == [0, 0]


def test_frontends_sharing_stages_wait_for_room(mesh) -> None:
    # Two frontends, each allowed the stages' whole capacity: stages refuse sessions beyond it,
    # and the frontends treat that as a queue, not a failure.
    results = run_burst(mesh.addresses, frontends=2, requests=4 * STAGE_SESSIONS, new_tokens=6)
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, failures[:3]
    assert open_sessions(mesh.addresses) == [0, 0]


def test_a_full_queue_answers_overloaded_never_a_server_error(mesh) -> None:
    results = run_burst(mesh.addresses, frontends=2, requests=6 * STAGE_SESSIONS, new_tokens=40,
                        queue_timeout_s=0.2)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors, "a 0.2 s queue cannot hold 24 requests on 4 sessions"
    assert all(isinstance(e, EngineOverloaded) for e in errors), [repr(e) for e in errors if
                                                                 not isinstance(e, EngineOverloaded)][:3]
    assert all(isinstance(e, EngineError) and e.status_code == 429 for e in errors)
    assert any(not isinstance(r, BaseException) for r in results)
    assert open_sessions(mesh.addresses) == [0, 0]
