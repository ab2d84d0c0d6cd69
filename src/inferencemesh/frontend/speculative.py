"""Speculative decoding strategies. The frontend proposes; the last stage verifies.

- draft: a small model with the target's tokenizer runs here and proposes k tokens.
- ngram: prompt lookup, the continuation of the latest earlier match of the suffix.
- auto: n-gram, but only where it pays (seed 003): on at once for favourable prompt shapes
  (code fences, diffs, tracebacks, logs, JSON, SQL, paths), or after repeated-suffix hits
  seen during a cold observation phase; off with a cooldown after poor acceptance.
- none.

Which one runs is decided by inferencemesh.speculation (shared with the operator); this module
builds what that decision names: the proposers, and the draft model a draft strategy loads.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from inferencemesh.checkpoint import fetch_config_dir
from inferencemesh.config import SpeculativeOptions
from inferencemesh.frontend.draft import DraftCache, DraftModel
from inferencemesh.frontend.engine_api import GenerationRequest
from inferencemesh.frontend.ngram import ngram_lookup
from inferencemesh.sampling import SamplingParams, adjust, generator_for, probabilities
from inferencemesh.speculation import SpeculativeChoice, WindowPolicy, choose_for_model

log = logging.getLogger("inferencemesh.speculative")

_SALT_DRAFT = 0xD4AF7


# ---- the interface the engine drives ------------------------------------------------------------


@dataclass
class Proposal:
    tokens: list[int]
    probs: bytes = b""  # f32 [k, vocab] draft distributions (sampling with a draft model), else empty


class Proposer:
    """Speculation strategy for one request: propose tokens, learn from what was accepted."""

    def propose(self, history: list[int]) -> Proposal | None:
        return None

    async def propose_async(self, history: list[int]) -> Proposal | None:
        """What the engine calls: a strategy may compute together with other requests' (a draft model)."""
        return self.propose(history)

    def observe(self, proposed: int, accepted: int, propose_s: float, round_trip_s: float) -> None:
        """What a step did: tokens proposed and accepted, seconds spent proposing and in the round trip."""

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
    """

    def __init__(self, policy: WindowPolicy) -> None:
        self.policy = policy
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
        if self.spec_token_s > self.plain_cost_s or accepted < proposed // 2:
            self.k = max(self.policy.minimum, self.k - 1)  # costs more than it saves, or rejected early
        elif accepted == proposed:
            self.k = min(self.policy.maximum, self.k + 1)

    @property
    def plain_cost_s(self) -> float:
        return self.plain_step_s if self.plain_step_s is not None else self.verify_s

    @property
    def paying(self) -> bool:
        """False once speculation measurably costs more per token than plain decoding."""
        return self.spec_token_s is None or self.spec_token_s <= self.plain_cost_s * 1.05


def _ema(current: float | None, sample: float, weight: float) -> float:
    return sample if current is None else (1 - weight) * current + weight * sample


# ---- n-gram (prompt lookup) ------------------------------------------------------------------


class WindowedProposer(Proposer):
    """A proposer with a live window, reporting every verify round to the metrics."""

    def __init__(self, policy: WindowPolicy, metrics=None) -> None:
        self.window = Window(policy)
        self.metrics = metrics

    def observe(self, proposed: int, accepted: int, propose_s: float, round_trip_s: float) -> None:
        if proposed == 0:
            self.window.observe_plain(round_trip_s)
            return
        self.window.observe(proposed, accepted, propose_s, round_trip_s)
        if self.metrics is not None:
            self.metrics.record_verify_round(proposed, accepted)
            self.metrics.set_window_size(self.window.k)


class NgramProposer(WindowedProposer):
    def __init__(self, policy: WindowPolicy, metrics=None, min_ngram: int = 2, max_ngram: int = 4) -> None:
        super().__init__(policy, metrics)
        self.min_ngram, self.max_ngram = min_ngram, max_ngram

    def propose(self, history: list[int]) -> Proposal | None:
        tokens = ngram_lookup(history, self.window.k, self.min_ngram, self.max_ngram)
        return Proposal(tokens) if tokens else None


# ---- auto ------------------------------------------------------------------------------------

FAVOURABLE_SHAPES = [
    re.compile(p, re.MULTILINE)
    for p in (
        r"```",  # code fences
        r"^(diff --git|@@ .* @@|--- a/|\+\+\+ b/)",  # diffs
        r"Traceback \(most recent call last\)",  # Python tracebacks
        r"^\s*(ERROR|WARN(ING)?|FATAL|Exception|Error)\b.*",  # error logs
        r"^\s*[\[{]\s*\"",  # JSON
        r"\b(SELECT|INSERT INTO|UPDATE|DELETE FROM|CREATE TABLE)\b",  # SQL
        r"(/[\w.-]+){2,}\.\w+|\b\w:\\",  # file paths
        r"^\s*(def|class|import|from|return|if|for|while)\b",  # source code
    )
]


def favourable_prompt(text: str) -> bool:
    return any(p.search(text) for p in FAVOURABLE_SHAPES)


class AutoProposer(NgramProposer):
    """N-gram speculation that switches itself on only where it pays, and off where it does not."""

    OBSERVE_STEPS = 24  # cold phase: look for repeated suffixes without proposing
    HITS_TO_ENABLE = 2
    POOR_ACCEPTANCE = 0.25  # accepted / proposed over the recent rounds
    RECENT_ROUNDS = 6
    COOLDOWN_STEPS = 32

    def __init__(self, policy: WindowPolicy, favourable: bool, metrics=None) -> None:
        super().__init__(policy, metrics)
        self.state = "active" if favourable else "observing"
        self.steps_in_state = 0
        self.hits = 0
        self.recent: list[tuple[int, int]] = []
        self._pending_guess: list[int] = []
        self._set_state(self.state)

    def _set_state(self, state: str) -> None:
        self.state, self.steps_in_state = state, 0
        if state == "active":
            self.recent.clear()
        if self.metrics is not None:
            self.metrics.set_auto_state(state)

    def propose(self, history: list[int]) -> Proposal | None:
        self.steps_in_state += 1
        if self.state == "observing":
            if self._pending_guess and history[-1] == self._pending_guess[0]:
                self.hits += 1  # the suffix's continuation came true: the text repeats itself
            self._pending_guess = ngram_lookup(history, 1, self.min_ngram, self.max_ngram)
            if self.hits >= self.HITS_TO_ENABLE:
                self._set_state("active")
            elif self.steps_in_state >= self.OBSERVE_STEPS * 4:
                self.hits = 0
                self.steps_in_state = 0
            return None if self.state != "active" else super().propose(history)
        if self.state == "cooldown":
            if self.steps_in_state >= self.COOLDOWN_STEPS:
                self.hits = 0
                self._set_state("observing")
            return None
        return super().propose(history)

    def observe(self, proposed: int, accepted: int, propose_s: float, round_trip_s: float) -> None:
        super().observe(proposed, accepted, propose_s, round_trip_s)
        if proposed == 0 or self.state != "active":
            return
        self.recent = (self.recent + [(proposed, accepted)])[-self.RECENT_ROUNDS :]
        if len(self.recent) == self.RECENT_ROUNDS:
            rate = sum(a for _, a in self.recent) / sum(p for p, _ in self.recent)
            if rate < self.POOR_ACCEPTANCE or not self.window.paying:
                self._set_state("cooldown")


# ---- draft model -----------------------------------------------------------------------------


class DraftProposer(WindowedProposer):
    """Propose k tokens with the draft model. Its cache rolls back like the stages': the next
    call truncates to the longest prefix the draft has seen that the history still agrees with.
    Catching up on accepted tokens computes logits for the last row only (dead rows skipped).
    With a DraftBatcher, proposals of concurrent requests share the draft's forward passes."""

    def __init__(self, draft: DraftModel, policy: WindowPolicy, params: SamplingParams, metrics=None,
                 batcher: DraftBatcher | None = None) -> None:
        super().__init__(policy, metrics)
        self.draft = draft
        self.params = params
        self.batcher = batcher
        self.cache = draft.new_cache()
        self.fed: list[int] = []  # tokens whose KV the draft holds, by position
        self._k = 0
        self._first_position = 0
        self._tokens: list[int] = []
        self._rows: list[torch.Tensor] = []

    def propose(self, history: list[int]) -> Proposal | None:
        outcome = draft_together([(self, history)])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def propose_async(self, history: list[int]) -> Proposal | None:
        if self.batcher is None:
            return self.propose(history)
        return await self.batcher.propose(self, history)

    # The steps draft_together() drives, for one request among several.

    def _begin(self, history: list[int]) -> tuple[DraftCache, int, list[int]] | None:
        """The catch-up feed (what the draft has not seen of the history), or None: no room."""
        self._k = min(self.window.k, self.draft.max_context - len(history) - 1)
        if self._k < 1:
            return None
        agree = 0
        for a, b in zip(self.fed, history, strict=False):
            if a != b:
                break
            agree += 1
        agree = min(agree, len(history) - 1)  # always feed at least the last token
        self.fed = history[:]
        self._first_position, self._tokens, self._rows = len(history), [], []
        return self.cache, agree, history[agree:]

    def _next(self, logits: torch.Tensor) -> tuple[DraftCache, int, list[int]] | None:
        """Draw the next draft token from `logits`; the feed for the one after, or None when done."""
        position = self._first_position + len(self._tokens)
        # The target's transforms (penalties, bias, min_tokens) on the draft too: its proposals
        # then follow what the target will accept; q stays the distribution actually drawn from.
        logits = adjust(logits[None], self.params, self.fed)[0]
        if self.params.greedy:
            token = int(logits.argmax())
        else:
            q = probabilities(logits[None], self.params)[0]
            gen = generator_for(self.params.seed ^ _SALT_DRAFT, position, _SALT_DRAFT)
            try:
                token = int(torch.multinomial(q, 1, generator=gen))
            except RuntimeError:
                # q holds inf or NaN, or no mass (extreme penalties): nothing to draw a proposal from.
                # The proposal ends here; the target decides the next token on its own.
                return None
            self._rows.append(q)
        self._tokens.append(token)
        if len(self._tokens) == self._k:
            return None
        self.fed.append(token)
        return self.cache, position, [token]

    def _proposal(self) -> Proposal:
        rows = self._rows
        probs = torch.stack(rows).to(torch.float32).contiguous().numpy().tobytes() if rows else b""
        return Proposal(self._tokens, probs)

    def _forget(self) -> None:
        """After a failure the draft's cache may hold half-written positions: start again from
        nothing (the next proposal feeds the whole history)."""
        self.fed = []
        self.cache.length = 0

    def close(self) -> None:
        self.cache.release()


_Feed = tuple[DraftCache, int, list[int]]


def draft_together(jobs: list[tuple[DraftProposer, list[int]]]) -> list[Proposal | Exception | None]:
    """Proposals for several requests, step by step, each step one forward pass for all of them.

    Per request: its Proposal, None (no room to propose), or the exception that its proposal met.
    A failure stays with the request that caused it. A request's own steps (its sampling of a
    draft token, with its parameters) fail it alone. A failure of the shared forward pass cannot
    be told apart, so each of its requests is drafted again alone, from nothing: only the request
    that causes it meets it again.
    """
    draft = jobs[0][0].draft
    outcomes: list[Proposal | Exception | None] = [None] * len(jobs)
    feeds: dict[int, _Feed] = {}

    def own_step(index: int, feed_or_error: Callable[[], _Feed | None], *, begun: bool) -> None:
        proposer = jobs[index][0]
        try:
            feed = feed_or_error()
        except Exception as err:
            proposer._forget()
            outcomes[index] = err
            return
        if feed is not None:
            feeds[index] = feed
        elif begun:
            outcomes[index] = proposer._proposal()

    for index, (proposer, history) in enumerate(jobs):
        own_step(index, lambda proposer=proposer, history=history: proposer._begin(history), begun=False)
    while feeds:
        order = list(feeds)
        try:
            logits = draft.forward_packed([feeds[i] for i in order])
        except Exception as err:
            for i in order:
                jobs[i][0]._forget()
            if len(order) == 1:
                outcomes[order[0]] = err
            else:
                for i in order:
                    outcomes[i] = draft_together([jobs[i]])[0]
            break
        feeds = {}
        for i, row in zip(order, logits, strict=True):
            own_step(i, lambda proposer=jobs[i][0], row=row: proposer._next(row), begun=True)
    return outcomes


class DraftBatcher:
    """Drafts together the proposals that requests ask for in the same turn of the event loop.

    The draft's matmuls cost about the same for one row as for a few, so concurrent requests
    (whose predictions a batching last stage returns together) propose for the price of one.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[DraftProposer, list[int], asyncio.Future]] = []

    async def propose(self, proposer: DraftProposer, history: list[int]) -> Proposal | None:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((proposer, history, future))
        if len(self._pending) == 1:
            loop.call_soon(self._run)
        return await future

    def _run(self) -> None:
        jobs = [job for job in self._pending if not job[2].done()]  # a cancelled request drops out
        self._pending = []
        if not jobs:
            return
        outcomes = draft_together([(proposer, history) for proposer, history, _ in jobs])
        for (_, _, future), outcome in zip(jobs, outcomes, strict=True):  # each request gets its own
            if isinstance(outcome, Exception):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)


# ---- building what the decision names -----------------------------------------------------------


def same_vocabulary(target_tokenizer, draft_dir: Path) -> str | None:
    """None when the draft shares the target's vocabulary, else the reason it does not."""
    from transformers import AutoTokenizer

    draft_tokenizer = AutoTokenizer.from_pretrained(draft_dir)
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        return "the draft's tokenizer vocabulary differs from the target's"
    return None


class Speculation:
    """The strategy this frontend runs (a SpeculativeChoice) and what it needs: the draft model,
    the metrics, the tokenizer (auto looks at the prompt's text)."""

    def __init__(self, choice: SpeculativeChoice, draft: DraftModel | None = None, metrics=None,
                 tokenizer=None) -> None:
        self.choice, self.draft, self.metrics, self.tokenizer = choice, draft, metrics, tokenizer
        self.batcher = DraftBatcher()  # shared by the requests of this strategy
        if metrics is not None:
            metrics.set_speculative_strategy(choice.strategy, choice.reason)
            metrics.set_window_size(choice.window.initial if choice.strategy != "none" else 0)

    def with_metrics(self, metrics) -> Speculation:
        """The same strategy and draft, reporting to other metrics (the benchmark counts per run)."""
        return Speculation(self.choice, self.draft, metrics, self.tokenizer)

    @property
    def strategy(self) -> str:
        return self.choice.strategy

    @property
    def reason(self) -> str:
        return self.choice.message

    @property
    def window(self) -> WindowPolicy:
        return self.choice.window

    def describe(self) -> dict:
        w = self.window
        out = {"strategy": self.strategy, "reason": self.choice.reason, "message": self.choice.message,
               "window": {"adaptive": w.adaptive, "initial": w.initial, "min": w.minimum, "max": w.maximum}}
        if self.draft is not None:
            out["draft_model"] = self.draft.source
        return out

    def proposer_for(self, request: GenerationRequest) -> Proposer | None:
        if self.strategy == "none":
            return None
        if self.strategy == "ngram":
            return NgramProposer(self.window, self.metrics)
        if self.strategy == "auto":
            text = self.tokenizer.decode(request.prompt_ids[-512:]) if self.tokenizer is not None else ""
            return AutoProposer(self.window, favourable_prompt(text), self.metrics)
        params = request.sampling_params(request.seed or 0)
        return DraftProposer(self.draft, self.window, params, self.metrics, self.batcher)


def resolve_speculation(options: SpeculativeOptions, model_dir: Path, tokenizer, metrics=None, *,
                        dtype: str = "auto", device: str = "auto", max_context: int = 2048) -> Speculation:
    """Decide (inferencemesh.speculation) and load what the decision names; a draft that cannot be
    loaded turns into serving without speculation, never into a failed start-up."""
    choice = choose_for_model(model_dir, strategy=options.speculative, draft=options.draft,
                              no_draft=options.no_draft, window=options.window)
    draft = None
    if choice.strategy == "draft":
        try:
            draft = _load_draft(choice.draft, tokenizer, dtype=dtype, device=device, max_context=max_context)
        except Exception as err:  # serve without speculation, and say why
            log.warning("draft model %s unusable, serving without speculation: %s", choice.draft, err)
            choice = choice.without_draft(f"{type(err).__name__}: {err}")
    return Speculation(choice, draft, metrics, tokenizer)


def _load_draft(source: str, tokenizer, *, dtype: str, device: str, max_context: int) -> DraftModel:
    draft_dir = Path(source)
    if not draft_dir.exists():
        draft_dir = fetch_config_dir(source)
    mismatch = same_vocabulary(tokenizer, draft_dir)
    if mismatch:
        raise ValueError(mismatch)
    return DraftModel(str(draft_dir), dtype=dtype, device=device, max_context=max_context)
