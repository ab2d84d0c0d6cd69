"""What the engine drives: a Proposer per request, and the live window it proposes with.

A proposer proposes tokens for the last stage to verify (a VERIFY frame) and learns from what
was accepted. Its window (how many tokens it proposes) grows while speculation pays and
shrinks when it does not; WindowedProposer reports each verify round to the metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from inferencemesh.speculation import WindowPolicy

if TYPE_CHECKING:
    from inferencemesh.frontend.engine.grammar import SessionGrammar
    from inferencemesh.frontend.engine.metrics import FrontendMetrics
    from inferencemesh.sampling import DraftRow

# ---- the interface the engine drives ------------------------------------------------------------


@dataclass
class Proposal:
    tokens: list[int]
    # The distribution each token was drawn from (sampling with a draft model, for Leviathan's rule),
    # else empty: each was proposed with probability 1, or the target races.
    q: list[DraftRow] = field(default_factory=list)


class Proposer:
    """Speculation strategy for one request: propose tokens, learn from what was accepted."""

    # Structured output: the choice's grammar (frontend/engine/grammar.py). The frontend cuts a window at
    # the first draft it forbids; a proposer that can (a draft model) follows it so none is cut.
    grammar: SessionGrammar | None = None

    def propose(self, history: list[int]) -> Proposal | None:
        return None

    async def propose_async(self, history: list[int]) -> Proposal | None:
        """What the engine calls: a strategy may compute together with other requests' (a draft model)."""
        return self.propose(history)

    def observe(self, proposed: int, accepted: int, propose_s: float, round_trip_s: float) -> None:
        """What a step did: tokens proposed and accepted, seconds spent proposing and in the round trip."""

    def reproducible(self) -> None:
        """The request is greedy or seeded: propose the same way every run (no timing-driven choices)."""

    def close(self) -> None:
        pass


# ---- window policy ---------------------------------------------------------------------------


class Window:
    """The live window of one request: grow on full acceptance, shrink on early rejection,
    and keep a larger window only while it costs less per token than plain decoding.

    A window's cost is what it really took: proposing (a draft model's forward passes) plus the
    VERIFY round trip. Plain decoding's cost is a measured DECODE round trip where the strategy
    decodes plainly now and then (n-gram, auto); a draft proposes every step, so there it is
    estimated by the VERIFY round trip, which costs about as much as a DECODE one.

    Untimed (a greedy or seeded request): the window adapts on acceptance alone. Timings vary from
    run to run, so a window sized by them would give the same request other frame shapes each time,
    and its logits, computed in those shapes by kernels that are not batch-invariant, could differ
    in the last bits: such a request's tokens would not reproduce (see README, "seed").
    """

    def __init__(self, policy: WindowPolicy, timed: bool = True) -> None:
        self.policy = policy
        self.timed = timed
        self.k = policy.initial
        self.plain_step_s: float | None = None  # EMA of a DECODE round trip
        self.verify_s: float | None = None  # EMA of a VERIFY round trip
        self.spec_token_s: float | None = None  # EMA of seconds per produced token when speculating

    def observe_plain(self, seconds: float) -> None:
        self.plain_step_s = _ema(self.plain_step_s, seconds, 0.2)

    def observe(self, proposed: int, accepted: int, propose_s: float, round_trip_s: float) -> None:
        self.spec_token_s = _ema(self.spec_token_s, (propose_s + round_trip_s) / (accepted + 1), 0.3)
        self.verify_s = _ema(self.verify_s, round_trip_s, 0.3)
        if not self.policy.adaptive:
            return
        if (self.timed and self.spec_token_s > self.plain_cost_s) or accepted < proposed // 2:
            self.k = max(self.policy.minimum, self.k - 1)  # costs more than it saves, or rejected early
        elif accepted == proposed:
            self.k = min(self.policy.maximum, self.k + 1)

    @property
    def plain_cost_s(self) -> float:
        # Neither measured yet: nothing says speculation costs more.
        known = self.plain_step_s if self.plain_step_s is not None else self.verify_s
        return math.inf if known is None else known

    @property
    def paying(self) -> bool:
        """False once speculation measurably costs more per token than plain decoding (never when
        untimed: only acceptance decides then)."""
        return not self.timed or self.spec_token_s is None or self.spec_token_s <= self.plain_cost_s * 1.05


def _ema(current: float | None, sample: float, weight: float) -> float:
    return sample if current is None else (1 - weight) * current + weight * sample


class WindowedProposer(Proposer):
    """A proposer with a live window, reporting every verify round to the metrics."""

    def __init__(self, policy: WindowPolicy, metrics: FrontendMetrics | None = None) -> None:
        self.window = Window(policy)
        self.metrics = metrics

    def reproducible(self) -> None:
        """The request is greedy or seeded: its window adapts on acceptance alone (Window)."""
        self.window.timed = False

    def observe(self, proposed: int, accepted: int, propose_s: float, round_trip_s: float) -> None:
        if proposed == 0:
            self.window.observe_plain(round_trip_s)
            return
        self.window.observe(proposed, accepted, propose_s, round_trip_s)
        if self.metrics is not None:
            self.metrics.record_verify_round(proposed, accepted)
            self.metrics.set_window_size(self.window.k)
