"""Property-based fuzzing of stage batches: every bad frame gets a clean gRPC status of its own
(the stream stays up), and a well-formed session running at the same time still gets exactly
the right tokens."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mesh_helpers import generate
from tiny_models import write_tiny_model
from wire import StageServers, exchange, failures

from inferencemesh.frontend.pipeline import GrpcPipeline
from inferencemesh.programs.mesh import in_process_pipeline
from inferencemesh.protocol import stage_pb2 as pb

pytestmark = pytest.mark.slow
CLEAN = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
         grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS}
PROMPT = [3, 14, 15, 92, 65, 35]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    model = write_tiny_model(tmp_path_factory.mktemp("fuzz") / "m", "llama", num_layers=2, shards=1,
                             hidden_size=32, intermediate_size=64)
    s = StageServers(model, [(0, 1), (1, 2)])
    s.expected = generate(in_process_pipeline(s.runtimes), PROMPT, 30, temperature=0.0)
    yield s
    s.close()


frames = st.builds(
    pb.Frame,
    session_id=st.sampled_from(["fz-a", "fz-b", ""]) | st.text(max_size=8),
    kind=st.integers(-1, 6),
    pos_start=st.integers(0, 300),
    token_count=st.integers(0, 40),
    token_ids=st.lists(st.integers(-5, 400), max_size=40),
    want_prediction=st.booleans(),
    draft_probs=st.binary(max_size=64),
)
batches = st.fixed_dictionaries({
    "frames": st.lists(frames, min_size=1, max_size=3),
    "dtype": st.integers(-1, 4),
    "hidden_size": st.integers(0, 64),
    "activations": st.binary(max_size=512),
})


def _send(address: str, batch: dict) -> set[grpc.StatusCode]:
    """The statuses of the batch's failed frames. The stream itself must stay up: bad frames fail alone."""
    results, status = exchange(address, [batch], timeout=10)
    assert status == grpc.StatusCode.OK and len(results) == 1, status
    return {code for code, _ in failures(results[0])}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=batches, target=st.sampled_from([0, 1]))
def test_random_frames_get_clean_statuses(servers, batch, target) -> None:
    codes = _send(servers.addresses[target], batch)
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
            assert _send(servers.addresses[1], junk) <= CLEAN

    worker = threading.Thread(target=fuzz, daemon=True)
    worker.start()
    try:
        for _ in range(3):
            assert generate(GrpcPipeline(servers.addresses), PROMPT, 30, temperature=0.0) == servers.expected
    finally:
        stop.set()
        worker.join(10)
