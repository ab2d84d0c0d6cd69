"""The frontend's step scheduler: how waiting frames become microbatches."""

from __future__ import annotations

from types import SimpleNamespace

from inferencemesh.frontend.scheduler import next_microbatch
from inferencemesh.protocol import stage_pb2 as pb


def waiting(session: str, kind: int, tokens: int) -> SimpleNamespace:
    return SimpleNamespace(frame=pb.Frame(session_id=session, kind=kind, token_count=tokens))


def names(items: list) -> list[str]:
    return [f"{i.frame.session_id}:{pb.FrameKind.Name(i.frame.kind)}" for i in items]


def test_decodes_always_ride_prompt_chunks_share_a_budget_and_a_session_waits_its_turn() -> None:
    queue = [waiting("a", pb.DECODE, 1),
             waiting("p", pb.PREFILL, 6),   # the first chunk always goes, whatever its size
             waiting("q", pb.PREFILL, 3),   # 6 + 3 > budget 8: waits
             waiting("a", pb.DECODE, 1),    # a is in this batch already: next one
             waiting("v", pb.VERIFY, 5),    # decode and verify frames never wait for the budget
             waiting("r", pb.PREFILL, 2),   # 6 + 2 fits
             waiting("q", pb.PREFILL, 1),   # q's earlier chunk waits, so this one does too
             waiting("p", pb.RELEASE, 0)]
    batch, rest = next_microbatch(queue, budget=8)
    assert names(batch) == ["a:DECODE", "p:PREFILL", "v:VERIFY", "r:PREFILL"]
    assert names(rest) == ["q:PREFILL", "a:DECODE", "q:PREFILL", "p:RELEASE"]
    batch, rest = next_microbatch(rest, budget=8)
    assert names(batch) == ["q:PREFILL", "a:DECODE", "p:RELEASE"] and names(rest) == ["q:PREFILL"]
    assert next_microbatch([], budget=8) == ([], [])
