"""stopping.py, the only place a choice's token stream ends: the budget (max_tokens within the
model's context), stop tokens (min_tokens, emit_stop_token), and why ("stop" or "length").

The rule's units first, then the engine's guarantee through the real PipelineEngine over a
scripted pipeline whose every step decides several tokens (a verified speculative window):
a choice never yields more than max_tokens, and its last Step, only it, carries finish_reason.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from inferencemesh.frontend.engine.api import GenerationRequest, Step
from inferencemesh.frontend.engine.engine import EngineOptions, PipelineEngine
from inferencemesh.frontend.engine.errors import InvalidRequest
from inferencemesh.frontend.engine.stopping import ChoiceStopping, Cut, StopRule, token_budget
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol.errors import PipelineError


def test_the_budget_is_max_tokens_within_the_room_the_context_leaves() -> None:
    assert token_budget(10, prompt_tokens=5, max_context=100) == 10
    assert token_budget(10, prompt_tokens=95, max_context=100) == 5
    assert token_budget(0, prompt_tokens=5, max_context=100) == 0
    assert token_budget(10, prompt_tokens=100, max_context=100) == 0  # never negative


def test_the_rule_of_a_request() -> None:
    request = GenerationRequest("r", [1] * 60, 10, stop_token_ids=frozenset({7}), min_tokens=2,
                                emit_stop_token=True)
    assert StopRule.of(request, max_context=64) == StopRule(4, frozenset({7}), 2, True)


def test_the_budget_cuts_a_window_that_overshoots_it_and_ends_with_length() -> None:
    stopping = ChoiceStopping(StopRule(5))
    assert stopping.cut([1, 2, 3]) == Cut(3, None)
    assert stopping.cut([4, 5, 6, 7]) == Cut(2, "length")
    assert stopping.yielded == 5 and stopping.finish_reason == "length"
    assert stopping.cut([8]) == Cut(0, None)  # an ended choice yields nothing more


def test_a_stop_token_ends_with_stop_and_is_yielded_only_when_asked() -> None:
    assert ChoiceStopping(StopRule(10, frozenset({9}))).cut([1, 9, 2]) == Cut(1, "stop")
    assert ChoiceStopping(StopRule(10, frozenset({9}), emit_stop_token=True)).cut([1, 9, 2]) == Cut(2, "stop")


def test_a_stop_token_past_the_budget_ends_nothing_the_budget_does() -> None:
    assert ChoiceStopping(StopRule(2, frozenset({9}))).cut([1, 2, 9]) == Cut(2, "length")
    # an emitted stop token counts in the budget: the last one it allows still ends with "stop"
    assert ChoiceStopping(StopRule(2, frozenset({9}), emit_stop_token=True)).cut([1, 9]) == Cut(2, "stop")


def test_no_stop_token_ends_the_choice_before_min_tokens() -> None:
    stopping = ChoiceStopping(StopRule(10, frozenset({9}), min_tokens=3))
    assert stopping.cut([9, 1]) == Cut(2, None)
    assert stopping.decided([9, 9]) == [9]  # the 3rd token on is a stop
    assert stopping.cut([9, 9]) == Cut(1, "stop")


def test_decided_tokens_end_before_the_stop_whatever_the_budget() -> None:
    stopping = ChoiceStopping(StopRule(1, frozenset({9})))
    assert stopping.decided([1, 2, 9, 3]) == [1, 2]
    assert stopping.decided([1, 2]) == [1, 2]


def test_a_zero_budget_ends_at_once_with_length() -> None:
    assert ChoiceStopping(StopRule(0, frozenset({9}))).cut([9]) == Cut(0, "length")


class _ScriptedSession:
    """A pipeline session whose prefill decides one token and every later step `window` tokens,
    counting up from 100 (a stop token is whichever the request names). A prompt chunk that wants
    no prediction is acknowledged at once."""

    def __init__(self, session_id: str, window: int, tokens: itertools.count) -> None:
        self.session_id, self.window, self.tokens = session_id, window, tokens
        self.failure: PipelineError | None = None

    def submit(self, frame: pb.Frame) -> asyncio.Future | None:
        answer = asyncio.get_running_loop().create_future()
        if frame.kind == pb.PREFILL and not frame.want_prediction:
            answer.set_result(None)
        else:
            count = 1 if frame.kind == pb.PREFILL else self.window
            answer.set_result(pb.Prediction(session_id=self.session_id, seq=frame.seq,
                                            tokens=[next(self.tokens) for _ in range(count)]))
        return answer

    async def wait(self, answer: asyncio.Future) -> pb.Prediction | None:
        return await answer

    async def send(self, frame: pb.Frame) -> pb.Prediction | None:
        answer = self.submit(frame)
        return None if answer is None else await self.wait(answer)

    def withdraw(self, err: PipelineError) -> None:
        self.failure = err

    async def close(self) -> bool:
        return True


class _ScriptedPipeline:
    def __init__(self, window: int) -> None:
        self.window, self.opened = window, 0

    def open(self) -> _ScriptedSession:
        self.opened += 1
        return _ScriptedSession(f"s{self.opened}", self.window, itertools.count(100))

    async def is_ready(self) -> bool:
        return True

    async def close(self) -> None:
        pass


def _steps(request: GenerationRequest, window: int, max_context: int = 64) -> list[Step]:
    async def go() -> list[Step]:
        engine = PipelineEngine(_ScriptedPipeline(window),
                                EngineOptions("t", max_context=max_context, prefix_cache=False))
        try:
            return [step async for step in engine.generate(request)]
        finally:
            await engine.close()

    return asyncio.run(go())


@pytest.mark.parametrize("window", [1, 3, 8])
@pytest.mark.parametrize("max_tokens", [0, 1, 2, 5, 7, 40])
@pytest.mark.parametrize("stop", [None, 103, 104])
@pytest.mark.parametrize("emit", [False, True])
def test_the_engine_never_yields_past_the_budget_and_its_last_step_says_why(window: int, max_tokens: int,
                                                                             stop: int | None, emit: bool) -> None:
    prompt = [1] * 30  # a 40-token budget meets the context (64) first: 34 tokens of room
    request = GenerationRequest("r", prompt, max_tokens, temperature=0.0, emit_stop_token=emit,
                                stop_token_ids=frozenset() if stop is None else frozenset({stop}))
    steps = _steps(request, window)
    tokens = [t for step in steps for t in step]
    budget = min(max_tokens, 64 - len(prompt))
    assert len(tokens) <= budget
    assert [step.finish_reason for step in steps[:-1]] == [None] * (len(steps) - 1)
    stopped = stop is not None and stop - 100 < budget  # the stop token's position is stop - 100
    if stopped:
        assert steps[-1].finish_reason == "stop"
        assert tokens == list(range(100, stop + int(emit)))
    else:
        assert steps[-1].finish_reason == "length" and tokens == list(range(100, 100 + budget))


def test_the_engine_refuses_a_negative_max_tokens() -> None:
    with pytest.raises(InvalidRequest, match="max_tokens"):
        _steps(GenerationRequest("r", [1, 2], -1), window=1)
