"""Message limits that fit the plan: both ends of a stage stream take transport.message_limit of
the plan (not 256 MiB), the largest Batch the step scheduler can cut fits it, and a stage refuses
a larger message from the gRPC length prefix, before it holds the bytes."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from mesh_helpers import generate, hf_greedy, start_mesh
from tiny_models import write_tiny_model

from inferencemesh.checkpoint.read import read_local
from inferencemesh.config import DEFAULT_MAX_SESSIONS
from inferencemesh.frontend.engine.pipeline import GrpcPipeline
from inferencemesh.frontend.engine.scheduler import _Waiting, draft_rows, next_microbatch
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol.transport import (
    FALLBACK_MESSAGE_BYTES,
    KV_BLOCK_TOKENS,
    MAX_DRAFT_ROWS_PER_BATCH,
    MAX_DRAFT_TOKENS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_WINDOW,
    PREFILL_CHUNK_TOKENS,
    message_limit,
)
from inferencemesh.sampling import SamplingParams, unsafe_field

QWEN_05B = {"hidden_size": 896, "vocab_size": 151936}  # Qwen2.5-0.5B's shape, the default model's family
TINY = {"hidden_size": 32, "vocab_size": 259}
CONTEXT = 32768  # every frame's block table as long as this context, its ids as wide as a varint gets


def fullest_sampling(vocab_size: int) -> pb.Sampling:
    """Sampling with every list at the most the API lets through."""
    return pb.Sampling(temperature=0.7, top_p=0.9, top_k=40, seed=2**64 - 1, presence_penalty=-2.0,
                       frequency_penalty=2.0, repetition_penalty=1.1, min_tokens=2**32 - 1, prompt_tokens=2**32 - 1,
                       logit_bias={vocab_size - 1 - i: -100.0 for i in range(MAX_LOGIT_BIAS_ENTRIES)},
                       stop_token_ids=list(range(vocab_size - 64, vocab_size)), logprobs=True, top_logprobs=20)


def waiting_frames(shape: dict, sessions: int, window: int) -> list[_Waiting]:
    """Every session with a frame waiting, as large as each kind gets: long ids, the fullest
    sampling, prompt chunks, sampled verify windows of `window` drafts with their distributions,
    block tables of the whole CONTEXT."""
    vocab = shape["vocab_size"]
    table = [2**32 - 1] * (CONTEXT // KV_BLOCK_TOKENS)
    listed = min(vocab, MAX_DRAFT_TOKENS)  # the fullest rows, every one with a remainder
    draft_q = pb.DraftDistributions(sizes=[listed] * window, token_ids=bytes(4 * listed * window),
                                    probs=bytes(4 * listed * window), remainders=[0.1] * window)
    frames = []
    for i in range(sessions):
        sid, rid = f"cmpl-{'x' * 40}-{i}", f"req-{'y' * 40}-{i}"
        if i % 3 == 0:
            frame = pb.Frame(session_id=sid, request_id=rid, kind=pb.PREFILL, pos_start=2**31, seq=2**63,
                             token_count=PREFILL_CHUNK_TOKENS, token_ids=[vocab - 1] * PREFILL_CHUNK_TOKENS,
                             want_prediction=True, prompt_logprobs=True, sampling=fullest_sampling(vocab),
                             kv_blocks=table)
        else:
            frame = pb.Frame(session_id=sid, request_id=rid, kind=pb.VERIFY, pos_start=2**31, seq=2**63,
                             token_count=window + 1, token_ids=[vocab - 1] * (window + 1), draft_q=draft_q,
                             sampling=fullest_sampling(vocab), sent_ns=2**63, kv_blocks=table)
        frames.append(_Waiting(frame, None, None))  # type: ignore[arg-type]
    return frames


def as_sent(frames: list[pb.Frame], hidden_size: int) -> pb.Batch:
    """The Batch as a stage sends it on: float32 activations (the widest wire dtype) for every
    token, and a failure of the stage before for every frame."""
    rows = sum(f.token_count for f in frames)
    failures = [pb.Failure(session_id=f.session_id, seq=f.seq, kind=f.kind, code=13, message="m" * 200)
                for f in frames]
    return pb.Batch(seq=2**63, frames=frames, dtype=pb.F32, hidden_size=hidden_size,
                    activations=bytes(rows * hidden_size * 4), failures=failures)


def answered(frames: list[pb.Frame], vocab_size: int) -> pb.BatchResult:
    """The BatchResult for them, with 20 alternatives for every token, prompt tokens included."""
    def logprobs(count: int) -> list[pb.TokenLogprobs]:
        return [pb.TokenLogprobs(token=vocab_size - 1, logprob=-1e30, top_tokens=[vocab_size - 1] * 20,
                                 top_logprobs=[-1e30] * 20) for _ in range(count)]

    predictions = [pb.Prediction(session_id=f.session_id, seq=f.seq, pos_start=f.pos_start,
                                 tokens=[vocab_size - 1] * f.token_count, accepted=f.token_count,
                                 logprobs=logprobs(f.token_count), prompt_logprobs=logprobs(f.token_count))
                   for f in frames]
    return pb.BatchResult(seq=2**63, predictions=predictions)


@pytest.mark.parametrize("shape", [TINY, QWEN_05B], ids=["tiny", "qwen2.5-0.5b"])
@pytest.mark.parametrize(("sessions", "budget", "window"), [(16, 256, 8), (16, 2048, MAX_WINDOW), (64, 512, 2)])
def test_the_largest_batch_the_scheduler_cuts_fits_the_limit(shape: dict, sessions: int, budget: int,
                                                             window: int) -> None:
    limit = message_limit(**shape, max_batch_tokens=budget, max_sessions=sessions, max_context=CONTEXT)
    waiting = waiting_frames(shape, sessions, window)
    batch, rest = next_microbatch(waiting, budget)
    frames = [w.frame for w in batch]
    assert sum(draft_rows(f) for f in frames) <= MAX_DRAFT_ROWS_PER_BATCH
    assert as_sent(frames, shape["hidden_size"]).ByteSize() <= limit
    assert answered(frames, shape["vocab_size"]).ByteSize() <= limit
    # what waits goes in later batches, each within the limit too
    while rest:
        batch, rest = next_microbatch(rest, budget)
        assert batch and as_sent([w.frame for w in batch], shape["hidden_size"]).ByteSize() <= limit


def test_draft_rows_beyond_the_cap_wait_for_the_next_batch_and_one_window_always_goes() -> None:
    waiting = waiting_frames(TINY, 16, MAX_WINDOW)
    verify = [w for w in waiting if w.frame.kind == pb.VERIFY]
    batch, rest = next_microbatch(verify, 256)
    assert len(batch) == MAX_DRAFT_ROWS_PER_BATCH // MAX_WINDOW and len(rest) == len(verify) - len(batch)
    greedy = [_Waiting(pb.Frame(session_id=f"g{i}", kind=pb.VERIFY, token_count=MAX_WINDOW + 1), None, None)
              for i in range(16)]  # type: ignore[arg-type]
    assert next_microbatch(greedy, 256) == (greedy, [])  # no probabilities: no rows to cap


def test_the_plans_limit_is_far_under_the_old_256_mib() -> None:
    default = message_limit(**QWEN_05B, max_batch_tokens=256, max_sessions=DEFAULT_MAX_SESSIONS, max_context=2048)
    tiny = message_limit(**TINY, max_batch_tokens=256, max_sessions=DEFAULT_MAX_SESSIONS, max_context=2048)
    print(f"message limit: Qwen2.5-0.5B shape {default / 2**20:.1f} MiB, tiny {tiny / 2**20:.2f} MiB "
          f"(fallback {FALLBACK_MESSAGE_BYTES / 2**20:.0f} MiB)")
    assert tiny < 8 * 2**20 and default < FALLBACK_MESSAGE_BYTES // 2
    assert message_limit(**QWEN_05B, max_batch_tokens=4096, max_sessions=DEFAULT_MAX_SESSIONS,
                         max_context=2048) > default  # the budget counts
    assert message_limit(**QWEN_05B, max_batch_tokens=256, max_sessions=DEFAULT_MAX_SESSIONS,
                         max_context=32768) > default  # so do the block tables of a longer context


def test_logit_bias_entries_are_bounded_where_sampling_is_checked() -> None:
    many = tuple((i, 1.0) for i in range(MAX_LOGIT_BIAS_ENTRIES + 1))
    assert unsafe_field(SamplingParams(logit_bias=many[:-1])) is None
    field, why = unsafe_field(SamplingParams(logit_bias=many))  # type: ignore[misc]
    assert field == "logit_bias" and str(MAX_LOGIT_BIAS_ENTRIES) in why


def high_water_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM")).split()[1])


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_a_stage_refuses_a_message_over_the_plans_limit_before_holding_it(tmp_path: Path) -> None:
    """A stage process started with the plan's limit answers a 200 MB Batch with RESOURCE_EXHAUSTED
    from its length prefix: its memory high-water mark does not move by the message's size; it then
    serves the frontend's pipeline, whose channels take the same limit, exactly."""
    model = write_tiny_model(tmp_path / "m", "llama", num_layers=2, hidden_size=32, intermediate_size=64)
    facts = read_local(model)
    limit = message_limit(hidden_size=facts.hidden_size, vocab_size=facts.vocab_size, max_batch_tokens=256,
                          max_sessions=16, max_context=256)  # start_mesh's
    mesh = start_mesh(model, 2, max_message_bytes=limit)
    try:
        pid = mesh.processes[0].process.pid
        before = high_water_kib(pid)
        from inferencemesh.protocol import stage_pb2_grpc as pb_grpc

        with grpc.insecure_channel(mesh.addresses[0], options=[("grpc.max_send_message_length", 2**30)]) as channel:
            call = pb_grpc.StageStub(channel).Pipeline(iter([pb.Batch(seq=1, activations=bytes(200_000_000))]),
                                                       timeout=60)
            with pytest.raises(grpc.RpcError) as refused:
                list(call)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"vs. {limit}" in (refused.value.details() or "")
        grown = high_water_kib(pid) - before
        print(f"stage high-water mark grew {grown} KiB for a 200 MB message (limit {limit} B)")
        assert grown < 50_000
        prompt = [3, 14, 15, 92, 65, 35]
        pipeline = GrpcPipeline(mesh.addresses, max_message_bytes=limit)
        assert generate(pipeline, prompt, 8, temperature=0.0) == hf_greedy(model, prompt, 8)
    finally:
        mesh.stop()
