"""The prefix cache's room is one rule (modeling.kv.prefix_cache_room), and both sides use it:
the stage evicts its entries past it, and the frontend bounds its index of them by the most it
can be. Were the frontend's bound smaller, it would forget entries the stages still hold; larger,
it would offer forks of entries they have evicted."""

from __future__ import annotations

import pytest

from inferencemesh.frontend.engine.engine import EngineOptions, PipelineEngine
from inferencemesh.frontend.engine.session import PipelineSession
from inferencemesh.modeling.kv import prefix_cache_room
from inferencemesh.stage.sessions import SessionTable


class _Unused:
    """A pipeline the engine is built over and never uses here."""

    def open(self) -> PipelineSession:
        raise AssertionError("no session is opened")

    async def is_ready(self) -> bool:
        return True

    async def close(self) -> None:
        pass


@pytest.mark.parametrize(("max_sessions", "max_context", "cache_tokens"), [(1, 64, 0), (4, 128, 100), (16, 2048, 8192)])
def test_the_frontend_bounds_its_index_by_the_room_the_stage_gives_its_entries(max_sessions: int, max_context: int,
                                                                               cache_tokens: int) -> None:
    stage = SessionTable(max_sessions, 60.0, max_context=max_context, cache_tokens=cache_tokens)
    engine = PipelineEngine(_Unused(), EngineOptions("t", max_context=max_context, max_sessions=max_sessions,
                                                     prefix_cache_tokens=cache_tokens))
    assert engine.prefix_entries is not None
    assert engine.prefix_entries.capacity == stage.cache_room() == max_sessions * max_context + cache_tokens


def test_each_live_session_takes_its_slot_from_the_entries() -> None:
    stage = SessionTable(4, 60.0, max_context=128, cache_tokens=100)
    stage.open("a")
    stage.open("b")
    assert stage.cache_room() == prefix_cache_room(max_sessions=4, max_context=128, cache_tokens=100,
                                                   live_sessions=2) == 100 + 2 * 128


def test_the_planner_reserves_what_the_stage_gives_its_sessions_and_entries(tmp_path) -> None:
    """The planned KV reserve is the stage's whole room: every session slot plus the entries' own."""
    import torch
    from tiny_models import write_tiny_model

    from inferencemesh.checkpoint.read import read_local
    from inferencemesh.planner import PlanInputs

    facts = read_local(write_tiny_model(tmp_path / "m", "llama", num_layers=2, shards=1, dtype=torch.float32))
    per_position = PlanInputs.from_checkpoint(facts, context_length=1, max_sessions=1).kv_bytes_per_layer
    planned = PlanInputs.from_checkpoint(facts, context_length=128, max_sessions=4, prefix_cache_tokens=100)
    stage = SessionTable(4, 60.0, max_context=128, cache_tokens=100)
    assert planned.kv_bytes_per_layer == per_position * stage.cache_room()
