"""Sampling and speculative verification: pure functions over logits.

The last stage samples here and the frontend's draft model proposes here, so both sides
warp logits identically. The logits transforms of vLLM's extra sampling parameters (logit
bias, min_tokens, presence / frequency / repetition penalties) live in `adjust`, which plain
decoding, both forms of verification and the draft all call.

Randomness is a pure function of (seed, position, purpose). A sampled token is the exponential
race (the Gumbel-max trick) argmax_v p(v) / E_v over noise E ~ Exp(1)^V drawn from a generator
keyed by (seed, position): an exact draw from p. A VERIFY window is decided one of two ways:

- without the draft's distributions (n-gram proposals, and a draft model proposing for a greedy
  or seeded request): by the same race. A draft token is accepted exactly when it is the token
  the target's race picks there, and the first one that is not is replaced by that pick, so a
  token depends only on the target's logits at its position and (seed, position): not on the
  draft, its window, whether the step decoded or verified, nor how many stages computed it
  (drafter-invariant speculative sampling; a draft model runs the same race over its own q, so it
  proposes what the target will pick wherever p and q agree enough). For a point-mass proposal
  the acceptance is p(d), as Leviathan's rule gives.
- with them (q, a draft model proposing for an unseeded sampled request, whose output nobody
  can ask to see again): Leviathan's speculative sampling, accept d with min(1, p(d)/q(d)), else
  draw from max(p - q, 0). Just as exact in distribution, and it accepts more (0.49 of draft
  tokens against the race's 0.46 on the bundled models at temperature 0.8), but a token's draw
  depends on whether a draft stood at its position and on q: the same seed gives other tokens
  whenever the window schedule differs, which is why seeded requests race. The q the draft sends
  and draws from is sparse (DraftRow: its most likely tokens and an even remainder), so a window
  costs kilobytes a hop, not 4 x vocab bytes a draft; the rule is exact for it as for any q.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inferencemesh.protocol.transport import MAX_DRAFT_TOKENS, MAX_LOGIT_BIAS_ENTRIES

_MASK63 = (1 << 63) - 1
GREEDY_BELOW = 1e-5  # a smaller temperature would overflow the logits: it means greedy
_SALT_SAMPLE, _SALT_ACCEPT, _SALT_RESAMPLE = 0x5A17, 0xACCE, 0x4E5A
# A draft's row lists fewer than MAX_DRAFT_TOKENS tokens when they hold all its mass but this much.
DRAFT_TAIL_MASS = 1e-4


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # below GREEDY_BELOW: greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    # vLLM's semantics: presence / frequency count the generated tokens (positions from
    # prompt_tokens on), repetition the prompt's too; bias and min_tokens come first.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off; > 1 discourages tokens already seen
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # stop_token_ids are masked until this many tokens were generated
    stop_token_ids: tuple[int, ...] = ()
    prompt_tokens: int = 0  # where the generated tokens start

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty not in (0.0, 1.0)

    @property
    def adjusts(self) -> bool:
        """Whether any logits transform is on (else `adjust` returns the logits as they are)."""
        return self.penalised or bool(self.logit_bias) or (self.min_tokens > 0 and bool(self.stop_token_ids))


GREEDY = SamplingParams()

# What the wire (stage.proto's Sampling) and the kernels can carry: the one table the engine checks
# before admitting a request and every stage checks for every frame it receives. Wider than the
# OpenAI API's ranges (the HTTP layer checks those), narrow enough that no value makes a transform
# meet inf or NaN (a repetition penalty of 5e-324 divides logits into infinity) or an index fall
# outside the vocabulary. A temperature under GREEDY_BELOW means greedy and divides nothing.
BOUNDS = {"temperature": (0.0, 100.0), "top_p": (0.0, 1.0), "presence_penalty": (-100.0, 100.0),
          "frequency_penalty": (-100.0, 100.0), "repetition_penalty": (0.0, 100.0)}
MAX_LOGIT_BIAS = 1e4
# Bounded away from the denormals (0 itself means off). The one floor the API, the engine and every
# stage apply: 2^-20 (about 9.5e-7) is exact in float32, the wire's type, so a request at the floor
# is the same number on both sides of it (1e-6 arrived as 9.99999997e-07 and a stage refused it).
MIN_REPETITION_PENALTY = 2.0**-20
INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1


def unsafe_field(params: SamplingParams, vocab_size: int | None = None) -> tuple[str, str] | None:
    """(field, why) for the first parameter the wire or the kernels cannot carry, else None.
    vocab_size bounds token ids when it is known (else int32)."""
    for name, (low, high) in BOUNDS.items():
        value = getattr(params, name)
        if not math.isfinite(value) or not low <= value <= high:
            return name, f"{name} must be a finite number within [{low:g}, {high:g}], got {value!r}"
    if params.repetition_penalty != 0.0 and params.repetition_penalty < MIN_REPETITION_PENALTY:
        return "repetition_penalty", (f"repetition_penalty must be at least {MIN_REPETITION_PENALTY:g} "
                                      f"(or 0: off), got {params.repetition_penalty!r}")
    if not 0 <= params.top_k <= INT32_MAX:
        return "top_k", f"top_k must be within [0, 2^31) (0: off), got {params.top_k}"
    if not 0 <= params.seed <= 2**64 - 1:
        return "seed", f"seed must be within [0, 2^64), got {params.seed}"
    if not 0 <= params.min_tokens <= UINT32_MAX:
        return "min_tokens", f"min_tokens must be within [0, 2^32), got {params.min_tokens}"
    ids_below = vocab_size if vocab_size is not None else INT32_MAX + 1
    if len(params.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        return "logit_bias", f"logit_bias has {len(params.logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}"
    for token, bias in params.logit_bias:
        if not 0 <= token < ids_below:
            return "logit_bias", f"logit_bias token id {token} is outside [0, {ids_below})"
        if not math.isfinite(bias) or abs(bias) > MAX_LOGIT_BIAS:
            return "logit_bias", (f"logit_bias for token {token} must be finite, of magnitude at most "
                                  f"{MAX_LOGIT_BIAS:g}, got {bias!r}")
    bad_stop = next((t for t in params.stop_token_ids if not 0 <= t < ids_below), None)
    if bad_stop is not None:
        return "stop_token_ids", f"stop token id {bad_stop} is outside [0, {ids_below})"
    return None


def generator_for(seed: int, position: int, salt: int) -> torch.Generator:
    mixed = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + salt * 0x94D049BB133111EB) & _MASK63
    return torch.Generator().manual_seed(mixed)


def adjust(logits: torch.Tensor, params: SamplingParams, context: Sequence[int]) -> torch.Tensor:
    """vLLM's logits transforms in vLLM's order: logit_bias, min_tokens, then the penalties.

    logits [R, V]; context: the session's tokens by position, up to the one row R-1 follows.
    Row r predicts position len(context) - R + 1 + r from the tokens before it: one row
    follows the whole context; the rows of a VERIFY window follow each draft in turn (a
    penalty depends on the drafts accepted before it, exactly as if they had been decoded).
    """
    if not params.adjusts:
        return logits
    rows, vocab = logits.shape
    out = logits.float().clone()
    device = out.device
    first = len(context) - rows + 1  # the position row 0 predicts
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=device)
        out[:, ids] += torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32, device=device)
    if params.min_tokens and params.stop_token_ids:
        stops = torch.tensor(params.stop_token_ids, dtype=torch.long, device=device)
        for r in range(rows):
            if first + r - params.prompt_tokens < params.min_tokens:
                out[r, stops] = float("-inf")
    if not params.penalised:
        return out
    tokens = torch.tensor(list(context[:first]), dtype=torch.long, device=device)
    seen = torch.bincount(tokens, minlength=vocab)[:vocab] > 0  # prompt and output: repetition
    generated = torch.bincount(tokens[params.prompt_tokens:], minlength=vocab)[:vocab].float()  # output only
    for r in range(rows):
        if r:  # the window's token before this row joins the history
            token = context[first + r - 1]
            seen[token] = True
            if first + r - 1 >= params.prompt_tokens:
                generated[token] += 1
        row = out[r]
        if params.repetition_penalty not in (0.0, 1.0):
            penalty = torch.where(seen, params.repetition_penalty, 1.0)
            row = torch.where(row > 0, row / penalty, row * penalty)
        out[r] = row - params.frequency_penalty * generated - params.presence_penalty * (generated > 0).float()
    return out


def logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[tuple[int, float, list[int], list[float]]]:
    """Per row of raw logits [R, V]: (token, its logprob, top-`top` tokens, their logprobs).

    The log-softmax of the model's own output, before any transform (vLLM's default
    "raw logprobs"): what the model thinks, whatever sampling then did with it."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(list(tokens), dtype=torch.long, device=lp.device)[:, None])[:, 0].tolist()
    if top > 0:
        best = lp.topk(min(top, lp.shape[-1]), dim=-1)
        best_ids, best_lps = best.indices.tolist(), best.values.tolist()
    else:
        best_ids = best_lps = [[] for _ in tokens]
    return list(zip(tokens, chosen, best_ids, best_lps, strict=True))


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


def race_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """The exponential race's noise at `position`: E ~ Exp(1)^vocab, float32 on the CPU, the same
    numbers wherever the logits live (a CPU generator, read serially: a prefix of a longer draw is
    the shorter draw, so a draft with a smaller padded vocabulary races the target's first ids)."""
    u = torch.rand(vocab, generator=generator_for(seed, position, _SALT_SAMPLE))
    # -log(1 - u) for u in [0, 1): E >= 0; a zero (u == 0) would make 0 / 0 of a token without mass.
    return torch.neg(torch.log1p(-u)).clamp_min_(torch.finfo(torch.float32).tiny)


def sample(probs: torch.Tensor, seed: int, position: int) -> int:
    """One token from a [V] distribution, a function of (probs, seed, position) alone: the
    exponential race argmax p(v) / E_v, an exact draw from probs (the Gumbel-max trick)."""
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0.0:
        raise RuntimeError("sampling needs a distribution: finite, non-negative, with mass")
    noise = race_noise(seed, position, probs.shape[-1]).to(probs.device)
    return int((probs.float() / noise).argmax())


@dataclass(frozen=True, eq=False)
class DraftRow:
    """The distribution a draft token was drawn from, as the wire carries it (Frame.draft_q): probs on
    the listed ids (distinct) and the remainder spread evenly over the vocabulary's other tokens.

    Leviathan's rule is exact for any proposal distribution that the draft really drew from and the
    verifier really uses, so the draft draws from this one (`draft_row`, `draw`), not from its whole q:
    the output stays the target's p, and the acceptance drops by at most the mass q and this row
    place differently (the 1024 most likely tokens keep it within 0.2 points on the bundled models)."""

    ids: torch.Tensor  # int64 [n], CPU
    probs: torch.Tensor  # float32 [n], CPU
    remainder: float
    vocab: int

    @property
    def spread(self) -> float:
        """The probability of each token the row does not list."""
        unlisted = self.vocab - self.ids.numel()
        return self.remainder / unlisted if unlisted else 0.0

    def prob(self, token: int) -> float:
        hit = (self.ids == token).nonzero()
        return float(self.probs[hit[0, 0]]) if hit.numel() else self.spread

    def residual(self, p: torch.Tensor) -> torch.Tensor:
        """max(p - q, 0) over p's [vocab] row (on p's device)."""
        out = p.float() - self.spread
        ids = self.ids.to(p.device)
        out[ids] = p[ids].float() - self.probs.to(p.device)
        return out.clamp_min_(0.0)


def draft_row(q: torch.Tensor, max_tokens: int = MAX_DRAFT_TOKENS) -> DraftRow:
    """The row a draft sends for its [V] distribution q: its most likely tokens, up to max_tokens and
    no more than hold all the mass but DRAFT_TAIL_MASS, and the rest of the mass as the remainder (0
    when every token with mass is listed: top-k, top-p, a grammar's mask)."""
    q = q.float()
    total = float(q.sum())  # NaN or inf wherever an entry is (finite entries of a softmax sum to about 1)
    if not math.isfinite(total) or not total > 0.0 or float(q.min()) < 0.0:
        raise RuntimeError("a draft row needs a distribution: finite, non-negative, with mass")
    support = int(torch.count_nonzero(q))
    top = torch.topk(q, min(max_tokens, support))
    kept = min(top.values.numel(), int((top.values.cumsum(0) < (1.0 - DRAFT_TAIL_MASS) * total).sum()) + 1)
    probs, ids = top.values[:kept] / total, top.indices[:kept]
    # float32, as the wire carries it: the draft draws with the very number the verifier reads
    remainder = float(torch.tensor(max(0.0, 1.0 - float(probs.sum())))) if kept < support else 0.0
    return DraftRow(ids.cpu(), probs.cpu(), remainder, q.shape[-1])


def draw(row: DraftRow, generator: torch.Generator) -> tuple[int, bool]:
    """A token drawn from the row's distribution, and whether it came from the remainder."""
    weights = torch.cat([row.probs, torch.tensor([row.remainder])])
    pick = int(torch.multinomial(weights, 1, generator=generator))
    if pick < row.ids.numel():
        return int(row.ids[pick]), False
    # The r-th unlisted id: r plus the listed ids at or below it (before listed id j lie s_j - j unlisted).
    r = int(torch.randint(row.vocab - row.ids.numel(), (1,), generator=generator))
    listed = row.ids.sort().values
    return r + int((listed - torch.arange(listed.numel()) <= r).sum()), True


def next_token(logits: torch.Tensor, params: SamplingParams, position: int, context: Sequence[int] = ()) -> int:
    """The token at `position` from its [V] logits: argmax when greedy, else a seeded sample.
    context: the tokens before `position` (what the transforms of `adjust` look at)."""
    logits = adjust(logits[None], params, context)[0]
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
    draft_q: Sequence[DraftRow] | None = None,
    context: Sequence[int] = (),
) -> tuple[int, list[int]]:
    """Verify a speculative window at the target.

    logits: [k+1, V], row i predicts the token after window position i, where the window is
    [last accepted token, d_1 .. d_k] starting at pos_start. Returns (accepted, tokens):
    the accepted draft tokens followed by one token of the target's own.

    Greedy: accept the longest prefix equal to the target's argmax. Sampling without draft_q:
    accept the longest prefix equal to the target's own seeded draws (`sample` at each position),
    then that draw: every token is what plain decoding draws there with the same seed. Sampling
    with draft_q (a DraftRow per draft: the q each was drawn from): Leviathan's rule, accept d_i with probability
    min(1, p(d_i)/q(d_i)), on rejection draw from normalize(max(p - q, 0)), when all pass a bonus
    token from p. See the module docstring for why both.
    context: the tokens by position through the window's last draft (see `adjust`).
    """
    logits = adjust(logits, params, context)
    k = len(draft_tokens)
    if params.greedy:
        target = logits.argmax(-1).tolist()
        accepted = 0
        while accepted < k and draft_tokens[accepted] == target[accepted]:
            accepted += 1
        return accepted, draft_tokens[:accepted] + [target[accepted]]

    p = probabilities(logits[: k + 1], params)
    if draft_q is None:
        return _race(p, draft_tokens, params.seed, pos_start)
    for i, token in enumerate(draft_tokens):
        position = pos_start + 1 + i  # the position this draft token would occupy
        q_token = draft_q[i].prob(token)
        p_token = float(p[i, token])
        u = float(torch.rand(1, generator=generator_for(params.seed, position, _SALT_ACCEPT)))
        if accept(p_token, q_token, u):
            continue
        residual = draft_q[i].residual(p[i])
        total = float(residual.sum())
        if total <= 0.0:  # p == q up to rounding: any draw from p is exact
            residual, total = p[i], 1.0
        gen = generator_for(params.seed, position, _SALT_RESAMPLE)
        # The seeded generator is a CPU one (the same draw wherever the logits live): so is the row.
        return i, draft_tokens[:i] + [int(torch.multinomial((residual / total).cpu(), 1, generator=gen))]
    return k, draft_tokens + [sample(p[k], params.seed, pos_start + 1 + k)]


def _race(p: torch.Tensor, draft_tokens: list[int], seed: int, pos_start: int) -> tuple[int, list[int]]:
    """verify() without q: the drafts that equal the target's own draws, then its draw."""
    accepted = 0
    while True:
        token = sample(p[accepted], seed, pos_start + 1 + accepted)  # the position row `accepted` decides
        if accepted == len(draft_tokens) or draft_tokens[accepted] != token:
            return accepted, draft_tokens[:accepted] + [token]
        accepted += 1
