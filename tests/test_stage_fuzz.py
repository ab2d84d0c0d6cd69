"""Property-based fuzzing of stage batches: every bad frame gets a clean gRPC status of its own
(the stream stays up), and a well-formed session running at the same time still gets exactly
the right tokens. Frames carry random sampling (NaN, infinities, denormals, ids outside the
vocabulary), block tables name blocks in and out of the pool, sequences of batches share one
stream, and batches carry forged failures, which a stage relays as they are."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mesh_helpers import generate
from tiny_models import write_tiny_model
from wire import StageServers, blocks, exchange, failures, hidden_batch

from inferencemesh.frontend.engine.pipeline import GrpcPipeline
from inferencemesh.programs.mesh import in_process_pipeline
from inferencemesh.protocol import stage_pb2 as pb

pytestmark = pytest.mark.slow
CLEAN = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
         grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.PERMISSION_DENIED}
LANES = {"fz-a": 0, "fz-b": 1, "fz-c": 2}  # each plausible session's own blocks (wire.blocks)
PROMPT = [3, 14, 15, 92, 65, 35]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    model = write_tiny_model(tmp_path_factory.mktemp("fuzz") / "m", "llama", num_layers=2, shards=1,
                             hidden_size=32, intermediate_size=64)
    s = StageServers(model, [(0, 1), (1, 2)])
    s.expected = generate(in_process_pipeline(s.runtimes), PROMPT, 30, temperature=0.0)
    yield s
    s.close()


SESSION_IDS = st.sampled_from(["fz-a", "fz-b", ""]) | st.text(max_size=8)
INT32 = st.integers(-2 ** 31, 2 ** 31 - 1)
FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True)  # NaN, ±inf and denormals too
sampling = st.builds(
    pb.Sampling,
    temperature=FLOAT32 | st.sampled_from([0.0, 0.7, 1.0]),
    top_p=FLOAT32 | st.sampled_from([0.0, 0.9, 1.0]),
    top_k=INT32 | st.integers(0, 10),
    seed=st.integers(0, 2 ** 64 - 1),
    presence_penalty=FLOAT32,
    frequency_penalty=FLOAT32,
    repetition_penalty=FLOAT32 | st.sampled_from([0.0, 1.0, 1.2]),
    logit_bias=st.dictionaries(INT32 | st.integers(0, 400), FLOAT32, max_size=3),
    min_tokens=st.integers(0, 2 ** 32 - 1),
    stop_token_ids=st.lists(INT32 | st.integers(0, 400), max_size=3),
    prompt_tokens=st.integers(0, 2 ** 32 - 1),
    logprobs=st.booleans(),
    top_logprobs=st.integers(0, 2 ** 32 - 1),
)
# Draft distributions of any shape: sizes that disagree with the ids, ids outside the vocabulary or
# repeated, probabilities that are NaN, negative or do not add up.
def packed(values: st.SearchStrategy, dtype: str) -> st.SearchStrategy:
    return st.lists(values, max_size=8).map(lambda v: np.array(v, dtype).tobytes()) | st.binary(max_size=12)


draft_q = st.none() | st.builds(pb.DraftDistributions, sizes=st.lists(st.integers(0, 5), max_size=3),
                                token_ids=packed(st.integers(-5, 400), "<i4"), probs=packed(FLOAT32, "<f4"),
                                remainders=st.lists(FLOAT32, max_size=3))
frames = st.builds(
    pb.Frame,
    session_id=SESSION_IDS,
    kind=st.integers(-1, 6),
    pos_start=st.integers(0, 300),
    token_count=st.integers(0, 40),
    token_ids=st.lists(st.integers(-5, 400), max_size=40),
    want_prediction=st.booleans(),
    prompt_logprobs=st.booleans(),
    draft_q=draft_q,
    sampling=st.none() | sampling,
    kv_blocks=st.lists(st.integers(0, 2 ** 32 - 1) | st.integers(0, 130), max_size=24),
    seq=st.integers(0, 2 ** 64 - 1),
)


@st.composite
def plausible_frames(draw) -> pb.Frame:
    """Frames that pass the header checks (ids as many as token_count, positions a prefilled
    session can take, their session's block table or another's), so that their sampling and payload
    reach the pass."""
    count = draw(st.integers(1, 3))
    kind = draw(st.sampled_from([pb.PREFILL, pb.DECODE, pb.VERIFY]))
    count = max(count, 2) if kind == pb.VERIFY else count
    session = draw(st.sampled_from(list(LANES)))
    pos_start = draw(st.sampled_from([0, 3, len(PROMPT)]))
    lane = draw(st.sampled_from([LANES[session], 0]))  # sometimes fz-a's blocks
    return pb.Frame(session_id=session, kind=kind, pos_start=pos_start, token_count=count,
                    token_ids=draw(st.lists(st.integers(0, 300), min_size=count, max_size=count)),
                    want_prediction=True, sampling=draw(st.none() | sampling), seq=draw(st.integers(0, 9)),
                    draft_q=draw(draft_q | st.just(pb.DraftDistributions(
                        sizes=[1] * (count - 1), token_ids=np.array([7] * (count - 1), "<i4").tobytes(),
                        probs=np.array([0.5] * (count - 1), "<f4").tobytes(), remainders=[0.5] * (count - 1)))),
                    kv_blocks=blocks(pos_start + count, lane))


frames = frames | plausible_frames()
# Failures an upstream claims: a stage relays them as they are, whatever they say.
forged_failures = st.lists(st.builds(pb.Failure, session_id=SESSION_IDS, seq=st.integers(0, 2 ** 64 - 1),
                                     kind=st.integers(-1, 6), code=st.integers(0, 2 ** 32 - 1),
                                     message=st.just("forged"), stage_index=st.integers(0, 2 ** 32 - 1)),
                           max_size=2)
batches = st.fixed_dictionaries({
    "frames": st.lists(frames, min_size=1, max_size=3),
    "dtype": st.integers(-1, 4),
    "hidden_size": st.integers(0, 64),
    "activations": st.binary(max_size=512),
    "failures": forged_failures,
})


def _send(address: str, sequence: list[dict]) -> set[grpc.StatusCode]:
    """The statuses of the sequence's failed frames, sent as batches on one stream. The stream
    itself must stay up (bad frames fail alone), and forged failures come back as they went."""
    results, status = exchange(address, sequence, timeout=20)
    assert status == grpc.StatusCode.OK and len(results) == len(sequence), status
    codes = set()
    for batch, result in zip(sequence, results, strict=True):
        own = [f for f in result.failures if f.message != "forged"]
        assert [f for f in result.failures if f.message == "forged"] == list(batch.get("failures", []))
        codes |= {code for code, _ in failures(pb.BatchResult(failures=own))}
    return codes


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=batches, target=st.sampled_from([0, 1]))
def test_random_frames_get_clean_statuses(servers, batch, target) -> None:
    codes = _send(servers.addresses[target], [batch])
    assert codes <= CLEAN, codes


def _prefill(session: str) -> pb.Frame:
    return pb.Frame(session_id=session, kind=pb.PREFILL, pos_start=0, token_count=len(PROMPT), token_ids=PROMPT,
                    want_prediction=True, seq=1, kv_blocks=blocks(len(PROMPT), LANES[session]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sequence=st.lists(batches, min_size=1, max_size=4), target=st.sampled_from([0, 1]))
def test_random_batch_sequences_on_one_stream_with_written_blocks_get_clean_statuses(servers, sequence,
                                                                                    target) -> None:
    """Sessions that exist (prefilled first, so later frames find the blocks they read written),
    then random batches on the same stream."""
    opening = {"frames": [_prefill("fz-a"), _prefill("fz-b")]}
    if target == 1:
        opening = hidden_batch(opening["frames"], 32)
    codes = _send(servers.addresses[target], [opening, *sequence])
    assert codes <= CLEAN, codes


def test_well_formed_session_stays_exact_under_fuzzing(servers) -> None:
    stop = threading.Event()

    def fuzz() -> None:
        rng = torch.Generator().manual_seed(0)
        while not stop.is_set():
            n = int(torch.randint(1, 6, (1,), generator=rng))
            junk = {"frames": [pb.Frame(session_id="junk", kind=pb.PREFILL, pos_start=0, token_count=n)],
                    "dtype": pb.F32, "hidden_size": 32,
                    "activations": bytes(int(torch.randint(0, 400, (1,), generator=rng)))}
            assert _send(servers.addresses[1], [junk]) <= CLEAN

    worker = threading.Thread(target=fuzz, daemon=True)
    worker.start()
    try:
        for _ in range(3):
            assert generate(GrpcPipeline(servers.addresses), PROMPT, 30, temperature=0.0) == servers.expected
    finally:
        stop.set()
        worker.join(10)
