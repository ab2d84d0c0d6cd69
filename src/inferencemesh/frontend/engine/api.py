"""The contract between the HTTP layer and the generation engine.

The HTTP layer (frontend/openai/) speaks OpenAI; the engine speaks token ids. Keeping the boundary
this small lets the same HTTP layer drive an in-process pipeline or a remote one.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

from inferencemesh.sampling import SamplingParams

if TYPE_CHECKING:  # the type alone: grammar.py brings llguidance and torch
    from inferencemesh.frontend.engine.grammar import ConstrainedOutput


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)  # end generation, not emitted
    emit_stop_token: bool = False  # ... unless this is set: then the stop token is the last one yielded
    # vLLM's extra sampling parameters (semantics in inferencemesh.sampling.adjust).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # stop_token_ids cannot end generation before this many tokens
    # None: no logprobs; k: each generated token's logprob and its k most likely alternatives.
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (echo), on the first Step
    # Structured output: a grammar every choice's tokens follow (grammar.py); None: free text.
    constrained: ConstrainedOutput | None = None

    def sampling_params(self, seed: int) -> SamplingParams:
        """What the last stage (and a draft model) sample with."""
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=seed,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias, min_tokens=self.min_tokens,
            stop_token_ids=tuple(sorted(self.stop_token_ids)), prompt_tokens=len(self.prompt_ids),
        )


def choice_seed(seed: int, index: int) -> int:
    """The sampling seed of choice `index` of a request sampled with `seed` (n > 1). Choice 0 keeps
    the request's seed, so the first of n is what n = 1 gives; the others get seeds derived from
    (seed, index), so choice j draws what a request alone with seed choice_seed(seed, j) draws
    (the n choices run side by side, so their logits may differ in the last bits from a run
    alone: README, `seed`)."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits, like the seeds the engine draws


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model's raw output, and the most likely alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), most likely first


FinishReason = Literal["stop", "length"]


class Step(list):
    """What the engine yields: newly decided token ids (a list[int], as always) and, when the
    request asked, their logprobs (one per token) and, on the first step, the prompt's (None
    for its first token, which nothing predicts).

    The engine guarantees, for every choice that ends without an error (stopping.py decides):
    - its Steps hold at most max_tokens tokens in all (fewer when the model's context leaves
      less room after the prompt): a caller never clips them again;
    - its last Step says why it ended (finish_reason): "stop" when a stop token ended it,
      "length" when max_tokens or the model's context did; every other Step has None. The HTTP
      layer only adds its own "stop" for a stop string, which it finds in the text.

    The first Step also says how many of the prompt's tokens the prefix cache supplied
    (cached_tokens: cached KV blocks reused, not computed), as usage reports them; 0 on
    every other Step, and on the choices sharing the first's prompt blocks (the prompt counts once)."""

    def __init__(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None,
                 prompt_logprobs: list[TokenLogprob | None] | None = None,
                 finish_reason: FinishReason | None = None, cached_tokens: int = 0) -> None:
        super().__init__(tokens)
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs
        self.finish_reason = finish_reason
        self.cached_tokens = cached_tokens


class ChoiceStream:
    """One of Engine.generate_n's continuations: an async iterator of Steps that runs `release`
    exactly once, when it ends, fails or is closed (aclose), started or not: an async generator
    closed before its first step would never run its `finally`, and its session would leak."""

    def __init__(self, steps: AsyncIterator[Step], release: Callable[[], Awaitable[None]]) -> None:
        self._steps, self._release = steps, release
        self._closed = False

    def __aiter__(self) -> ChoiceStream:
        return self

    async def __anext__(self) -> Step:
        if self._closed:
            raise StopAsyncIteration
        try:
            return await self._steps.__anext__()
        except (StopAsyncIteration, Exception):
            await self.aclose()
            raise

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            aclose = getattr(self._steps, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            await self._release()


async def single_choice(engine: Engine, request: GenerationRequest) -> AsyncIterator[Step]:
    """Engine.generate in terms of generate_n: the one choice of n = 1, released when done."""
    choice = (await engine.generate_n(request, 1))[0]
    try:
        async for step in choice:
            yield step
    finally:
        await choice.aclose()


class Engine(Protocol):
    model_name: str
    max_context: int

    def generate(self, request: GenerationRequest) -> AsyncIterator[Step]:
        """Yield newly decided token ids (one or more per step) until max_tokens or a stop token;
        the last Step carries the finish_reason. A request for prompt logprobs gets them on the
        first Step, which may hold no tokens (max_tokens 0: prompt scoring only). Called without
        await: admission errors come with the first step.

        Closing the iterator early (aclose) cancels the request and releases its session.
        """
        ...

    async def generate_n(self, request: GenerationRequest, n: int) -> list[ChoiceStream]:
        """n continuations of one prompt, the prompt computed once where the engine can. Choice j
        samples with choice_seed(seed, j) and yields what generate() yields for the request with
        that seed (each with the prompt's logprobs, when asked, on its first Step). Admission
        errors are raised here; the caller closes every iterator (aclose), started or not, which
        releases its session.
        """
        ...

    async def generate_batch(self, requests: Sequence[GenerationRequest], n: int) -> list[ChoiceStream]:
        """generate_n for several prompts at once (a completions request's prompt list): request
        i's choice j at i * n + j. Its sessions are admitted together, in arrival order, never
        part of them while waiting for the rest; a batch larger than the engine's concurrent
        sessions is refused at once (InvalidRequest), never left waiting.
        """
        ...

    async def is_ready(self) -> bool: ...

    def describe(self) -> dict:
        """Metadata for /v1/models: e.g. the resolved speculative strategy and why."""
        ...

    async def close(self) -> None: ...
