"""One session's grammar state under speculative decoding (llguidance's LLMatcher).

The matcher advances only on committed tokens. For a verify window (k drafts + the bonus
position) window_masks walks the drafts on scratch: the mask before each draft, consume it, ...,
the mask for the bonus position, then rolls everything back. A draft the grammar forbids ends
the window there; the stage then verifies only the drafts kept, under those masks, so it can
neither accept nor sample a token the grammar forbids.

EOS: llguidance allows the tokenizer's EOS token(s) in a mask exactly when the grammar may end
there (is_accepting), and once it cannot go on (is_stopped) the mask is EOS alone. The EOS ids
are the GrammarTokenizer's: pass every id that ends generation (e.g. <|im_end|> for chat), or a
stop token the grammar never allows would be masked out and the output could never end.

Threads and cost: nothing here runs on the event loop. A constraint's matcher is built once, on
the low-priority build thread (constrained_output), after the grammar worker compiled its grammar
in a process of its own (constraints.validated_grammar: a grammar that crashes or outlasts the
compiler never gets here); it is then probed one token deep (errors llguidance reports only at a
first token: "too many expressions constructed") and kept: each choice of each request starts from
a deep copy, which costs microseconds. Masks and commits run on the mask threads
(window_masks_async, commit_async): llguidance releases the GIL while it computes a mask, not
while it consumes a token, so a token's work is bounded twice, by llguidance's per-step item limit
(constraints.MAX_STEP_ITEMS) and by MASK_BUDGET_S of CPU, past which the choice ends with a
ConstraintError naming the parameter (a 400, or the stream's error event), alone. One LLMatcher
must not be used by two threads at once (PyO3 raises "Already borrowed"): each SessionGrammar
holds a lock around it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import torch

from inferencemesh.frontend.engine.constraints import GRAMMAR_LIMITS, Constraint, first_line
from inferencemesh.frontend.engine.errors import ConstraintError
from inferencemesh.frontend.engine.grammar_worker import WORKER_STACK_BYTES
from inferencemesh.token_masks import WORD_BITS, allowed_tokens, apply_token_masks, is_allowed, mask_words

log = logging.getLogger("inferencemesh.frontend")

# Masks a session keeps between commits (a draft window's worth and then some): 8 KB each for
# a 64k vocabulary, 19 KB for 150k.
MAX_REMEMBERED_MASKS = 32
# CPU one token's mask, or one committed token, may cost: a real grammar's mask costs well under
# 10 ms even over a 150k vocabulary; past this the choice ends (llguidance cannot be interrupted,
# so this bounds the next token's cost, not this one's: MAX_STEP_ITEMS bounds that).
MASK_BUDGET_S = 0.1
MATCHERS = 64  # built matchers kept per tokenizer (agents send the same schema again and again)


def _low_priority() -> None:
    # Linux gives each thread its own nice value: a matcher build waits for CPU the stages and
    # the event loop do not want.
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


# The stack of the threads that run llguidance here: 16 times the grammar worker's, whatever the
# platform's default thread stack (RLIMIT_STACK): a grammar that compiled there has room here.
# Virtual memory: pages are touched only as deep as a grammar goes.
SERVING_STACK_BYTES = 16 * WORKER_STACK_BYTES
_STACK_LOCK = threading.Lock()


class _GrammarThreads(ThreadPoolExecutor):
    """A ThreadPoolExecutor whose threads have SERVING_STACK_BYTES of stack."""

    def _adjust_thread_count(self) -> None:  # where ThreadPoolExecutor starts its threads
        with _STACK_LOCK:
            previous = threading.stack_size(SERVING_STACK_BYTES)
            try:
                super()._adjust_thread_count()
            finally:
                threading.stack_size(previous)


# One build at a time, at the lowest priority; masks on threads of their own (a session's lock
# keeps one choice's masks in order; other choices' run alongside).
_BUILDS = _GrammarThreads(max_workers=1, thread_name_prefix="grammar-build", initializer=_low_priority)
_MASKS = _GrammarThreads(max_workers=4, thread_name_prefix="grammar-mask")


@dataclass(frozen=True, eq=False)
class GrammarTokenizer:
    """A tokenizer as llguidance sees it, with the mask width of the model it serves.

    vocab_size is the model's logits width (its embedding rows, possibly padded past the
    tokenizer's vocabulary: those ids are never allowed). Building one costs a token-trie
    construction (~1 s for a 150k vocabulary): get it from grammar_tokenizer(), which caches."""

    ll: llguidance.LLTokenizer
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    @property
    def words(self) -> int:
        return mask_words(self.vocab_size)


_CACHE: weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]], GrammarTokenizer]] = (
    weakref.WeakKeyDictionary()
)
_CACHE_LOCK = threading.Lock()


def grammar_tokenizer(
    hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int] | None = None
) -> GrammarTokenizer:
    """The cached GrammarTokenizer of a Hugging Face fast tokenizer for a model of vocab_size logits.

    eos_token_ids: the ids that end generation (default: the tokenizer's eos_token_id)."""
    eos = tuple(eos_token_ids) if eos_token_ids is not None else (hf_tokenizer.eos_token_id,)
    if not eos or any(not isinstance(token, int) or not 0 <= token < vocab_size for token in eos):
        raise ValueError(f"EOS token ids {eos} must be ids below the vocabulary size {vocab_size}")
    if len(hf_tokenizer) > vocab_size:
        raise ValueError(f"the tokenizer has {len(hf_tokenizer)} tokens, more than the model's {vocab_size} logits")
    key = (vocab_size, eos)
    with _CACHE_LOCK:
        cached = _CACHE.get(hf_tokenizer, {}).get(key)
    if cached is not None:
        return cached
    # Built outside the lock (seconds for a large vocabulary); a race builds twice, keeps one.
    built = GrammarTokenizer(
        llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos)), vocab_size, eos
    )
    with _CACHE_LOCK:
        return _CACHE.setdefault(hf_tokenizer, {}).setdefault(key, built)


_MATCHERS: weakref.WeakKeyDictionary[GrammarTokenizer, OrderedDict[str, llguidance.LLMatcher | str]] = (
    weakref.WeakKeyDictionary()
)
_MATCHERS_LOCK = threading.Lock()


def constraint_matcher(constraint: Constraint, tokenizer: GrammarTokenizer) -> llguidance.LLMatcher:
    """The constraint's matcher over tokenizer, in its initial state: built and probed once, then
    remembered (so is a refusal). Shared: copy it (SessionGrammar does), never advance it.
    Raises ConstraintError for a grammar llguidance refuses with this tokenizer, or at its first
    token. Blocks for as long as the build takes: call it on the build thread (constrained_output)."""
    with _MATCHERS_LOCK:
        built = _MATCHERS.get(tokenizer)
        known = built.get(constraint.grammar) if built is not None else None
    if known is None:
        started = time.perf_counter()
        try:
            known = _built(constraint, tokenizer)
        except ConstraintError as err:
            known = err.message
        log.debug("built a %s matcher in %.3fs", constraint.kind.value, time.perf_counter() - started)
        with _MATCHERS_LOCK:
            built = _MATCHERS.setdefault(tokenizer, OrderedDict())
            built[constraint.grammar] = known
            built.move_to_end(constraint.grammar)
            if len(built) > MATCHERS:
                built.popitem(last=False)
    if isinstance(known, str):
        raise ConstraintError(constraint.param, known)
    return known


def _built(constraint: Constraint, tokenizer: GrammarTokenizer) -> llguidance.LLMatcher:
    # log_level 0: refusals are reported through is_error/get_error, not printed to stderr.
    matcher = llguidance.LLMatcher(tokenizer.ll, constraint.grammar, log_level=0, limits=GRAMMAR_LIMITS)
    probe = matcher.deep_copy() if not matcher.is_error() else matcher
    if not probe.is_error():
        # One token deep: llguidance builds its lexer lazily, and some limits are met only there.
        mask = torch.empty(tokenizer.words, dtype=torch.int32)
        probe.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * mask.element_size())
        tokens = [t for t in allowed_tokens(mask).tolist() if t not in tokenizer.eos_token_ids]
        if tokens and not probe.is_error() and probe.consume_token(tokens[-1]):
            probe.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * mask.element_size())
    if probe.is_error():  # tokenizer-dependent failures the grammar worker cannot see
        raise ConstraintError(constraint.param, f"cannot enforce this constraint: {first_line(probe.get_error())}")
    return matcher


async def constrained_output(constraint: Constraint, tokenizer: GrammarTokenizer,
                             mask_timer: Callable[[float], None] | None = None) -> ConstrainedOutput:
    """The request's ConstrainedOutput, its matcher built (or found) off the event loop."""
    matcher = await asyncio.get_running_loop().run_in_executor(_BUILDS, constraint_matcher, constraint, tokenizer)
    return ConstrainedOutput(constraint, tokenizer, mask_timer, matcher)


@dataclass(frozen=True, eq=False)
class ConstrainedOutput:
    """A request's constraint with the tokenizer it is enforced over: each of its choices starts a
    SessionGrammar of its own, from a copy of matcher (built on first use when not given)."""

    constraint: Constraint
    tokenizer: GrammarTokenizer
    # Where each frame's mask time goes (FrontendMetrics.mask_timer), or None: not measured.
    mask_timer: Callable[[float], None] | None = None
    matcher: llguidance.LLMatcher | None = None

    def start(self) -> SessionGrammar:
        matcher = self.matcher if self.matcher is not None else constraint_matcher(self.constraint, self.tokenizer)
        return SessionGrammar(self.constraint, self.tokenizer, mask_timer=self.mask_timer, matcher=_copy(matcher))


def _copy(matcher: llguidance.LLMatcher) -> llguidance.LLMatcher:
    """A copy of a shared matcher (microseconds: llguidance shares the compiled grammar)."""
    with _MATCHERS_LOCK:  # one borrower at a time (PyO3)
        return matcher.deep_copy()


class GrammarViolation(RuntimeError):
    """A committed token the grammar forbids: the masks were not applied upstream (a bug)."""


class SessionGrammar:
    """One generation's grammar state: advanced by commit(), queried by window_masks()."""

    def __init__(self, constraint: Constraint, tokenizer: GrammarTokenizer, *,
                 mask_timer: Callable[[float], None] | None = None,
                 matcher: llguidance.LLMatcher | None = None) -> None:
        """matcher: this generation's own, in its initial state (default: a copy of the
        constraint's, built on first use)."""
        self.constraint = constraint
        self.tokenizer = tokenizer
        self.mask_timer = mask_timer  # told each frame's mask time by its caller (session.Connection.token_masks)
        self._lock = threading.Lock()
        self._matcher = matcher if matcher is not None else _copy(constraint_matcher(constraint, tokenizer))
        self.committed = 0  # tokens the grammar has advanced by
        # Masks computed since the last commit, by the drafts they follow: a draft model asks for
        # the mask after each of its drafts (mask_after), and the verify window then needs those
        # same rows again (window_masks), which are copied instead of computed twice.
        self._computed: dict[tuple[int, ...], torch.Tensor] = {}
        self.mask_fills = 0  # masks computed (not copied), for tests and benchmarks

    # -- committed state ---------------------------------------------------------------------

    async def commit_async(self, tokens: Sequence[int]) -> None:
        """commit, on a mask thread."""
        await asyncio.get_running_loop().run_in_executor(_MASKS, self.commit, tokens)

    async def window_masks_async(self, drafts: Sequence[int]) -> tuple[torch.Tensor, int]:
        """window_masks, on a mask thread."""
        return await asyncio.get_running_loop().run_in_executor(_MASKS, self.window_masks, drafts)

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance by tokens the pipeline committed (accepted drafts + the bonus token).

        Raises GrammarViolation, leaving the state as it was, if one of them is not allowed:
        that means a mask was not applied and the output already breaks the constraint."""
        tokens = list(tokens)
        with self._lock:
            ok = self._valid_prefix(tokens)
            if ok < len(tokens):
                raise GrammarViolation(
                    f"token {tokens[ok]} at committed position {self.committed + ok} is not allowed by the "
                    f"{self.constraint.kind.value} constraint"
                )
            for token in tokens:
                self._consume(token)
            self.committed += len(tokens)
            self._computed.clear()

    def _valid_prefix(self, tokens: list[int]) -> int:
        """How many leading tokens the grammar allows from here (never puts the matcher in error)."""
        eos = self.tokenizer.eos_token_ids
        in_range = next(
            (i for i, token in enumerate(tokens) if not 0 <= token < self.tokenizer.vocab_size), len(tokens)
        )
        # An id out of range would put the matcher in its permanent error state: stop before it.
        prefix = tokens[:in_range]
        if self._matcher.is_stopped():
            # After EOS (or once nothing can follow) only EOS is accepted, by consume_token.
            return next((i for i, token in enumerate(prefix) if token not in eos), len(prefix))
        return self._matcher.validate_tokens(prefix) if prefix else 0

    def _consume(self, token: int) -> None:
        started = time.thread_time()
        if not self._matcher.consume_token(token) or self._matcher.is_error():
            self._failed()
        self._within_budget(started)

    def _failed(self) -> None:
        """The matcher is in its error state: a limit met mid-generation (the grammar allowed the
        token, llguidance could not go on), the client's constraint at fault."""
        raise ConstraintError(self.constraint.param, f"the {self.constraint.kind.value} constraint could not be "
                                                     f"enforced after {self.committed} tokens: "
                                                     f"{first_line(self._matcher.get_error())}")

    def _within_budget(self, started: float) -> None:
        spent = time.thread_time() - started
        if spent > MASK_BUDGET_S:
            raise ConstraintError(self.constraint.param, f"the {self.constraint.kind.value} constraint costs "
                                                         f"{1000 * spent:.0f} ms of CPU for one token, more than the "
                                                         f"{1000 * MASK_BUDGET_S:.0f} ms allowed")

    @property
    def is_accepting(self) -> bool:
        """Whether the output may end here (EOS is allowed)."""
        with self._lock:
            return self._matcher.is_accepting()

    @property
    def is_finished(self) -> bool:
        """Whether nothing but EOS can follow (the grammar is complete, or EOS was committed)."""
        with self._lock:
            return self._matcher.is_stopped()

    # -- masks -------------------------------------------------------------------------------

    def window_masks(self, drafts: Sequence[int]) -> tuple[torch.Tensor, int]:
        """The masks for a verify window: (masks, usable).

        masks is a CPU int32 tensor [usable + 1, words]: row i is the mask at draft position i
        (given drafts[:i] accepted), row usable the bonus position's. usable is how many drafts
        the grammar allows in a row from the committed state; the first one it forbids (and all
        after it) must be dropped from the window. An allowed EOS draft is the window's last
        (nothing follows EOS; its bonus row allows EOS alone). The committed state is unchanged."""
        drafts = list(drafts)
        masks = torch.empty((len(drafts) + 1, self.tokenizer.words), dtype=torch.int32)
        with self._lock:
            usable = self._scratch_walk(drafts, masks)
        return masks[: usable + 1], usable

    def mask_after(self, drafts: Sequence[int] = ()) -> torch.Tensor | None:
        """The mask [1, words] after the committed tokens and then drafts (on scratch), or None if
        the grammar forbids drafts. For a draft model proposing token by token."""
        drafts = list(drafts)
        masks = torch.empty((len(drafts) + 1, self.tokenizer.words), dtype=torch.int32)
        with self._lock:
            usable = self._scratch_walk(drafts, masks, rows=False)
        return masks[usable : usable + 1] if usable == len(drafts) else None

    def constrain_draft_logits(self, logits: torch.Tensor, drafts: Sequence[int] = ()) -> torch.Tensor:
        """A draft model's next-token logits ([vocab] or [1, vocab]) masked in place to what the
        grammar allows after drafts; returns logits. Raises GrammarViolation if drafts themselves
        are forbidden (the proposer should have been masked: its proposals end there)."""
        mask = self.mask_after(drafts)
        if mask is None:
            raise GrammarViolation(
                f"drafts {list(drafts)} are not allowed by the {self.constraint.kind.value} constraint"
            )
        apply_token_masks(logits.view(1, -1) if logits.dim() == 1 else logits, mask)
        return logits

    def _scratch_walk(self, drafts: list[int], masks: torch.Tensor, rows: bool = True) -> int:
        """Consume drafts on scratch while the grammar allows them, writing the mask before each
        (only the last one unless rows) into masks[i]; roll back; return how many were allowed.
        Caller holds the lock."""
        eos = self.tokenizer.eos_token_ids
        consumed = allowed = 0
        try:
            # Without rows, the masks before each draft are skipped: validation is cheaper than a mask.
            limit = len(drafts) if rows else self._valid_prefix(drafts)
            for token in drafts[:limit]:
                if rows:
                    self._fill(masks, allowed, tuple(drafts[:allowed]))
                    if not is_allowed(masks[allowed], token):
                        break
                if token in eos:
                    # Nothing follows EOS. It is not consumed: once the matcher is stopped,
                    # llguidance accepts EOS without recording it, so a rollback would undo a real token.
                    allowed += 1
                    self._eos_row(masks, allowed)
                    return allowed
                self._consume(token)
                consumed = allowed = allowed + 1
            if rows or allowed == len(drafts):
                self._fill(masks, allowed, tuple(drafts[:allowed]))
        finally:
            self._rollback(consumed)
        return allowed

    def _eos_row(self, masks: torch.Tensor, row: int) -> None:
        masks[row] = 0
        for token in self.tokenizer.eos_token_ids:
            word, bit = divmod(token, WORD_BITS)
            masks[row, word] = int(masks[row, word]) | ((1 << bit) if bit < 31 else -(1 << 31))  # int32 bits

    def _fill(self, masks: torch.Tensor, row: int, after: tuple[int, ...]) -> None:
        """masks[row] = the mask in the matcher's current state, which is after `after` (the drafts
        consumed on scratch): copied when computed since the last commit."""
        target = masks[row]
        known = self._computed.get(after)
        if known is not None:
            target.copy_(known)
            return
        # Writes llguidance's mask straight into the row; the GIL is released while it computes.
        started = time.thread_time()
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())
        if self._matcher.is_error():
            self._failed()
        self._within_budget(started)
        self.mask_fills += 1
        if len(self._computed) < MAX_REMEMBERED_MASKS:
            self._computed[after] = target.clone()

    def _rollback(self, count: int) -> None:
        if self._matcher.is_error():
            return  # what put it there is being raised: this choice ends
        if count and not self._matcher.rollback(count):
            raise RuntimeError(f"llguidance could not roll back {count} tokens: {self._matcher.get_error()}")
