"""Sampling and speculative verification: pure functions over logits.

The last stage samples here and the frontend's draft model proposes here, so both sides
warp logits identically. Randomness is a pure function of (seed, position, purpose): a
token sampled at position p with seed s is the same whether the pipeline has one stage
or four, and a replayed step after a stage restart draws the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK63 = (1 << 63) - 1
GREEDY_BELOW = 1e-5  # a smaller temperature would overflow the logits: it means greedy
_SALT_SAMPLE, _SALT_ACCEPT, _SALT_RESAMPLE = 0x5A17, 0xACCE, 0x4E5A


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # below GREEDY_BELOW: greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


GREEDY = SamplingParams()


def generator_for(seed: int, position: int, salt: int) -> torch.Generator:
    mixed = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + salt * 0x94D049BB133111EB) & _MASK63
    return torch.Generator().manual_seed(mixed)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Softmax of temperature-scaled logits restricted to top-k and top-p; rows of [R, V]."""
    scores = logits.float() / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if 0.0 < params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        # drop a token once the mass before it already reaches top_p (the first always stays)
        drop_sorted = (cumulative - sorted_scores.softmax(-1)) >= params.top_p
        drop_sorted[..., 0] = False  # explicitly: a top_p below float32's range compares as 0 >= 0
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(-1)


def sample(probs: torch.Tensor, seed: int, position: int) -> int:
    """One token from a [V] distribution, reproducible from (seed, position)."""
    return int(torch.multinomial(probs, 1, generator=generator_for(seed, position, _SALT_SAMPLE)))


def next_token(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The token at `position` from its [V] logits: argmax when greedy, else a seeded sample."""
    if params.greedy:
        return int(logits.argmax())
    return sample(probabilities(logits.unsqueeze(0), params)[0], params.seed, position)


def accept(p_token: float, q_token: float, u: float) -> bool:
    """Speculative sampling's acceptance rule: keep a draft token with probability min(1, p/q)."""
    return q_token > 0 and u < min(1.0, p_token / q_token)


def verify(
    logits: torch.Tensor,
    draft_tokens: list[int],
    params: SamplingParams,
    pos_start: int,
    draft_probs: torch.Tensor | None = None,
) -> tuple[int, list[int]]:
    """Verify a speculative window at the target.

    logits: [k+1, V], row i predicts the token after window position i, where the window is
    [last accepted token, d_1 .. d_k] starting at pos_start. Returns (accepted, tokens):
    the accepted draft tokens followed by one token of the target's own.

    Greedy: accept the longest prefix equal to the target's argmax. Sampling: speculative
    sampling (Leviathan et al.): accept d_i with probability min(1, p(d_i)/q(d_i)); on
    rejection draw from normalize(max(p - q, 0)); when all pass, a bonus token from p.
    draft_probs [k, V] is q; None means every proposal had q = 1 (n-gram lookup).
    """
    k = len(draft_tokens)
    if params.greedy:
        target = logits.argmax(-1).tolist()
        accepted = 0
        while accepted < k and draft_tokens[accepted] == target[accepted]:
            accepted += 1
        return accepted, draft_tokens[:accepted] + [target[accepted]]

    p = probabilities(logits, params)
    for i, token in enumerate(draft_tokens):
        position = pos_start + 1 + i  # the position this draft token would occupy
        q_token = 1.0 if draft_probs is None else float(draft_probs[i, token])
        p_token = float(p[i, token])
        u = float(torch.rand(1, generator=generator_for(params.seed, position, _SALT_ACCEPT)))
        if accept(p_token, q_token, u):
            continue
        if draft_probs is None:
            residual = p[i].clone()
            residual[token] = 0.0
        else:
            residual = (p[i] - draft_probs[i]).clamp_min(0.0)
        total = float(residual.sum())
        if total <= 0.0:  # p == q up to rounding: any draw from p is exact
            residual, total = p[i], 1.0
        gen = generator_for(params.seed, position, _SALT_RESAMPLE)
        return i, draft_tokens[:i] + [int(torch.multinomial(residual / total, 1, generator=gen))]
    return k, draft_tokens + [sample(p[k], params.seed, pos_start + 1 + k)]
