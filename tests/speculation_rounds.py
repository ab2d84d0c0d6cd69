"""How many speculative rounds a strategy's requests ran, as the frontend's metrics count them.

An exactness test of speculative decoding proves something only if drafts were verified and
accepted: these let each such test assert that every strategy but "none" ran VERIFY rounds whose
drafts the target kept (and that "none" never did)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from inferencemesh.frontend.engine.metrics import MODEL_LABEL, PREFIX, FrontendMetrics


@dataclass(frozen=True)
class Rounds:
    """What a strategy's requests did, as the frontend's metrics count it."""

    verify: float = 0.0  # engine steps that VERIFYed drafts
    proposed: float = 0.0  # draft tokens sent for verification
    accepted: float = 0.0  # of them, kept by the target

    def __add__(self, other: Rounds) -> Rounds:
        return Rounds(self.verify + other.verify, self.proposed + other.proposed, self.accepted + other.accepted)

    @classmethod
    def counted(cls, metrics: FrontendMetrics) -> Rounds:
        def sample(name: str, **labels: str) -> float:
            return metrics.registry.get_sample_value(PREFIX + name, {MODEL_LABEL: metrics.model, **labels}) or 0.0

        return cls(sample("step_pipeline_seconds_count", kind="verify"), sample("spec_decode_num_draft_tokens_total"),
                   sample("spec_decode_num_accepted_tokens_total"))


def assert_speculated(name: str, rounds: Iterable[Rounds], *, accepted: bool = True) -> None:
    """Strategy `name` ran verify rounds (over all its `rounds`) whose drafts were accepted, or,
    with accepted=False, at least verified (penalties make a repeating n-gram's drafts unlikely to
    survive: the rejection path is what such a test covers); "none" never verified anything."""
    total = sum(rounds, Rounds())
    if name == "none":
        assert total == Rounds(), total
        return
    assert total.verify > 0 and total.proposed > 0, f"{name} speculated nothing: {total}"
    assert total.accepted > 0 or not accepted, f"{name}: the target accepted no draft: {total}"
