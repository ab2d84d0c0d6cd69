"""A stage keeps one frame's trouble to that frame, over real gRPC: whatever makes its pass or its
decision fail fails it alone, the good frames of the same batch get their answers, and a
stream's sessions are its own."""

from __future__ import annotations

import asyncio
import struct

import grpc
import numpy as np
import pytest
from wire import RawStream, blocks, exchange, failures, serving_one_stage, tiny_two_layer_model

from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol import stage_pb2_grpc as pb_grpc
from inferencemesh.token_masks import mask_words, pack_token_masks

PROMPT = [3, 14, 15, 92, 65, 35]
LANES: dict[str, int] = {}  # session -> its lane of the pool's blocks (wire.blocks)


def table(session: str, stop: int) -> list[int]:
    """The session's block table for positions [0, stop): its own blocks."""
    return blocks(stop, LANES.setdefault(session, len(LANES) % 16))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_two_layer_model(tmp_path_factory.mktemp("iso") / "m")


@pytest.fixture(scope="module")
def one_stage(model):
    yield from serving_one_stage(model)


def prefill(session: str, **sampling) -> pb.Frame:
    frame = pb.Frame(session_id=session, kind=pb.PREFILL, pos_start=0, token_count=len(PROMPT), token_ids=PROMPT,
                     want_prediction=True, seq=1, kv_blocks=table(session, len(PROMPT)))
    if sampling:
        frame.sampling.CopyFrom(pb.Sampling(**sampling))
    return frame


def answer_alone(address: str, good: pb.Frame) -> list[int]:
    results, status = exchange(address, [{"frames": [good]}])
    assert status == grpc.StatusCode.OK and not results[0].failures
    return list(results[0].predictions[0].tokens)


def test_a_frame_whose_decision_raises_fails_alone(one_stage) -> None:
    """An out-of-vocabulary logit_bias id makes the last stage's sampling raise (not a Fault): the
    frame beside it in the same batch still gets its token, the same as alone."""
    address = one_stage.addresses[0]
    good = prefill("good", temperature=0.0)
    alone = answer_alone(address, good)
    bad = prefill("bad", temperature=0.7, seed=1, logit_bias={2 ** 31 - 1: 1.0})
    results, status = exchange(address, [{"frames": [bad, prefill("good2", temperature=0.0)]}])
    assert status == grpc.StatusCode.OK
    assert [(p.session_id, list(p.tokens)) for p in results[0].predictions] == [("good2", alone)]
    assert [f.session_id for f in results[0].failures] == ["bad"], failures(results[0])


POISONS = {  # sampling that the kernels cannot take (each made a pass raise, failing its whole batch)
    "temperature": {"temperature": float("nan")},
    "presence_penalty": {"temperature": 0.7, "presence_penalty": float("inf")},
    "repetition_penalty": {"temperature": 0.7, "repetition_penalty": 1e-40},  # a float32 denormal
    "logit_bias id": {"temperature": 0.7, "logit_bias": {2 ** 31 - 1: 1.0}},
    "stop_token_ids": {"temperature": 0.7, "min_tokens": 4, "stop_token_ids": [10 ** 6]},
    "top_p": {"temperature": 0.7, "top_p": float("nan")},
    "top_k": {"temperature": 0.7, "top_k": -3},
}


@pytest.mark.parametrize("field", POISONS)
def test_the_stage_refuses_sampling_it_cannot_take_and_the_frame_beside_it_goes_on(one_stage, field) -> None:
    address = one_stage.addresses[0]
    alone = answer_alone(address, prefill("alone", temperature=0.0))
    bad = prefill("bad", seed=1, **POISONS[field])
    results, status = exchange(address, [{"frames": [prefill("good", temperature=0.0), bad]}])
    assert status == grpc.StatusCode.OK
    assert [(p.session_id, list(p.tokens)) for p in results[0].predictions] == [("good", alone)]
    (code, message), = failures(results[0])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field.split()[0] in message, message


def test_draft_probabilities_that_are_not_probabilities_fail_their_verify_frame_alone(one_stage) -> None:
    address = one_stage.addresses[0]
    sampled = {"temperature": 0.8, "seed": 3}
    start = [{"frames": [prefill("v-good", **sampled), prefill("v-bad", **sampled)]}]

    def verify(session: str, probs: list[float]) -> pb.Frame:  # three tokens listed, a quarter spread over the rest
        return pb.Frame(session_id=session, kind=pb.VERIFY, pos_start=len(PROMPT), token_count=2, token_ids=[5, 6],
                        draft_q=pb.DraftDistributions(sizes=[3], token_ids=np.array([4, 5, 6], "<i4").tobytes(),
                                                      probs=np.array(probs, "<f4").tobytes(), remainders=[0.25]),
                        seq=2, kv_blocks=table(session, len(PROMPT) + 2))

    fine = [0.25, 0.25, 0.25]
    poisoned = [0.25, float("nan"), 0.25]
    results, status = exchange(address, start + [{"frames": [verify("v-good", fine), verify("v-bad", poisoned)]}])
    assert status == grpc.StatusCode.OK and not results[0].failures
    assert [p.session_id for p in results[1].predictions] == ["v-good"]
    (code, message), = failures(results[1])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "draft_q" in message


def test_a_session_belongs_to_the_stream_that_opened_it(one_stage) -> None:
    """Another stream that knows its id can neither compute in it, overwrite nor release it."""
    async def go() -> tuple[list[tuple[grpc.StatusCode, str]], int]:
        async with grpc.aio.insecure_channel(one_stage.addresses[0]) as channel:
            stub = pb_grpc.StageStub(channel)
            owner, intruder = RawStream(stub), RawStream(stub)
            opened = await owner.exchange(prefill("mine", temperature=0.0))
            assert not opened.failures
            position = len(PROMPT) + 1
            decode = pb.Frame(session_id="mine", kind=pb.DECODE, pos_start=len(PROMPT), token_count=1, token_ids=[5],
                              seq=2, kv_blocks=table("mine", position))
            attempts = [
                decode,
                prefill("mine", temperature=0.0),  # a new prompt over it
                pb.Frame(session_id="mine", kind=pb.RELEASE, seq=3),
            ]
            refused = []
            for frame in attempts:
                refused += failures(await intruder.exchange(frame))
            # the owner's session is untouched: it decodes on from where it was
            decode.want_prediction = True
            going_on = await owner.exchange(decode)
            assert not going_on.failures and going_on.predictions[0].pos_start == position
            await intruder.close()
            await owner.close()
            return refused, len(attempts)

    refused, attempts = asyncio.run(go())
    assert [code for code, _ in refused] == [grpc.StatusCode.PERMISSION_DENIED] * attempts, refused
    assert all("belongs to another stream" in message for _, message in refused)


# ---- token masks (constrained decoding) decide at the last stage -------------------------------------


def masks_allowing(vocab: int, *rows: set[int]) -> bytes:
    words = np.zeros((len(rows), mask_words(vocab)), dtype=np.uint32)
    for row, allowed in enumerate(rows):
        for token in allowed:
            words[row, token // 32] |= np.uint32(1 << (token % 32))
    return pack_token_masks(words.view(np.int32), vocab)


def test_a_frames_token_masks_decide_what_the_last_stage_may_sample_and_accept(one_stage) -> None:
    address = one_stage.addresses[0]
    vocab = one_stage.runtimes[0].vocab_size
    unconstrained = answer_alone(address, prefill("free", temperature=0.0))[0]
    forced = next(t for t in (7, 8) if t != unconstrained)
    masked = prefill("forced", temperature=0.0)
    masked.token_masks = masks_allowing(vocab, {forced})
    assert answer_alone(address, masked) == [forced]
    for seed in range(6):  # sampled: only what the row allows
        frame = prefill(f"sampled-{seed}", temperature=1.5, seed=seed)
        frame.token_masks = masks_allowing(vocab, {40, 41})
        assert answer_alone(address, frame)[0] in (40, 41)

    # VERIFY: the greedy continuation [g1, g2, g3] is accepted whole without masks; a row that
    # forbids g2 ends the window there, and that row's bonus is the one token it allows.
    async def windows() -> tuple[list[int], pb.Prediction, pb.Prediction]:
        stream = RawStream(pb_grpc.StageStub(grpc.aio.insecure_channel(address)))
        try:
            path = []
            for session in ("whole", "cut"):
                first = (await stream.exchange(prefill(session, temperature=0.0))).predictions[0].tokens[0]
                path = path or [first]
            while len(path) < 4:
                frame = pb.Frame(session_id="probe", kind=pb.PREFILL, pos_start=0, token_count=len(PROMPT) + len(path),
                                 token_ids=PROMPT + path, want_prediction=True, seq=1,
                                 kv_blocks=table("probe", len(PROMPT) + len(path)))
                frame.sampling.CopyFrom(pb.Sampling(temperature=0.0))
                path.append((await stream.exchange(frame)).predictions[0].tokens[0])
                await stream.exchange(pb.Frame(session_id="probe", kind=pb.RELEASE, seq=2))

            def verify(session: str) -> pb.Frame:
                return pb.Frame(session_id=session, kind=pb.VERIFY, pos_start=len(PROMPT), token_count=3,
                                token_ids=path[:3], want_prediction=True, seq=3,
                                kv_blocks=table(session, len(PROMPT) + 3))

            whole = (await stream.exchange(verify("whole"))).predictions[0]
            other = next(t for t in range(50, 60) if t != path[2])
            cut_frame = verify("cut")
            cut_frame.token_masks = masks_allowing(vocab, {path[1]}, {other}, set(range(vocab)))
            cut = (await stream.exchange(cut_frame)).predictions[0]
            return path, whole, cut
        finally:
            await stream.close()

    path, whole, cut = one_stage.run(windows())
    assert (whole.accepted, list(whole.tokens)) == (2, path[1:4])
    assert (cut.accepted, list(cut.tokens)) == (1, [path[1], next(t for t in range(50, 60) if t != path[2])])


@pytest.mark.parametrize(("case", "says"), [("rows", "mask rows"), ("empty", "allows no token"),
                                            ("short", "bytes")])
def test_token_masks_that_do_not_fit_fail_their_frame_alone(one_stage, case: str, says: str) -> None:
    address = one_stage.addresses[0]
    vocab = one_stage.runtimes[0].vocab_size
    alone = answer_alone(address, prefill("alone", temperature=0.0))
    bad = prefill("bad", temperature=0.0)
    # (pack_token_masks refuses a row that allows nothing, as the stage does: those bytes are built by hand)
    bad.token_masks = {"rows": masks_allowing(vocab, {1}, {2}), "short": masks_allowing(vocab, {1})[:-4],
                       "empty": struct.pack("<II", 1, vocab) + bytes(4 * mask_words(vocab))}[case]
    results, status = exchange(address, [{"frames": [prefill("good", temperature=0.0), bad]}])
    assert status == grpc.StatusCode.OK
    assert [(p.session_id, list(p.tokens)) for p in results[0].predictions] == [("good", alone)]
    (code, message), = failures(results[0])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "token_masks" in message and says in message, message
