"""The README's reproducibility guarantee, through `inferencemesh serve` with its defaults (draft
speculation; bfloat16 where the CPU computes it natively, else float32): a greedy or seeded request
run alone gives the same output every time, however busy the machine around the server is.

Before issue 33 it did not: a seeded token's draw depended on whether a draft stood at its
position (Leviathan's accept / resample draws vs. plain sampling's), and the draft window was
sized by measured timings, so the same request met other windows, hence other tokens, from run
to run (2 of 15 seeded 200-token chats differed between two runs alone; 15 of 15 between alone
and four at a time, where speculation pauses).
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from mesh_helpers import serving

from inferencemesh.frontend.engine.proposers.base import Window
from inferencemesh.speculation import WindowPolicy

PROMPTS = ["def fibonacci(n):", "Write a function that merges two sorted lists.", "class Stack:",
           "import os\nimport sys\n\ndef main():"]
MAX_TOKENS = 64


def _chat(base: str, prompt: str, **sampling: object) -> str:
    body = {"model": "imesh-code-target", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": MAX_TOKENS, **sampling}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def _requests() -> list[tuple[str, dict]]:
    seeded = [(p, {"temperature": 0.9, "top_p": 0.95, "seed": 1000 + i}) for i, p in enumerate(PROMPTS)]
    return [*seeded, (PROMPTS[0], {"temperature": 0.0})]


def _alone(base: str) -> list[str]:
    return [_chat(base, prompt, **sampling) for prompt, sampling in _requests()]


def test_a_greedy_or_seeded_request_alone_is_the_same_every_time() -> None:
    with serving("--no-prefix-cache") as (base, _, _):
        first = _alone(base)
        # The same requests, alone on the server again, while the machine is busy: every timing
        # differs (what used to size the draft window), the frames' shapes must not.
        burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            second = _alone(base)
        finally:
            burner.kill()
            burner.wait()
        third = _alone(base)
    assert len(set(first)) == len(first)  # the seeds and prompts do give different answers
    for a, b, c, (prompt, sampling) in zip(first, second, third, _requests(), strict=True):
        assert a == b == c, (prompt, sampling, a, b, c)


@pytest.mark.parametrize("timings", [(0.002, 0.010), (0.060, 0.010), (0.030, 0.004)])
def test_an_untimed_window_follows_acceptance_alone(timings: tuple[float, float]) -> None:
    """A reproducible request's window: the same acceptances give the same sizes whatever the
    timings (a timed window shrinks where the draft costs more than it saves)."""
    propose_s, round_trip_s = timings
    rounds = [(4, 4), (5, 5), (6, 2), (5, 5), (6, 6), (7, 1), (6, 6)]
    sizes = []
    window = Window(WindowPolicy(), timed=False)
    for proposed, accepted in rounds:
        window.observe(proposed, accepted, propose_s, round_trip_s)
        sizes.append(window.k)
    assert sizes == [5, 6, 5, 6, 7, 6, 7] and window.paying


def test_a_reproducible_request_drafts_by_the_race_and_sends_no_q() -> None:
    """A seeded request's draft races with the target's noise and sends no q (the last stage then
    races too); an unseeded one sends q for Leviathan's rule, which accepts more."""
    from inferencemesh.bundled import DRAFT_MODEL, bundled_path
    from inferencemesh.frontend.engine.proposers.draft import DraftProposer
    from inferencemesh.frontend.engine.proposers.draft_model import DraftModel
    from inferencemesh.protocol.transport import MAX_DRAFT_TOKENS
    from inferencemesh.sampling import SamplingParams

    draft = DraftModel(str(bundled_path(DRAFT_MODEL)), dtype="float32", device="cpu", max_context=256)
    history = list(range(5, 25))
    params = SamplingParams(temperature=0.9, seed=3)
    plain = DraftProposer(draft, WindowPolicy(), params)
    racing = DraftProposer(draft, WindowPolicy(), params)
    racing.reproducible()
    leviathan, raced = plain.propose(history), racing.propose(history)
    assert leviathan is not None and raced is not None
    assert len(leviathan.q) == len(leviathan.tokens) and raced.q == []
    assert all(row.vocab == draft.vocab_size and 0 < row.ids.numel() <= MAX_DRAFT_TOKENS for row in leviathan.q)
    assert plain.window.timed and not racing.window.timed
    again = DraftProposer(draft, WindowPolicy(), params)
    again.reproducible()
    assert again.propose(history) == raced
