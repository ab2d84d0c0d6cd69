"""Sampling and speculative verification: exact in distribution, reproducible by seed."""

from __future__ import annotations

import pytest
import torch

from inferencemesh import sampling
from inferencemesh.sampling import DraftRow, SamplingParams, adjust, draft_row, draw, next_token, probabilities, verify

CHI2_CRITICAL_P001 = {3: 16.27, 4: 18.47, 5: 20.52}  # chi-square quantiles at p = 0.001


def chi_square(samples: list[int], probs: torch.Tensor) -> tuple[float, int]:
    counts = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double()
    expected = probs.double() * len(samples)
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()), int(keep.sum()) - 1


def test_greedy_verify_accepts_longest_matching_prefix() -> None:
    logits = torch.full((4, 10), -5.0)
    for row, token in enumerate([3, 7, 1, 9]):
        logits[row, token] = 5.0
    assert verify(logits, [3, 7, 2], SamplingParams(), 10) == (2, [3, 7, 1])
    assert verify(logits, [3, 7, 1], SamplingParams(), 10) == (3, [3, 7, 1, 9])  # all accepted: bonus token
    assert verify(logits, [4, 7, 1], SamplingParams(), 10) == (0, [3])


def test_top_k_and_top_p_restrict_support() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert (probabilities(logits, SamplingParams(temperature=1.0, top_k=2))[0, 2:] == 0).all()
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.7))[0]
    assert p[0] > 0 and p[1] > 0 and (p[2:] == 0).all()  # 0.64 < 0.7 so the second token stays
    assert torch.isclose(p.sum(), torch.tensor(1.0))


def test_seeded_sampling_is_a_function_of_seed_and_position() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=1234)
    draws = [next_token(logits, params, pos) for pos in range(40)]
    assert draws == [next_token(logits, params, pos) for pos in range(40)]
    assert len(set(draws)) > 5  # and positions differ
    other = [next_token(logits, SamplingParams(temperature=1.0, seed=99), pos) for pos in range(40)]
    assert other != draws


def whole(q: torch.Tensor) -> list[DraftRow]:
    """Rows [k, V] of q as DraftRows that list every token."""
    return [DraftRow(torch.arange(q.shape[-1]), row, 0.0, q.shape[-1]) for row in q]


def _speculative_samples(n: int, send_q: bool = True, listed: int = 0,
                         told_whole: bool = False) -> tuple[list[int], list[int], torch.Tensor]:
    """Run verification n times with a draft distribution q far from the target p (q sent to
    verification: Leviathan's rule; not sent: the race). listed: the draft sends and draws from
    draft_row(q) with that many tokens listed and the rest an even remainder (told_whole: the verifier
    is told the whole q instead, which is wrong)."""
    gen = torch.Generator().manual_seed(7)
    vocab = 6
    target_logits = torch.randn(3, vocab, generator=gen) * 1.5
    params = SamplingParams(temperature=1.0)
    p = probabilities(target_logits, params)
    q = torch.softmax(torch.randn(2, vocab, generator=gen) * 1.5, -1)
    rows = [draft_row(row, listed) for row in q] if listed else whole(q)
    first, second = [], []
    for seed in range(n):
        drafts = [draw(rows[i], gen)[0] for i in range(2)]
        params = SamplingParams(temperature=1.0, seed=seed)
        _, tokens = verify(target_logits, drafts, params, 100, (whole(q) if told_whole else rows) if send_q else None)
        first.append(tokens[0])
        if len(tokens) > 1:
            second.append(tokens[1])
    return first, second, p


def test_speculative_sampling_matches_target_distribution() -> None:
    first, second, p = _speculative_samples(6000)
    stat, dof = chi_square(first, p[0])
    assert stat < CHI2_CRITICAL_P001[dof], f"first token deviates from p: chi2={stat:.1f}"
    stat, dof = chi_square(second, p[1])
    assert len(second) > 500 and stat < CHI2_CRITICAL_P001[dof], f"second token deviates: chi2={stat:.1f}"


def test_wrong_acceptance_rule_is_detected(monkeypatch) -> None:
    """The same statistical test fails when verification accepts every draft token."""
    monkeypatch.setattr(sampling, "accept", lambda p_token, q_token, u: True)
    first, _, p = _speculative_samples(6000)
    stat, dof = chi_square(first, p[0])
    assert stat > CHI2_CRITICAL_P001[dof]


def test_sparse_draft_rows_keep_the_target_distribution() -> None:
    """The wire's draft rows list q's most likely tokens and spread the rest evenly: a draft that draws
    from that row, verified against it, still yields p (1 of 6 tokens listed: a fifth of the first drafts
    come from the remainder); verified against the whole q it would not."""
    first, second, p = _speculative_samples(6000, listed=1)
    stat, dof = chi_square(first, p[0])
    assert stat < CHI2_CRITICAL_P001[dof], f"first token deviates from p: chi2={stat:.1f}"
    stat, dof = chi_square(second, p[1])
    assert len(second) > 500 and stat < CHI2_CRITICAL_P001[dof], f"second token deviates: chi2={stat:.1f}"
    first, _, p = _speculative_samples(6000, listed=1, told_whole=True)
    stat, dof = chi_square(first, p[0])
    assert stat > CHI2_CRITICAL_P001[dof]


def test_a_draft_row_lists_the_likeliest_tokens_and_draws_from_itself() -> None:
    q = torch.tensor([0.05, 0.4, 0.0, 0.3, 0.15, 0.1])
    row = draft_row(q, 3)
    assert row.ids.tolist() == [1, 3, 4] and abs(row.remainder - 0.15) < 1e-6 and row.vocab == 6
    assert abs(row.prob(0) - 0.05) < 1e-6 and abs(row.prob(2) - 0.05) < 1e-6  # the remainder spreads evenly
    assert draft_row(q, 6).remainder == 0.0 and draft_row(q, 6).ids.numel() == 5  # every token with mass listed
    gen = torch.Generator().manual_seed(1)
    draws = [draw(row, gen) for _ in range(6000)]
    assert all(unlisted == (token not in (1, 3, 4)) for token, unlisted in draws)
    expected = torch.tensor([row.prob(t) for t in range(6)])
    stat, dof = chi_square([t for t, _ in draws], expected)
    assert stat < CHI2_CRITICAL_P001[dof], f"draws deviate from the row: chi2={stat:.1f}"


def test_racing_verification_matches_target_distribution() -> None:
    """Without q (a seeded request's draft, n-gram proposals) verification races: drafts drawn
    from a q far from p still leave the decided tokens distributed as p."""
    first, second, p = _speculative_samples(6000, send_q=False)
    stat, dof = chi_square(first, p[0])
    assert stat < CHI2_CRITICAL_P001[dof], f"first token deviates from p: chi2={stat:.1f}"
    stat, dof = chi_square(second, p[1])
    assert len(second) > 500 and stat < CHI2_CRITICAL_P001[dof], f"second token deviates: chi2={stat:.1f}"


def test_verification_draws_exactly_what_plain_decoding_draws() -> None:
    """Racing (no q), a seeded token depends only on the target's logits at its position: whatever
    the drafts (right, wrong, from any q), verification returns the longest prefix of drafts equal to plain
    decoding's draws, then plain decoding's draw."""
    gen = torch.Generator().manual_seed(5)
    for seed in range(200):
        params = SamplingParams(temperature=0.9, top_k=20, seed=seed)
        logits = torch.randn(5, 40, generator=gen) * 2
        plain = [next_token(logits[i], params, 11 + i) for i in range(5)]
        for cut in range(5):
            wrong = (plain[cut] + 1 + int(torch.randint(39, (1,), generator=gen))) % 40
            drafts = (plain[:cut] + [wrong] + plain[cut + 1:])[:4]
            accepted, tokens = verify(logits, drafts, params, 10)  # no q: the race
            assert (accepted, tokens) == (min(cut, 4), plain[: min(cut, 4) + 1])


def test_a_speculative_decode_is_the_plain_decode_whatever_the_windows() -> None:
    """Through a toy model (logits a function of the context), sampled decoding gives the same
    tokens plainly and speculatively, with drafts from another distribution and window sizes
    that change from step to step: what made a seeded request depend on its schedule (issue 33)."""
    vocab, table = 30, torch.randn(30, 30, generator=torch.Generator().manual_seed(9)) * 2.5
    draft_table = table + torch.randn(30, 30, generator=torch.Generator().manual_seed(10))  # a near draft
    params = SamplingParams(temperature=1.0, seed=77)

    def logits_after(context: list[int]) -> torch.Tensor:
        return table[context[-1]] + 0.1 * len(context) * torch.linspace(-1, 1, vocab)

    plain = [4]
    while len(plain) < 40:
        plain.append(next_token(logits_after(plain), params, len(plain)))
    for schedule in ([1], [3, 1, 4], [8, 2], [5]):
        out, step, accepted_total = [4], 0, 0
        while len(out) < 40:
            k = schedule[step % len(schedule)]
            step += 1
            drafts: list[int] = []
            for _ in range(k):  # the draft races over its own q with the target's noise
                q = probabilities((draft_table[(out + drafts)[-1]])[None], params)[0]
                drafts.append(sampling.sample(q, params.seed, len(out) + len(drafts)))
            rows = torch.stack([logits_after(out + drafts[:i]) for i in range(k + 1)])
            accepted, tokens = verify(rows, drafts, params, len(out) - 1)
            accepted_total += accepted
            out += tokens
        assert out[:40] == plain, schedule
        assert accepted_total > 0  # the coupled draft does get accepted


def test_point_mass_proposals_keep_the_distribution() -> None:
    """N-gram proposals have q = 1 on the proposed token: accept with p(x), else p without x."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, generator=gen)
    p = probabilities(logits, SamplingParams(temperature=1.0))
    firsts = [verify(logits, [2], SamplingParams(temperature=1.0, seed=s), 0)[1][0] for s in range(6000)]
    stat, dof = chi_square(firsts, p[0])
    assert stat < CHI2_CRITICAL_P001[dof]


def test_a_top_p_below_float32_range_keeps_the_most_likely_token() -> None:
    """Found by the frontend fuzzer: top_p=2.2e-313 rounds to 0.0 in float32, and every token
    was dropped (a NaN distribution, a 500)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    probs = probabilities(logits, SamplingParams(temperature=1.0, top_p=2.2250738585e-313, top_k=0, seed=1))
    assert torch.equal(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


# --- the logits transforms (vLLM's extra sampling parameters) ---------------------------------

PENALISED = SamplingParams(temperature=1.0, presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.6,
                           logit_bias=((4, 1.5),), prompt_tokens=3)


def test_repetition_penalty_is_transformers_processor() -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(1)) * 3
    context = [2, 5, 5, 9, 2, 17]
    expected = RepetitionPenaltyLogitsProcessor(1.6)(torch.tensor([context]), logits.clone())
    assert torch.allclose(adjust(logits, SamplingParams(repetition_penalty=1.6), context), expected)


def test_presence_and_frequency_count_generated_tokens_only() -> None:
    logits = torch.zeros(1, 8)
    context = [3, 3, 5, 5, 5, 6]  # prompt [3, 3, 5]; generated [5, 5, 6]
    out = adjust(logits, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, prompt_tokens=3), context)[0]
    assert out.tolist() == [0, 0, 0, 0, 0, -(0.5 + 2 * 0.25), -(0.5 + 0.25), 0]


def test_min_tokens_masks_stop_tokens_until_reached() -> None:
    params = SamplingParams(min_tokens=2, stop_token_ids=(0,), prompt_tokens=4)
    logits = torch.zeros(3, 4)  # a window whose rows predict generated tokens 1, 2 and 3
    out = adjust(logits, params, [7, 7, 7, 7, 1, 2])
    assert out[:, 0].tolist() == [float("-inf"), float("-inf"), 0.0]


def test_a_window_is_adjusted_as_if_decoded_token_by_token() -> None:
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(2))
    context = [1, 2, 3, 4, 4, 7, 4, 9]  # ..., then the window [4, 7, 4, 9]: rows follow 4, 7, 4, 9
    window = adjust(logits, PENALISED, context)
    for row in range(4):
        alone = adjust(logits[row : row + 1], PENALISED, context[: len(context) - 3 + row])
        assert torch.equal(window[row], alone[0])


def test_speculative_sampling_matches_the_penalised_distribution() -> None:
    """Verification draws from the transformed target distribution, row by row."""
    gen = torch.Generator().manual_seed(11)
    vocab, context = 6, [1, 4, 2, 4, 4]  # prompt [1, 4, 2]; generated 4 4; the window [4, d1, d2]
    target_logits = torch.randn(3, vocab, generator=gen)
    q = torch.softmax(torch.randn(2, vocab, generator=gen) * 1.5, -1)
    p_first = probabilities(adjust(target_logits[:1], PENALISED, context), PENALISED)[0]
    often = int(torch.minimum(p_first, q[0]).argmax())  # a first draft often proposed and accepted
    firsts, seconds = [], []
    for seed in range(6000):
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        params = SamplingParams(**{**PENALISED.__dict__, "seed": seed})
        _, tokens = verify(target_logits, drafts, params, 4, whole(q), context + drafts)
        firsts.append(tokens[0])
        if len(tokens) > 1 and tokens[0] == drafts[0] == often:
            seconds.append(tokens[1])
    assert not torch.allclose(p_first, probabilities(target_logits[:1], PENALISED)[0], atol=0.02)  # transforms bite
    stat, dof = chi_square(firsts, p_first)
    assert stat < CHI2_CRITICAL_P001[dof], f"first token deviates from the penalised p: chi2={stat:.1f}"
    p_second = probabilities(adjust(target_logits[1:2], PENALISED, context + [often]), PENALISED)[0]
    stat, dof = chi_square(seconds, p_second)
    assert len(seconds) > 300 and stat < CHI2_CRITICAL_P001[dof], f"second token: chi2={stat:.1f}"


@pytest.mark.parametrize(("field", "params"), [
    ("repetition_penalty", SamplingParams(1.0, repetition_penalty=5e-324)),
    ("temperature", SamplingParams(float("nan"))),
    ("top_p", SamplingParams(1.0, top_p=float("inf"))),
    ("presence_penalty", SamplingParams(1.0, presence_penalty=float("-inf"))),
    ("top_k", SamplingParams(1.0, top_k=2**31)),
    ("seed", SamplingParams(1.0, seed=-1)),
    ("logit_bias", SamplingParams(1.0, logit_bias=((2**31 - 1, 1.0),))),
    ("logit_bias", SamplingParams(1.0, logit_bias=((3, float("nan")),))),
    ("stop_token_ids", SamplingParams(1.0, stop_token_ids=(-1,))),
])
def test_unsafe_field_names_what_the_wire_or_kernels_cannot_carry(field, params) -> None:
    from inferencemesh.sampling import unsafe_field

    found = unsafe_field(params, vocab_size=1000)
    assert found is not None and found[0] == field


def test_ordinary_parameters_are_safe() -> None:
    from inferencemesh.sampling import unsafe_field

    assert unsafe_field(SamplingParams(0.7, 0.9, 40, 2**63, 0.5, 0.5, 1.2, ((5, -100.0),), 3, (2,), 4), 1000) is None
    assert unsafe_field(SamplingParams(repetition_penalty=0.0)) is None  # 0: off, as on the wire
