"""Draft-model proposals: the draft proposes k tokens per request, and concurrent requests'
proposals share the draft's forward passes (DraftBatcher).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch

from inferencemesh.frontend.engine.proposers.base import Proposal, WindowedProposer
from inferencemesh.frontend.engine.proposers.draft_model import Cache, DraftModel
from inferencemesh.sampling import (
    DraftRow,
    SamplingParams,
    adjust,
    draft_row,
    draw,
    generator_for,
    probabilities,
    sample,
)
from inferencemesh.speculation import WindowPolicy

if TYPE_CHECKING:
    from inferencemesh.frontend.engine.metrics import FrontendMetrics

_SALT_DRAFT = 0xD4AF7


class DraftProposer(WindowedProposer):
    """Propose k tokens with the draft model. Its cache rolls back like the stages': the next
    call truncates to the longest prefix the draft has seen that the history still agrees with.
    Catching up on accepted tokens computes logits for the last row only (dead rows skipped).
    With a DraftBatcher, proposals of concurrent requests share the draft's forward passes."""

    def __init__(self, draft: DraftModel, policy: WindowPolicy, params: SamplingParams,
                 metrics: FrontendMetrics | None = None,
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
        self._rows: list[DraftRow] = []  # what each sampled proposal was drawn from (Leviathan's verification)
        self.racing = False  # a greedy or seeded request: propose by the target's race, send no q

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

    def _begin(self, history: list[int]) -> tuple[Cache, int, list[int]] | None:
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
        if self.draft.embedding_rows < self.draft.vocab_size and max(history[agree:]) >= self.draft.embedding_rows:
            return None  # a token the smaller draft has no embedding for: it cannot follow this history
        self.fed = history[:]
        self._first_position, self._tokens, self._rows = len(history), [], []
        return self.cache, agree, history[agree:]

    def _next(self, logits: torch.Tensor) -> tuple[Cache, int, list[int]] | None:
        """Draw the next draft token from `logits`; the feed for the one after, or None when done."""
        position = self._first_position + len(self._tokens)
        # The target's transforms (penalties, bias, min_tokens, the grammar's mask) on the draft
        # too: its proposals then follow what the target will accept.
        grammar = self.grammar
        if grammar is not None and logits.shape[-1] >= grammar.tokenizer.vocab_size:
            logits = grammar.constrain_draft_logits(logits.clone(), self._tokens)
        logits = adjust(logits[None], self.params, self.fed)[0]
        unlisted = False
        if self.params.greedy:
            token = int(logits.argmax())
        else:
            q = probabilities(logits[None], self.params)[0]
            try:
                if self.racing:
                    # The target's own race (seed, position) over q: where q is close to p the draft
                    # picks what the target will, and the target's pick never depends on the proposal.
                    token = sample(q, self.params.seed, position)
                else:
                    # Drawn from q's row as the wire carries it (sampling.DraftRow), which Leviathan's rule
                    # then verifies against: its most likely tokens and an even remainder.
                    row = draft_row(q)
                    token, unlisted = draw(row, generator_for(self.params.seed ^ _SALT_DRAFT, position, _SALT_DRAFT))
                    self._rows.append(row)
            except RuntimeError:
                # q holds inf or NaN, or no mass (extreme penalties): nothing to draw a proposal from.
                # The proposal ends here; the target decides the next token on its own.
                return None
        self._tokens.append(token)
        # A token from the row's remainder is one the draft found unlikely, perhaps one it has no embedding
        # for (a padded vocabulary): the window ends with it, unfed.
        if len(self._tokens) == self._k or unlisted or (grammar is not None
                                                         and token in grammar.tokenizer.eos_token_ids):
            return None  # the window is full, or the output ends here
        self.fed.append(token)
        return self.cache, position, [token]

    def _proposal(self) -> Proposal:
        # No rows when racing: verification then compares tokens with the target's draws.
        return Proposal(self._tokens, self._rows)

    def reproducible(self) -> None:
        """A greedy or seeded request: an untimed window, and proposals by the target's race, which
        the last stage verifies by the race too (it sends no q): its tokens do not depend on them."""
        super().reproducible()
        self.racing = True

    def _forget(self) -> None:
        """After a failure the draft's cache may hold half-written positions: start again from
        nothing (the next proposal feeds the whole history)."""
        self.fed = []
        self.cache.forget()

    def close(self) -> None:
        self.cache.release()


_Feed = tuple[Cache, int, list[int]]


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
        own_step(index, partial(proposer._begin, history), begun=False)
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
            own_step(i, partial(jobs[i][0]._next, row), begun=True)
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
