"""Building what the speculation decision names: inferencemesh.speculation decides which strategy
runs (shared with the operator); this module loads what it names (the draft model) and makes
each request's proposer.

- draft: a small model with the target's tokenizer runs here and proposes k tokens.
- ngram: prompt lookup, the continuation of the latest earlier match of the suffix.
- auto: n-gram, but only where it pays (see proposers.ngram.AutoProposer).
- none.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from inferencemesh.checkpoint.facts import CheckpointFacts
from inferencemesh.checkpoint.read import fetch_config_dir
from inferencemesh.config import SpeculativeOptions
from inferencemesh.frontend.engine.api import GenerationRequest
from inferencemesh.frontend.engine.proposers.base import Proposer
from inferencemesh.frontend.engine.proposers.draft import DraftBatcher, DraftProposer
from inferencemesh.frontend.engine.proposers.draft_model import DraftModel
from inferencemesh.frontend.engine.proposers.ngram import AutoProposer, NgramProposer, favourable_prompt
from inferencemesh.speculation import SpeculativeChoice, WindowPolicy, choose_for_model

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from inferencemesh.frontend.engine.metrics import FrontendMetrics

log = logging.getLogger("inferencemesh.speculative")


def same_vocabulary(target_tokenizer: PreTrainedTokenizerBase, draft_dir: Path) -> str | None:
    """None when the draft shares the target's vocabulary, else the reason it does not."""
    from transformers import AutoTokenizer

    draft_tokenizer = AutoTokenizer.from_pretrained(draft_dir)
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        return "the draft's tokenizer vocabulary differs from the target's"
    return None


class Speculation:
    """The strategy this frontend runs (a SpeculativeChoice) and what it needs: the draft model,
    the metrics, the tokenizer (auto looks at the prompt's text)."""

    def __init__(self, choice: SpeculativeChoice, draft: DraftModel | None = None,
                 metrics: FrontendMetrics | None = None, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        self.choice, self.draft, self.metrics, self.tokenizer = choice, draft, metrics, tokenizer
        self.batcher = DraftBatcher()  # shared by the requests of this strategy
        if metrics is not None:
            metrics.set_speculative_strategy(choice.strategy, choice.reason)
            metrics.set_window_size(choice.window.initial if choice.strategy != "none" else 0)

    def with_metrics(self, metrics: FrontendMetrics | None) -> Speculation:
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
            text = str(self.tokenizer.decode(request.prompt_ids[-512:])) if self.tokenizer is not None else ""
            return AutoProposer(self.window, favourable_prompt(text), self.metrics)
        params = request.sampling_params(request.seed or 0)
        assert self.draft is not None  # strategy "draft" is built only with its draft loaded
        return DraftProposer(self.draft, self.window, params, self.metrics, self.batcher)


def resolve_speculation(options: SpeculativeOptions, model_dir: Path, tokenizer: PreTrainedTokenizerBase,
                        metrics: FrontendMetrics | None = None, *,
                        dtype: str = "auto", device: str = "auto", max_context: int = 2048) -> Speculation:
    """Decide (inferencemesh.speculation) and load what the decision names; a draft that cannot be
    loaded turns into serving without speculation, never into a failed start-up."""
    choice = choose_for_model(model_dir, strategy=options.speculative, draft=options.draft,
                              no_draft=options.no_draft, window=options.window)
    draft = None
    if choice.strategy == "draft" and choice.draft is not None:
        try:
            draft = _load_draft(choice.draft, tokenizer, dtype=dtype, device=device, max_context=max_context,
                                vocab_size=_vocab_size(model_dir))
        except Exception as err:  # serve without speculation, and say why
            log.warning("draft model %s unusable, serving without speculation: %s", choice.draft, err)
            choice = choice.without_draft(f"{type(err).__name__}: {err}")
    return Speculation(choice, draft, metrics, tokenizer)


def _vocab_size(model_dir: Path) -> int | None:
    """The target's padded vocabulary (config.json's vocab_size), or None when it cannot be read."""
    try:
        return CheckpointFacts(json.loads((Path(model_dir) / "config.json").read_text())).vocab_size
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _load_draft(source: str, tokenizer: PreTrainedTokenizerBase, *, dtype: str, device: str, max_context: int,
                vocab_size: int | None) -> DraftModel:
    draft_dir = Path(source)
    if not draft_dir.exists():
        draft_dir = fetch_config_dir(source)
    mismatch = same_vocabulary(tokenizer, draft_dir)
    if mismatch:
        raise ValueError(mismatch)
    draft = DraftModel(str(draft_dir), dtype=dtype, device=device, max_context=max_context, vocab_size=vocab_size)
    if draft.embedding_rows != draft.vocab_size:
        log.info("draft %s pads its embedding to %d rows, the target to %d: its proposals are fitted to the "
                 "target's", source, draft.embedding_rows, draft.vocab_size)
    return draft
