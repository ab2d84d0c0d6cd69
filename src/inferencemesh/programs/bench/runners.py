"""What a benchmark runs requests through: our engine over a pipeline, and the `transformers`
peers on the unsplit model; and the speculation set-ups the engine is measured with."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from inferencemesh.config import DEFAULT_SPECULATIVE_DISABLE_BY_BATCH_SIZE, SpeculativeOptions

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from transformers import PreTrainedTokenizerBase

    from inferencemesh.frontend.engine.api import GenerationRequest
    from inferencemesh.frontend.engine.grammar import ConstrainedOutput
    from inferencemesh.frontend.engine.pipeline import HopPipeline
    from inferencemesh.frontend.engine.proposers.base import Proposer

    ProposerFor = Callable[[GenerationRequest], Proposer | None]


@dataclass
class Run:
    """One request: time to its first token, to its last, and the tokens it got."""

    ttft_s: float
    total_s: float
    tokens: int


@dataclass
class SpecCounter:
    """Collects what speculation proposed and got accepted (the engine's metrics interface)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    model: str = "bench"
    windows: list[int] = field(default_factory=list)

    def reset(self) -> None:
        self.drafts = self.draft_tokens = self.accepted = 0
        self.windows.clear()

    def record_verify_round(self, draft_tokens: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += draft_tokens
        self.accepted += accepted

    def set_window_size(self, k: int) -> None:
        self.windows.append(k)

    def set_auto_state(self, state: str) -> None:
        pass

    def set_speculative_strategy(self, strategy: str, reason: str) -> None:
        pass


class HfPeer:
    """`transformers` generate() on the unsplit model: plain, assisted or prompt lookup."""

    def __init__(self, model: Any, new_tokens: int, **generate_kwargs: Any) -> None:  # a transformers causal LM
        self.model, self.new_tokens, self.kwargs = model, new_tokens, generate_kwargs

    async def run(self, ids: list[int]) -> Run:
        x = torch.tensor([ids], device=self.model.device)
        with torch.inference_mode():
            started = time.perf_counter()
            self.model.generate(x, max_new_tokens=1, do_sample=False, pad_token_id=0)
            ttft = time.perf_counter() - started
            started = time.perf_counter()
            out = self.model.generate(x, max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens,
                                      do_sample=False, pad_token_id=0, **self.kwargs)
            generated = out.shape[1] - len(ids)
            out.tolist()  # waits for the device's last step
            total = time.perf_counter() - started
        return Run(ttft, total, generated)


class EngineUnderTest:
    """Our engine over one pipeline (in-process or stage processes), with one speculation strategy."""

    def __init__(self, pipeline: HopPipeline, new_tokens: int, max_context: int,
                 proposer_for: ProposerFor | None = None,
                 speculative_disable_by_batch_size: int = DEFAULT_SPECULATIVE_DISABLE_BY_BATCH_SIZE,
                 prefix_cache: bool = False, constrained: ConstrainedOutput | None = None,
                 stop_token_ids: frozenset[int] = frozenset()) -> None:
        from inferencemesh.frontend.engine.engine import EngineOptions, PipelineEngine

        # Off unless asked: the latency and concurrency benchmarks repeat their prompts round after
        # round, and a prefix cache would skip the prefills they measure.
        options = EngineOptions("bench", max_context=max_context, prefix_cache=prefix_cache,
                                speculative_disable_by_batch_size=speculative_disable_by_batch_size)
        self.engine = PipelineEngine(pipeline, options, proposer_for=proposer_for)
        self.new_tokens = new_tokens
        # Structured output (structured.py): every request follows this grammar, ended by these ids.
        self.constrained, self.stop_token_ids = constrained, stop_token_ids
        self.count = 0

    async def run(self, ids: list[int]) -> Run:
        started = time.perf_counter()
        arrivals = await self.stream(ids)
        return Run(arrivals[0][0] - started, arrivals[-1][0] - started, sum(n for _, n in arrivals))

    async def stream(self, ids: list[int]) -> list[tuple[float, int]]:
        """One greedy request: (time, tokens) of each delivery, as a streaming client sees them."""
        return [(time.perf_counter(), len(tokens)) async for tokens in self.steps(ids)]

    def steps(self, ids: list[int]) -> AsyncIterator[list[int]]:
        """One greedy request's deliveries: the tokens of each step."""
        from inferencemesh.frontend.engine.api import GenerationRequest

        self.count += 1
        return self.engine.generate(GenerationRequest(f"bench-{self.count}", ids, self.new_tokens, temperature=0.0,
                                                      stop_token_ids=self.stop_token_ids,
                                                      constrained=self.constrained))


def speculation_setups(strategies: tuple[str, ...], model_dir: Path, tokenizer: PreTrainedTokenizerBase, dtype: str,
                       max_context: int) -> dict:
    """Each strategy other than none, resolved as the frontend resolves it."""
    from inferencemesh.frontend.engine.proposers.build import resolve_speculation

    setups = {}
    for strategy in strategies:
        if strategy == "none":
            continue
        setups[strategy] = resolve_speculation(SpeculativeOptions(speculative=strategy), model_dir, tokenizer,
                                               dtype=dtype, max_context=max_context)
        print(f"  speculative {strategy}: {setups[strategy].strategy} ({setups[strategy].reason})", flush=True)
    return setups


def proposer(setups: dict, strategy: str, counter: SpecCounter | None = None) -> ProposerFor | None:
    """The engine's proposer_for for `strategy` (None: no speculation), counting into `counter`."""
    if strategy == "none":
        return None
    return setups[strategy].with_metrics(counter or SpecCounter()).proposer_for
