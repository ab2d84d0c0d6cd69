"""The split model over real gRPC between real stage processes: exact, concurrent, strict."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from mesh_helpers import collect, generate, hf_greedy, start_mesh
from tiny_models import write_tiny_model
from wire import STATUS, blocks, exchange, failures, hidden_batch

from inferencemesh.frontend.engine.engine import EngineOptions, PipelineEngine
from inferencemesh.frontend.engine.pipeline import GrpcPipeline
from inferencemesh.modeling.runtime import StageRuntime
from inferencemesh.programs.mesh import in_process_pipeline
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol import stage_pb2_grpc as pb_grpc

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> object:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", num_layers=4, shards=3)


@pytest.fixture(scope="module")
def mesh2(tiny):
    mesh = start_mesh(tiny, 2)
    yield mesh
    mesh.stop()


def test_two_stages_greedy_equals_unsplit_transformers(tiny, mesh2) -> None:
    expected = hf_greedy(tiny, PROMPT, 24)
    assert generate(GrpcPipeline(mesh2.addresses), PROMPT, 24, temperature=0.0) == expected


def test_four_stages_and_chunked_prefill_equal_unsplit(tiny) -> None:
    long_prompt = (PROMPT * 30)[:300]
    expected = hf_greedy(tiny, long_prompt, 12)
    mesh = start_mesh(tiny, 4, max_context=512)
    try:
        pipeline = GrpcPipeline(mesh.addresses)

        async def go() -> list[int]:  # prefill in 64-token frames: 5 chunks
            engine = PipelineEngine(pipeline, EngineOptions("t", max_context=512, prefill_chunk=64))
            try:
                return await collect(engine, long_prompt, 12, temperature=0.0)
            finally:
                await engine.close()

        assert asyncio.run(go()) == expected
    finally:
        mesh.stop()


def test_seeded_sampling_same_through_two_stages_as_one(tiny, mesh2) -> None:
    local = in_process_pipeline([StageRuntime(tiny, 0, 4)])
    params = dict(temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    one = generate(local, PROMPT, 20, **params)
    two = generate(GrpcPipeline(mesh2.addresses), PROMPT, 20, **params)
    assert one == two
    assert one != generate(GrpcPipeline(mesh2.addresses), PROMPT, 20, **{**params, "seed": 99})


def test_concurrent_requests_interleave_and_stay_exact(tiny, mesh2) -> None:
    prompts = [PROMPT[i:] + PROMPT[:i] for i in range(4)]
    expected = [hf_greedy(tiny, p, 16) for p in prompts]

    async def go() -> list[list[int]]:
        engine = PipelineEngine(GrpcPipeline(mesh2.addresses), EngineOptions("t", max_context=256))
        try:
            return list(await asyncio.gather(*(collect(engine, p, 16, temperature=0.0) for p in prompts)))
        finally:
            await engine.close()

    assert asyncio.run(go()) == expected


# ---- bad frames: clean statuses, and the stage keeps serving --------------------------------


def _call(address: str, frames: list[pb.Frame]) -> list[tuple[grpc.StatusCode, str]]:
    """Each frame in a batch of its own on one stream: the failures (code, message) of all; the
    stream itself must stay up (a bad frame fails alone)."""
    results, status = exchange(address, [{"frames": [f]} for f in frames])
    assert status == grpc.StatusCode.OK and len(results) == len(frames)
    return [failure for result in results for failure in failures(result)]


def frame(session: str, kind: int, pos_start: int, token_ids: list[int], table: list[int] | None = None,
          **fields) -> pb.Frame:
    """A frame over its own block table (consecutive blocks in lane 0 unless given)."""
    count = fields.pop("token_count", len(token_ids))
    table = blocks(pos_start + count) if table is None else table
    return pb.Frame(session_id=session, kind=kind, pos_start=pos_start, token_count=count, token_ids=token_ids,
                    kv_blocks=table, **fields)


@pytest.mark.parametrize(
    "frames, code, message",
    [
        ([frame("a", pb.PREFILL, 0, [1, 99999])], grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
        ([frame("b", pb.PREFILL, 0, [1, 2], token_count=3)], grpc.StatusCode.INVALID_ARGUMENT, "token_count"),
        ([frame("c", pb.DECODE, 5, [1])], grpc.StatusCode.FAILED_PRECONDITION, "never wrote"),
        ([frame("d", pb.PREFILL, 0, [1, 2]), frame("d", pb.DECODE, 40, [3])],
         grpc.StatusCode.FAILED_PRECONDITION, "never wrote"),
        ([frame("d", pb.DECODE, 16, [3], table=[0])], grpc.StatusCode.FAILED_PRECONDITION, "block table"),
        ([frame("d", pb.PREFILL, 0, [3], table=[10 ** 6])], grpc.StatusCode.INVALID_ARGUMENT, "outside"),
        ([frame("e", 7, 0, [1])], grpc.StatusCode.INVALID_ARGUMENT, "kind"),
        ([frame("f", pb.PREFILL, 0, list(range(300)))], grpc.StatusCode.OUT_OF_RANGE, "max_context"),
    ],
    ids=["token-out-of-vocab", "count-mismatch", "unknown-session", "reads-past-what-was-written", "table-too-short",
         "block-outside-the-pool", "unknown-kind", "past-context"],
)
def test_bad_frames_to_stage_zero(mesh2, frames, code, message) -> None:
    (got_code, got_message), = _call(mesh2.addresses[0], frames)
    assert got_code == code and message in got_message, got_message


def test_bad_activations_to_a_middle_stage(mesh2) -> None:
    address = mesh2.addresses[1]
    info = pb_grpc.StageStub(grpc.insecure_channel(address)).Info(pb.InfoRequest(), timeout=5)
    piece = frame("g", pb.PREFILL, 0, [], token_count=2)
    good = hidden_batch([piece], info.hidden_size)
    truncated = {**good, "activations": good["activations"][:-4]}
    wrong_dtype = {**good, "dtype": 9}
    wrong_shape = hidden_batch([piece], info.hidden_size + 1)
    results, status = exchange(address, [truncated, wrong_dtype, wrong_shape])
    assert status == grpc.StatusCode.OK
    for result, needle in zip(results, ("bytes", "dtype", "shape"), strict=True):
        (code, message), = failures(result)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and needle in message, message


def test_one_bad_frame_fails_alone_in_its_batch(tiny, mesh2) -> None:
    """A batch with good and bad frames: the good sessions are answered in the same result, each
    bad one gets its own status, and the stream goes on."""
    good = [frame(f"ok{i}", pb.PREFILL, 0, PROMPT, blocks(len(PROMPT), lane=i), want_prediction=True, seq=1)
            for i in range(2)]
    bad = [frame("stale", pb.DECODE, 7, [3], blocks(8, lane=2), seq=1),
           frame("oov", pb.PREFILL, 0, [-1], blocks(1, lane=3), seq=1)]
    release = [pb.Frame(session_id=f.session_id, kind=pb.RELEASE, seq=2) for f in good]
    (result, released), status = exchange(mesh2.addresses[0], [{"frames": [good[0], *bad, good[1]]},
                                                                {"frames": release}])
    assert status == grpc.StatusCode.OK
    first = hf_greedy(tiny, PROMPT, 1)
    assert {(p.session_id, tuple(p.tokens)) for p in result.predictions} == {("ok0", tuple(first)),
                                                                           ("ok1", tuple(first))}
    assert {(f.session_id, STATUS[f.code]) for f in result.failures} == {
        ("stale", grpc.StatusCode.FAILED_PRECONDITION), ("oov", grpc.StatusCode.INVALID_ARGUMENT)}
    assert {(a.session_id, a.kind) for a in released.acks} == {("ok0", pb.RELEASE), ("ok1", pb.RELEASE)}


def test_bad_frames_do_not_disturb_a_concurrent_session(tiny, mesh2) -> None:
    expected = hf_greedy(tiny, PROMPT, 20)

    async def go() -> list[int]:
        engine = PipelineEngine(GrpcPipeline(mesh2.addresses), EngineOptions("t", max_context=256))
        try:
            good = asyncio.create_task(collect(engine, PROMPT, 20, temperature=0.0))
            for i in range(5):
                bad = [frame(f"bad{i}", pb.PREFILL, 0, [-1])]
                assert (await asyncio.to_thread(_call, mesh2.addresses[0], bad)) is not None
            return await good
        finally:
            await engine.close()

    assert asyncio.run(go()) == expected


def test_sessions_are_released_at_request_end(mesh2) -> None:
    generate(GrpcPipeline(mesh2.addresses), PROMPT, 8, temperature=0.0)
    for address in mesh2.addresses:
        info = pb_grpc.StageStub(grpc.insecure_channel(address)).Info(pb.InfoRequest(), timeout=5)
        assert info.active_sessions == 0, address
