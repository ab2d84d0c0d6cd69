"""A small but real Engine for the HTTP tests: a transformers causal LM, one token per step.

It implements the frontend's Engine protocol (inferencemesh.frontend.engine.api) in-process:
prefill, then decode with a per-request KV cache in a worker thread (asyncio.to_thread), sampling
with the stages' own inferencemesh.sampling (so every sampling control means the same here),
stop token ids, max_tokens and logprobs (prompt ones too); n continuations prefill the prompt
once and copy its cache. It also keeps count of open sessions so tests can prove that the HTTP
layer releases them.

The model is the bundled code target when it exists (inferencemesh/bundled/imesh-code-target,
or /tmp/bundled/imesh-code-target while it is being trained), else a tiny random Llama with a
byte-level BPE tokenizer trained here in a second, shaped like the bundled one (same special
tokens and chat template). INFERENCEMESH_TEST_MODEL=tiny forces the tiny one.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import os
import random
import socket
import sys
import sysconfig
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import uvicorn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from inferencemesh.bundled import bundled_path
from inferencemesh.frontend.engine.api import (
    ChoiceStream,
    GenerationRequest,
    Step,
    TokenLogprob,
    choice_seed,
    single_choice,
)
from inferencemesh.frontend.engine.errors import ContextLengthExceeded, EngineError, EngineOverloaded, InvalidRequest
from inferencemesh.frontend.engine.stopping import ChoiceStopping, StopRule
from inferencemesh.frontend.openai.http_server import server_config
from inferencemesh.sampling import logprobs, next_token

# the bundled models' training script, whose tokenizer recipe the tiny fallback reuses
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

BUNDLED_TARGET = "imesh-code-target"


class EngineNotReady(EngineError):
    """The fixture's not-ready answer (a pipeline engine answers not-ready through is_ready)."""

    status_code = 503
    error_type = "service_unavailable"
    code = "not_ready"


class TransformersEngine:
    """Engine protocol over a Hugging Face causal LM held in this process."""

    def __init__(self, model: PreTrainedModel, *, model_name: str, max_context: int | None = None,
                 max_sessions: int = 64, step_delay_s: float = 0.0, fail_after_tokens: int | None = None) -> None:
        self.model = model.eval()
        self.model_name = model_name
        self.max_context = max_context or int(model.config.max_position_embeddings)
        self.max_sessions = max_sessions  # beyond this, EngineOverloaded (HTTP 429)
        self.ready = True  # tests flip it to exercise 503
        self.step_delay_s = step_delay_s  # pause between decode steps (makes disconnect tests deterministic)
        # Fault injection: raise EngineError after this many tokens, as a pipeline does when a stage is lost.
        self.fail_after_tokens = fail_after_tokens
        self.open_sessions = 0
        self.peak_sessions = 0  # most sessions open at once: proves requests interleaved
        self.released: dict[str, int] = {}  # request_id -> tokens yielded, recorded when the session ends

    async def is_ready(self) -> bool:
        return self.ready

    def describe(self) -> dict:
        return {"engine": "transformers-fixture", "stages": 1,
                "speculative": {"strategy": "none", "reason": "the test fixture engine does not speculate"}}

    async def close(self) -> None:
        self.ready = False

    def generate(self, request: GenerationRequest) -> AsyncIterator[Step]:
        return single_choice(self, request)

    async def generate_n(self, request: GenerationRequest, n: int) -> list[ChoiceStream]:
        return await self.generate_batch([request], n)

    async def generate_batch(self, requests: list[GenerationRequest], n: int) -> list[ChoiceStream]:
        """Every request's n choices, admitted together or refused (no queue: beyond the limit, 429)."""
        if not self.ready:
            raise EngineNotReady("the engine is not ready")
        total = len(requests) * n
        if total > max(1, self.max_sessions):  # never servable (n = 1 beyond the limit is overload: 429)
            raise InvalidRequest(f"{total} sequences; the limit is {self.max_sessions}",
                                 param="n" if len(requests) == 1 else "prompt")
        if self.open_sessions + total > self.max_sessions:
            raise EngineOverloaded(f"{self.open_sessions} sessions open, the limit is {self.max_sessions}")
        for request in requests:
            if request.constrained is not None:  # never accepted and ignored: this engine has no sampler hook
                raise InvalidRequest("the fixture engine does not constrain output",
                                     param=request.constrained.constraint.param)
            if len(request.prompt_ids) + request.max_tokens > self.max_context:
                raise ContextLengthExceeded(f"{len(request.prompt_ids)} + {request.max_tokens} > {self.max_context}")
        started: list[ChoiceStream] = []
        try:
            for request in requests:
                started += await self._start(request, n)
        except BaseException:
            for choice in started:
                await choice.aclose()
            raise
        return started

    async def _start(self, request: GenerationRequest, n: int) -> list[ChoiceStream]:
        self.open_sessions += n
        self.peak_sessions = max(self.peak_sessions, self.open_sessions)
        try:
            session = _Session(self.model)
            rows = await asyncio.to_thread(session.forward, list(request.prompt_ids))
        except BaseException:
            self.open_sessions -= n
            raise
        prompt_logprobs = None
        if request.prompt_logprobs is not None:
            prompt_logprobs = [None, *_entries(rows[:-1], request.prompt_ids[1:], request.prompt_logprobs)]
        seed = request.seed if request.seed is not None else random.getrandbits(63)
        choices = []
        for j in range(n):  # the prompt's cache computed once, copied for every other choice
            name = request.request_id if j == 0 else f"{request.request_id}/{j}"
            produced = [0]
            steps = self._decode(replace(request, seed=choice_seed(seed, j)), session if j == 0 else session.fork(),
                                 rows[-1], prompt_logprobs, produced)
            choices.append(ChoiceStream(steps, lambda name=name, produced=produced: self._release(name, produced[0])))
        return choices

    async def _release(self, name: str, produced: int) -> None:
        self.open_sessions -= 1
        self.released[name] = produced

    async def _decode(self, request: GenerationRequest, session: _Session, logits: torch.Tensor,
                      prompt_logprobs: list[TokenLogprob | None] | None, produced: list[int]) -> AsyncIterator[Step]:
        """Steps from the prompt's last logits on; produced[0] counts the tokens yielded."""
        params = request.sampling_params(request.seed)
        history = list(request.prompt_ids)
        stopping = ChoiceStopping(StopRule.of(request, self.max_context))  # the engine's own rule
        while True:
            decided = [next_token(logits, params, len(history), history)] if stopping.yielded < stopping.rule.budget \
                else []
            cut = stopping.cut(decided)
            kept = decided[:cut.count]
            produced[0] += len(kept)
            history.extend(kept)
            lps = None if request.logprobs is None or not kept else _entries(logits[None], kept, request.logprobs)
            yield Step(kept, lps, prompt_logprobs, finish_reason=cut.finish_reason)
            prompt_logprobs = None
            if cut.finish_reason is not None:
                return
            if self.fail_after_tokens is not None and produced[0] >= self.fail_after_tokens:
                raise EngineError("stage 1 was lost mid-generation")
            if self.step_delay_s:
                await asyncio.sleep(self.step_delay_s)
            logits = (await asyncio.to_thread(session.forward, kept))[-1]


def _entries(rows: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    return [TokenLogprob(t, lp, tuple(zip(ids, lps, strict=True))) for t, lp, ids, lps in logprobs(rows, tokens, top)]


class _Session:
    """One request's KV cache."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.cache = None

    def fork(self) -> _Session:
        """A session holding a copy of this one's cache."""
        twin = _Session(self.model)
        twin.cache = copy.deepcopy(self.cache)
        return twin

    def forward(self, ids: list[int]) -> torch.Tensor:
        """float32 logits of every row of `ids`."""
        with torch.inference_mode():
            # transformers 5 names the argument `cache` (the old name warns on every call)
            cache_kwarg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
            out = self.model(input_ids=torch.tensor([ids]), **{cache_kwarg: self.cache}, use_cache=True)
        self.cache = out.past_key_values
        return out.logits[0].float()


# --- models ------------------------------------------------------------------------------------


@dataclass
class FixtureModel:
    engine: TransformersEngine
    tokenizer: PreTrainedTokenizerBase
    name: str  # the served model name


def bundled_target_dir() -> Path | None:
    try:
        packaged: Path | None = bundled_path(BUNDLED_TARGET)
    except FileNotFoundError:
        packaged = None
    for path in (packaged, Path("/tmp/bundled") / BUNDLED_TARGET):
        if path is not None and (path / "config.json").is_file() and any(path.glob("*.safetensors")):
            return path
    return None


def tiny_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a few standard-library modules by the bundled models' own recipe."""
    from train_bundled_models import train_tokenizer, wrap_tokenizer

    root = Path(sysconfig.get_paths()["stdlib"])
    texts = [(root / name).read_text(encoding="utf-8") for name in ("textwrap.py", "string.py", "shlex.py")]
    return wrap_tokenizer(train_tokenizer(texts, vocab_size))


def tiny_model(tokenizer: PreTrainedTokenizerBase, max_context: int = 256, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_context,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    # The default 0.02-std init makes a model that repeats one token forever; wider, untied
    # embeddings give varied text (including byte tokens that split UTF-8 characters).
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 0.5)
        model.lm_head.weight.normal_(0.0, 0.5)
    return model.eval()


def build_fixture_model(**engine_kwargs) -> FixtureModel:
    """The one place tests get their engine: switch it here (e.g. to the pipeline engine)."""
    path = None if os.environ.get("INFERENCEMESH_TEST_MODEL") == "tiny" else bundled_target_dir()
    if path is not None:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        name = BUNDLED_TARGET
    else:
        tokenizer = tiny_tokenizer()
        model = tiny_model(tokenizer)
        name = "tiny-random-llama"
    return FixtureModel(TransformersEngine(model, model_name=name, **engine_kwargs), tokenizer, name)


# --- a real HTTP server ------------------------------------------------------------------------


@contextlib.contextmanager
def serve(app, **limits) -> Iterator[str]:
    """Run an ASGI app under uvicorn, with the frontend's connection limits (http_server.server_config,
    `limits` overriding them), on a free loopback port in a background thread; yield its URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(server_config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2,
                                          **limits))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"uvicorn-{port}")
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
