"""Speculative decoding strategies. The frontend proposes; the last stage verifies.

- draft: a small model with the target's tokenizer runs here and proposes k tokens.
- ngram: prompt lookup, the continuation of the latest earlier match of the suffix.
- auto: n-gram, but only where it pays (seed 003): on at once for favourable prompt shapes
  (code fences, diffs, tracebacks, logs, JSON, SQL, paths), or after repeated-suffix hits
  seen during a cold observation phase; off with a cooldown after poor acceptance.
- none.

Which one runs: explicit configuration (CLI flag / InferenceMesh spec) > the model package's
declared default (model-package.json) > auto. A declared draft that cannot be loaded means
serving without speculation and saying why, never failing start-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from inferencemesh.frontend.draft import DraftCache, DraftModel
from inferencemesh.frontend.engine import Proposal, Proposer
from inferencemesh.frontend.engine_api import GenerationRequest
from inferencemesh.sampling import SamplingParams, generator_for, probabilities

log = logging.getLogger("inferencemesh.speculative")

PACKAGE_FILE = "model-package.json"
STRATEGIES = ("auto", "draft", "ngram", "none")
_SALT_DRAFT = 0xD4AF7


# ---- window policy ---------------------------------------------------------------------------


@dataclass(frozen=True)
class WindowPolicy:
    adaptive: bool = True
    initial: int = 4
    minimum: int = 1
    maximum: int = 8

    @classmethod
    def parse(cls, text: str | None, default: WindowPolicy | None = None) -> WindowPolicy:
        """'6' (fixed) or 'adaptive:INITIAL:MIN:MAX'."""
        if not text:
            return default or cls()
        if text.isdigit():
            k = int(text)
            return cls(adaptive=False, initial=k, minimum=k, maximum=k).checked()
        parts = text.split(":")
        if parts[0] != "adaptive" or len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
            raise ValueError(f"window {text!r}: use a number (fixed) or adaptive:INITIAL:MIN:MAX")
        return cls(True, int(parts[1]), int(parts[2]), int(parts[3])).checked()

    @classmethod
    def from_package(cls, spec: dict) -> WindowPolicy:
        return cls(
            adaptive=spec.get("default", "adaptive") == "adaptive",
            initial=int(spec.get("initial_window", 4)),
            minimum=int(spec.get("min_window", 1)),
            maximum=int(spec.get("max_window", 8)),
        ).checked()

    def checked(self) -> WindowPolicy:
        if not 1 <= self.minimum <= self.initial <= self.maximum <= 64:
            raise ValueError(f"window sizes need 1 <= min <= initial <= max <= 64, got {self}")
        return self


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


def ngram_lookup(history: list[int], k: int, min_ngram: int = 2, max_ngram: int = 4) -> list[int]:
    """Continue the longest suffix (min..max tokens) by what followed its latest earlier match."""
    n = len(history)
    for size in range(min(max_ngram, n - 1), min_ngram - 1, -1):
        suffix = history[n - size :]
        for start in range(n - size - 1, -1, -1):
            if history[start : start + size] == suffix:
                follow = history[start + size : start + size + k]
                if follow:
                    return follow
    return []


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
        return draft_together([(self, history)])[0]

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
        if self.params.greedy:
            token = int(logits.argmax())
        else:
            q = probabilities(logits[None], self.params)[0]
            gen = generator_for(self.params.seed ^ _SALT_DRAFT, position, _SALT_DRAFT)
            token = int(torch.multinomial(q, 1, generator=gen))
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

    def close(self) -> None:
        self.cache.release()


def draft_together(jobs: list[tuple[DraftProposer, list[int]]]) -> list[Proposal | None]:
    """Proposals for several requests, step by step, each step one forward pass for all of them."""
    draft = jobs[0][0].draft
    feeds, active = [], []
    for proposer, history in jobs:
        feed = proposer._begin(history)
        if feed is not None:
            feeds.append(feed)
            active.append(proposer)
    started = list(active)
    while feeds:
        logits = draft.forward_packed(feeds)
        feeds, still = [], []
        for proposer, row in zip(active, logits, strict=True):
            feed = proposer._next(row)
            if feed is not None:
                feeds.append(feed)
                still.append(proposer)
        active = still
    return [proposer._proposal() if proposer in started else None for proposer, _ in jobs]


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
        try:
            proposals = draft_together([(proposer, history) for proposer, history, _ in jobs])
        except Exception as err:  # delivered to every waiting request
            for _, _, future in jobs:
                future.set_exception(err)
            return
        for (_, _, future), proposal in zip(jobs, proposals, strict=True):
            future.set_result(proposal)


# ---- resolution ------------------------------------------------------------------------------


class PackageError(ValueError):
    """model-package.json is malformed."""


@dataclass
class DeclaredStrategy:
    name: str
    type: str  # "draft-model" | "ngram"
    draft_model: str | None = None
    window: WindowPolicy = field(default_factory=WindowPolicy)


def read_package_default(model_dir: Path) -> DeclaredStrategy | None:
    """The default strategy a model package declares, or None. Unknown fields are ignored."""
    path = model_dir / PACKAGE_FILE
    if not path.exists():
        return None
    try:
        spec = json.loads(path.read_text())["generation"]["speculative_decoding"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise PackageError(f"{path}: no readable generation.speculative_decoding ({err})") from err
    if not isinstance(spec, dict) or "default" not in spec:
        raise PackageError(f"{path}: generation.speculative_decoding needs a 'default'")
    name = spec["default"]
    strategy = (spec.get("strategies") or {}).get(name)
    if not isinstance(strategy, dict):
        raise PackageError(f"{path}: default strategy {name!r} is not in 'strategies'")
    kind = strategy.get("type")
    if kind not in ("draft-model", "ngram"):
        raise PackageError(f"{path}: strategy {name!r} has unknown type {kind!r} (draft-model or ngram)")
    window = WindowPolicy.from_package(strategy.get("window_policy") or {})
    draft = strategy.get("draft_model")
    if kind == "draft-model":
        if not isinstance(draft, str) or not draft:
            raise PackageError(f"{path}: draft-model strategy {name!r} needs 'draft_model'")
        relative = (model_dir / draft).resolve()
        draft = str(relative) if relative.exists() or draft.startswith(".") else draft
    return DeclaredStrategy(name, kind, draft, window)


def same_vocabulary(target_tokenizer, draft_dir: Path) -> str | None:
    """None when the draft shares the target's vocabulary, else the reason it does not."""
    from transformers import AutoTokenizer

    draft_tokenizer = AutoTokenizer.from_pretrained(draft_dir)
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        return "the draft's tokenizer vocabulary differs from the target's"
    return None


@dataclass
class Speculation:
    strategy: str
    reason: str
    window: WindowPolicy = field(default_factory=WindowPolicy)
    draft: DraftModel | None = None
    metrics: object = None
    tokenizer: object = None
    batcher: DraftBatcher = field(default_factory=DraftBatcher)  # shared by the requests of this strategy

    def describe(self) -> dict:
        out = {"strategy": self.strategy, "reason": self.reason, "window": {
            "adaptive": self.window.adaptive, "initial": self.window.initial,
            "min": self.window.minimum, "max": self.window.maximum}}
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
        params = SamplingParams(request.temperature, request.top_p, request.top_k, request.seed or 0)
        return DraftProposer(self.draft, self.window, params, self.metrics, self.batcher)


def resolve_speculation(args: argparse.Namespace, model_dir: Path, tokenizer, metrics=None) -> Speculation:
    """Pick the strategy: explicit > package default > auto; never fail start-up over a draft."""
    explicit = args.speculative or ("draft" if args.draft else None)
    window_override = getattr(args, "window", None)
    try:
        declared = read_package_default(model_dir)
        package_note = ""
    except PackageError as err:
        declared, package_note = None, f"; model package ignored: {err}"
        log.warning("%s", err)

    def finish(spec: Speculation) -> Speculation:
        spec.window = WindowPolicy.parse(window_override, spec.window)
        spec.metrics, spec.tokenizer = metrics, tokenizer
        if metrics is not None:
            metrics.set_speculative_strategy(spec.strategy, spec.reason)
            metrics.set_window_size(spec.window.initial if spec.strategy != "none" else 0)
        return spec

    if explicit in ("none", "ngram", "auto"):
        return finish(Speculation(explicit, f"configured explicitly{package_note}"))
    if explicit == "draft":
        source = args.draft or (declared.draft_model if declared and declared.type == "draft-model" else None)
        if source is None:
            return finish(Speculation("none", "draft requested but no draft model given or declared by the package"))
        window = declared.window if declared and not args.draft else WindowPolicy()
        return finish(_load_draft(source, window, args, tokenizer, "configured explicitly"))
    if declared is not None:
        if declared.type == "ngram":
            return finish(Speculation("ngram", f"declared by the model package ({declared.name})",
                                      window=declared.window))
        if args.no_draft:
            return finish(Speculation("auto", f"package draft {declared.name!r} disabled by --no-draft / noDraft"))
        return finish(_load_draft(declared.draft_model, declared.window, args, tokenizer,
                                  f"declared by the model package ({declared.name})"))
    return finish(Speculation("auto", f"built-in default (no draft declared){package_note}"))


def _load_draft(source: str, window: WindowPolicy, args: argparse.Namespace, tokenizer, why: str) -> Speculation:
    try:
        draft_dir = Path(source)
        if not draft_dir.exists():
            from inferencemesh.frontend.main import local_model_dir

            draft_dir = local_model_dir(source)
        mismatch = same_vocabulary(tokenizer, draft_dir)
        if mismatch:
            raise ValueError(mismatch)
        draft = DraftModel(str(draft_dir), dtype=getattr(args, "dtype", "auto"),
                           device=getattr(args, "device", "auto"), max_context=args.max_context)
    except Exception as err:  # serve without speculation, and say why
        log.warning("draft model %s unusable, serving without speculation: %s", source, err)
        return Speculation("none", f"draft model {source} could not be loaded ({type(err).__name__}: {err}); "
                                   "serving without speculation")
    return Speculation("draft", why, window=window, draft=draft)
