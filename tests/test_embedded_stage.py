"""The first stage inside the frontend: exact at 1 and 2 stages, under concurrency, through a lost
stage, and as strict about bad frames as a stage process."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import grpc
import pytest
from mesh_helpers import collect, embedded_pipeline, hf_greedy, start_mesh
from tiny_models import write_tiny_model

from inferencemesh.frontend.engine.api import GenerationRequest
from inferencemesh.frontend.engine.engine import EngineOptions, PipelineEngine
from inferencemesh.frontend.engine.pipeline import GrpcPipeline
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol import stage_pb2_grpc as pb_grpc
from inferencemesh.protocol.errors import PipelineError

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
PROMPTS = [PROMPT[i:] + PROMPT[:i] for i in range(8)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", num_layers=4, shards=2)


@pytest.fixture(scope="module")
def mesh2(tiny):
    """Stage 1 of a 2-stage plan as a process; stage 0 is embedded by each test's pipeline."""
    mesh = start_mesh(tiny, 2, embed_first=True, max_context=512)
    yield mesh
    mesh.stop()


async def _engine(pipeline: GrpcPipeline, **options) -> PipelineEngine:
    assert await pipeline.wait_ready(60), "the embedded stage never became ready"
    return PipelineEngine(pipeline, EngineOptions("t", max_context=512, **options))


def _run(tiny, mesh, requests: list[dict], *, together: bool) -> list[list[int]]:
    """Each request's tokens, the requests run concurrently or one after another."""
    async def go() -> list[list[int]]:
        engine = await _engine(embedded_pipeline(tiny, mesh, max_context=512))
        try:
            if together:
                return list(await asyncio.gather(*(collect(engine, **r) for r in requests)))
            return [await collect(engine, **r) for r in requests]
        finally:
            await engine.close()

    return asyncio.run(go())


def test_one_embedded_stage_is_the_whole_model(tiny) -> None:
    mesh = start_mesh(tiny, 1, embed_first=True)
    assert mesh.processes == [] and mesh.first_stage_layers == (0, 4)
    request = {"prompt": PROMPT, "new_tokens": 20, "temperature": 0.0}
    assert _run(tiny, mesh, [request], together=False) == [hf_greedy(tiny, PROMPT, 20)]


def test_greedy_sessions_alone_and_eight_at_once_equal_transformers(tiny, mesh2) -> None:
    requests = [{"prompt": p, "new_tokens": 16, "temperature": 0.0} for p in PROMPTS]
    expected = [hf_greedy(tiny, p, 16) for p in PROMPTS]
    assert _run(tiny, mesh2, requests[:1], together=False) == expected[:1]
    assert _run(tiny, mesh2, requests, together=True) == expected


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny, mesh2) -> None:
    requests = [{"prompt": p, "new_tokens": 16, "temperature": 0.9, "top_p": 0.95, "seed": 7 + i}
                for i, p in enumerate(PROMPTS)]
    alone = _run(tiny, mesh2, requests, together=False)
    assert _run(tiny, mesh2, requests, together=True) == alone
    assert len({tuple(t) for t in alone}) > 1


def test_n_choices_fork_the_embedded_stage_and_the_process(tiny, mesh2) -> None:
    async def go() -> tuple[list[list[int]], list[int]]:
        engine = await _engine(embedded_pipeline(tiny, mesh2, max_context=512))
        try:
            request = GenerationRequest("n", PROMPT, 12, temperature=0.8, seed=5)
            choices = await engine.generate_n(request, 3)
            outs = []
            for choice in choices:
                outs.append([t async for step in choice for t in step])
            return outs, await collect(engine, PROMPT, 12, temperature=0.8, seed=5)
        finally:
            await engine.close()

    outs, single = asyncio.run(go())
    assert outs[0] == single  # choice 0 keeps the request's seed
    assert len({tuple(o) for o in outs}) > 1


def test_sessions_are_released_in_both_stages(tiny, mesh2) -> None:
    async def go() -> tuple[int, int]:
        pipeline = embedded_pipeline(tiny, mesh2, max_context=512)
        engine = await _engine(pipeline)
        try:
            await asyncio.gather(*(collect(engine, p, 6, temperature=0.0) for p in PROMPTS[:4]))
            infos = await pipeline.infos()
            return infos[0].active_sessions, infos[1].active_sessions
        finally:
            await engine.close()

    assert asyncio.run(go()) == (0, 0)


def test_a_bad_frame_fails_its_session_alone(tiny, mesh2) -> None:
    """The embedded stage answers a bad frame with the status a stage process gives it, and a
    concurrent session goes on undisturbed."""
    expected = hf_greedy(tiny, PROMPT, 16)

    async def go() -> tuple[list[int], list[PipelineError]]:
        pipeline = embedded_pipeline(tiny, mesh2, max_context=512)
        engine = await _engine(pipeline)
        try:
            good = asyncio.create_task(collect(engine, PROMPT, 16, temperature=0.0))
            errors = []
            for frame in (pb.Frame(kind=pb.PREFILL, pos_start=0, token_count=1, token_ids=[10 ** 6]),
                          pb.Frame(kind=pb.DECODE, pos_start=9, token_count=1, token_ids=[1])):
                session = pipeline.open()
                frame.session_id, frame.want_prediction, frame.seq = session.session_id, True, 1
                try:
                    await session.send(frame)
                except PipelineError as err:
                    errors.append(err)
                finally:
                    await session.close()
            return await good, errors
        finally:
            await engine.close()

    out, errors = asyncio.run(go())
    assert out == expected
    assert [e.code for e in errors] == [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION]
    assert "vocabulary" in str(errors[0]) and "block table" in str(errors[1])  # a DECODE at 9 with no blocks


@pytest.mark.slow
def test_streams_survive_the_stage_process_killed_under_eight_way_load(tiny) -> None:
    new_tokens = 120
    expected = [hf_greedy(tiny, p, new_tokens) for p in PROMPTS]
    mesh = start_mesh(tiny, 2, embed_first=True, max_context=512)
    killed_at: list[float] = []

    def kill_and_restart() -> None:
        os.kill(mesh.processes[0].process.pid, signal.SIGKILL)
        killed_at.append(time.monotonic())
        time.sleep(0.5)
        mesh.processes[0].start()  # what the launcher / a Deployment does

    async def one(engine: PipelineEngine, index: int) -> list[int]:
        out: list[int] = []
        async for tokens in engine.generate(GenerationRequest(f"r{index}", PROMPTS[index], new_tokens,
                                                              temperature=0.0)):
            out.extend(tokens)
            if index == 0 and len(out) >= 20 and not killed_at:
                threading.Thread(target=kill_and_restart, daemon=True).start()
            await asyncio.sleep(0.005)
        return out

    async def go() -> tuple[list[list[int]], int]:
        engine = await _engine(embedded_pipeline(tiny, mesh, max_context=512), recovery_timeout_s=90)
        try:
            return list(await asyncio.gather(*(one(engine, i) for i in range(8)))), engine.recoveries
        finally:
            await engine.close()

    try:
        results, recoveries = asyncio.run(go())
        assert killed_at and recoveries >= 1
        assert results == expected
        with grpc.insecure_channel(mesh.addresses[0]) as channel:
            assert pb_grpc.StageStub(channel).Info(pb.InfoRequest(), timeout=5).active_sessions == 0
    finally:
        mesh.stop()
