"""Constrained speculative sampling has the distribution of constrained plain sampling.

The last stage's own decision function (stage/decide.py) verifies a one-draft window thousands of
times, each with its own seed, under token masks, and a chi-square test compares the first
decided token with the target's masked distribution. The draft is drawn from a masked draft
distribution, and, as a second case, from an unmasked one: speculative sampling stays exact for
any draft distribution once the target's rows are masked (an unmasked draft only loses
acceptance). The control: the same windows without the masks at verification fail the test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inferencemesh.protocol import codec
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.sampling import SamplingParams, draft_row, draw
from inferencemesh.stage.decide import decide
from inferencemesh.stage.sessions import StageSession
from inferencemesh.token_masks import mask_words, pack_token_masks

VOCAB = 24
ALLOWED = [(1, 3, 5, 7, 11), (2, 4, 6)]  # the grammar's tokens at the draft's position and at the bonus
SAMPLES = 3000
CHI2_CRITICAL_DF4 = 18.47  # p = 0.001, 4 degrees of freedom (5 allowed tokens)


def masks() -> bytes:
    words = np.zeros((len(ALLOWED), mask_words(VOCAB)), dtype=np.uint32)
    for row, tokens in enumerate(ALLOWED):
        for token in tokens:
            words[row, token // 32] |= np.uint32(1 << (token % 32))
    return pack_token_masks(words.view(np.int32), VOCAB)


def masked_probs(logits: torch.Tensor, allowed: tuple[int, ...]) -> torch.Tensor:
    kept = torch.full_like(logits, float("-inf"))
    kept[list(allowed)] = logits[list(allowed)]
    return torch.softmax(kept, -1)


def first_tokens(logits: torch.Tensor, draft_q: torch.Tensor, with_masks: bool) -> np.ndarray:
    """The first token decided by SAMPLES one-draft windows, each seeded apart, its draft drawn from q."""
    counts = np.zeros(VOCAB)
    for seed in range(SAMPLES):
        row = draft_row(draft_q)  # the row the wire carries, which the draft draws from
        draft, _ = draw(row, torch.Generator().manual_seed(10_000 + seed))
        session = StageSession(f"s{seed}", sampling=SamplingParams(temperature=1.0, seed=seed))
        frame = pb.Frame(session_id=session.session_id, kind=pb.VERIFY, pos_start=9, token_count=2,
                         token_ids=[0, draft], draft_q=codec.encode_draft_q([row]),
                         token_masks=masks() if with_masks else b"")
        counts[decide(session, frame, logits.clone(), VOCAB).tokens[0]] += 1
    return counts


def chi_square(counts: np.ndarray, expected_probs: torch.Tensor) -> float:
    """Pearson's statistic over the allowed tokens; a token outside them makes it infinite."""
    expected = expected_probs.numpy() * counts.sum()
    outside = [t for t in range(VOCAB) if t not in ALLOWED[0]]
    if counts[outside].sum():
        return float("inf")
    cells = list(ALLOWED[0])
    return float(((counts[cells] - expected[cells]) ** 2 / expected[cells]).sum())


@pytest.fixture(scope="module")
def target() -> torch.Tensor:
    return torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3)) * 1.5


@pytest.mark.parametrize("draft", ["masked", "unmasked"])
def test_constrained_speculative_sampling_has_the_constrained_distribution(target: torch.Tensor, draft: str) -> None:
    draft_logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(4))
    q = masked_probs(draft_logits, ALLOWED[0]) if draft == "masked" else torch.softmax(draft_logits, -1)
    counts = first_tokens(target, q, with_masks=True)
    assert chi_square(counts, masked_probs(target[0], ALLOWED[0])) < CHI2_CRITICAL_DF4, counts


def test_without_the_masks_at_verification_the_distribution_is_wrong(target: torch.Tensor) -> None:
    q = masked_probs(torch.randn(VOCAB, generator=torch.Generator().manual_seed(4)), ALLOWED[0])
    counts = first_tokens(target, q, with_masks=False)  # the draft follows the grammar, the target does not
    assert chi_square(counts, masked_probs(target[0], ALLOWED[0])) > CHI2_CRITICAL_DF4

