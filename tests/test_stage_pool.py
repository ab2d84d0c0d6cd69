"""A stage's KV pool over real gRPC (docs/design/kv-blocks.md): frames compute where their block
tables say; a table too short, a block outside the pool or a block the stream never wrote is
refused; the pool serves one stream at a time; a session may start on blocks another session of
its stream wrote, penalties included; prompt chunks without a prediction are acknowledged."""

from __future__ import annotations

import grpc
import pytest
from wire import (
    RawStream,
    StageServers,
    blocks,
    exchange,
    failures,
    hidden_batch,
    serving_one_stage,
    tiny_two_layer_model,
)

from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol import stage_pb2_grpc as pb_grpc

PROMPT = list(range(40, 72))  # 32 tokens: two full blocks


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_two_layer_model(tmp_path_factory.mktemp("pool") / "m")


@pytest.fixture(scope="module")
def one_stage(model):
    yield from serving_one_stage(model, max_context=128)


def frame(session: str, pos_start: int, token_ids: list[int], table: list[int], **fields) -> pb.Frame:
    kind = fields.pop("kind", pb.PREFILL if pos_start == 0 or len(token_ids) > 1 else pb.DECODE)
    sampling = fields.pop("sampling", None)
    out = pb.Frame(session_id=session, kind=kind, pos_start=pos_start, token_count=len(token_ids),
                   token_ids=token_ids, kv_blocks=table, seq=fields.pop("seq", 1), **fields)
    if sampling is not None:
        out.sampling.CopyFrom(sampling)
    return out


def test_frames_over_tables_the_stream_cannot_read_are_refused_and_the_stream_goes_on(one_stage) -> None:
    info = pb_grpc.StageStub(grpc.insecure_channel(one_stage.addresses[0])).Info(pb.InfoRequest(), timeout=5)
    assert (info.kv_block_tokens, info.kv_blocks) == (16, 16 * 128 // 16)  # the default pool: 16 contexts
    batches = [
        {"frames": [frame("a", 0, PROMPT[:20], [0, 1], want_prediction=True)]},
        {"frames": [frame("a", 20, [7], [0])]},  # short: positions [0, 21) need 2 blocks
        {"frames": [frame("b", 0, [7], [info.kv_blocks])]},  # outside the pool
        {"frames": [frame("c", 40, [7], [0, 1, 5])]},  # reads 0 and 1 (written, 1 partly: the stage cannot tell) and 5
        {"frames": [frame("d", 20, [7], [0, 1], want_prediction=True)]},  # a new session on a's blocks
        {"frames": [frame("d", 21, [8], [9, 1])]},  # its table changed under it: block 9 is checked anew
    ]
    results, status = exchange(one_stage.addresses[0], batches)
    assert status == grpc.StatusCode.OK and not results[0].failures
    codes = [failures(r) for r in results[1:4]]
    assert codes[0][0][0] == grpc.StatusCode.FAILED_PRECONDITION and "block table" in codes[0][0][1]
    assert codes[1][0][0] == grpc.StatusCode.INVALID_ARGUMENT and "outside" in codes[1][0][1]
    assert codes[2][0][0] == grpc.StatusCode.FAILED_PRECONDITION and "block 5" in codes[2][0][1]
    assert not results[4].failures and len(results[4].predictions) == 1
    (code, message), = failures(results[5])
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "block 9" in message


def test_the_pool_serves_one_stream_until_it_ends(one_stage) -> None:
    service = one_stage.servers[0][1]

    async def go() -> None:
        async with grpc.aio.insecure_channel(one_stage.addresses[0]) as channel:
            stub = pb_grpc.StageStub(channel)
            first, second = RawStream(stub), RawStream(stub)
            assert not (await first.exchange(frame("x", 0, PROMPT, blocks(32)))).failures
            assert service.worker.ledger.blocks_used == 2
            used = service.metrics.registry.get_sample_value("inferencemesh_stage_kv_blocks_used",
                                                             {"model_name": "m", "stage": "0"})
            assert used == 2
            (code, message), = failures(await second.exchange(frame("y", 0, PROMPT, blocks(32, lane=1))))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "held by another stream" in message
            await first.call.done_writing()
            assert await first.call.read() == grpc.aio.EOF  # the stream ended: the pool is free
            assert service.worker.ledger.blocks_used == 0
            # the second stream may compute now, but not read what the first wrote
            (code, message), = failures(await second.exchange(frame("y", 32, [7], blocks(33))))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "never wrote" in message
            assert not (await second.exchange(frame("y", 0, PROMPT, blocks(32, lane=1)))).failures
            await second.close()

    one_stage.run(go())


def test_an_idle_streams_pool_goes_to_the_next_stream_which_cannot_read_its_blocks(one_stage) -> None:
    """A stream with no live session (another frontend between its requests) does not keep the pool
    from a stream that wants it: the pool changes hands, and the first stream, back, finds its old
    blocks unwritten (its frontend then forgets its index and computes again)."""
    async def go() -> None:
        async with grpc.aio.insecure_channel(one_stage.addresses[0]) as channel:
            stub = pb_grpc.StageStub(channel)
            first, second = RawStream(stub), RawStream(stub)
            assert not (await first.exchange(frame("a", 0, PROMPT, blocks(32)))).failures
            (code, _), = failures(await second.exchange(frame("b", 0, PROMPT, blocks(32, lane=1))))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED  # "a" is live
            assert not (await first.exchange(pb.Frame(session_id="a", kind=pb.RELEASE))).failures
            assert not (await second.exchange(frame("b", 0, PROMPT, blocks(32, lane=1)))).failures
            assert not (await second.exchange(pb.Frame(session_id="b", kind=pb.RELEASE))).failures
            (code, message), = failures(await first.exchange(frame("a2", 32, [7], blocks(33))))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "never wrote" in message
            await first.close()
            await second.close()

    one_stage.run(go())


def test_a_session_on_another_sessions_blocks_decides_as_alone_penalties_included(one_stage) -> None:
    """The second session computes only its last two tokens over the first's two full blocks; its
    penalties read its history from the pool's token slots. Token 11 is made the favourite (a bias)
    and is in the history (generated: from position 30 on), where the presence penalty forbids it."""
    penalised = pb.Sampling(temperature=0.0, logit_bias={11: 50.0}, presence_penalty=100.0, prompt_tokens=30,
                            logprobs=True, top_logprobs=3)
    tail = [5, 11]
    alone = frame("alone", 0, PROMPT + tail, blocks(34, lane=2), want_prediction=True, sampling=penalised)
    shared = [frame("first", 0, PROMPT, blocks(32)),
              frame("second", 32, tail, [0, 1, 8], want_prediction=True, sampling=penalised)]
    results, status = exchange(one_stage.addresses[0], [{"frames": [alone]}, {"frames": shared[:1]},
                                                        {"frames": shared[1:]}])
    assert status == grpc.StatusCode.OK and not any(r.failures for r in results)
    want, got = results[0].predictions[0], results[2].predictions[0]
    assert list(got.tokens) == list(want.tokens) and got.pos_start == want.pos_start == 34
    assert list(got.tokens) != [11]  # the history was read: 11 was penalised
    assert got.logprobs[0].logprob == pytest.approx(want.logprobs[0].logprob, abs=1e-5)


def test_prompt_chunks_without_a_prediction_are_acknowledged_by_the_last_stage(model) -> None:
    servers = StageServers(model, [(0, 1), (1, 2)], max_context=128)
    try:
        chunks = [frame("p", 0, PROMPT[:16], blocks(16), seq=1),
                  frame("q", 0, PROMPT[:5], blocks(5, lane=1), seq=1, want_prediction=True)]
        later = [frame("p", 16, PROMPT[16:], blocks(32), seq=2), pb.Frame(session_id="q", kind=pb.RELEASE, seq=2)]
        results, status = exchange(servers.addresses[0], [{"frames": chunks}, {"frames": later}])
        assert status == grpc.StatusCode.OK and not any(r.failures for r in results)
        assert [(a.seq, a.session_id, a.kind) for a in results[0].acks] == [(1, "p", pb.PREFILL)]
        assert [p.session_id for p in results[0].predictions] == ["q"]
        assert sorted((a.seq, a.session_id, a.kind) for a in results[1].acks) == [(2, "p", pb.PREFILL),
                                                                                 (2, "q", pb.RELEASE)]
        # the last stage alone, fed hidden states: the same Ack
        results, status = exchange(servers.addresses[1], [hidden_batch([frame("r", 0, [1, 2], blocks(2))], 32)])
        assert status == grpc.StatusCode.OK and [(a.session_id, a.kind) for a in results[0].acks] == [
            ("r", pb.PREFILL)]
    finally:
        servers.close()
