"""`inferencemesh bench`'s configuration: what it compares within one run.

Its own type, beside the bench: no other program reads these flags, and no process is started
with them (the meshes it measures get serve's configs, local_stages.py). The field group it
shares (the model's options) and the flag machinery are the programs' own (config.py, flags.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from inferencemesh.config import (
    DEFAULT_SPECULATIVE_DISABLE_BY_BATCH_SIZE,
    SPECULATIVE_STRATEGIES,
    ModelOptions,
    check_counts,
)
from inferencemesh.flags import ConfigError, flag_name, option, switch

# What `bench` can compare (its prompt sets, where a mesh's first stage runs); named here, beside
# the flags, so that a typo is a usage error before anything loads.
BENCH_PROMPT_SETS = ("code", "prose")
FIRST_STAGE_FORMS = ("embedded", "process")
BENCH_PEERS = ("hf-generate", "llama-cpp")


def _threads_or_default(text: str) -> str:
    if text != "default" and not (text.isdigit() and int(text) > 0):
        raise ValueError(f"{text!r} is neither default nor a thread count")
    return text


@dataclass(frozen=True, kw_only=True)
class BenchConfig(ModelOptions):
    """`inferencemesh bench`: tokens/s, TPOT, TTFT, per-hop overhead; with --concurrency, bursts of
    concurrent streams. Comma-separated flags compare their values within one run."""

    shape: str | None = option(None, "random-weight model of a preset shape (e.g. llama-150m)")
    stages: tuple[int, ...] = option((1, 2, 4), "stage counts", parse=int, render=str, listed=True)
    speculative: tuple[str, ...] = option(("none",), "speculation strategies", choices=SPECULATIVE_STRATEGIES,
                                          listed=True)
    prompts: tuple[str, ...] = option(("code",), "prompt sets", choices=BENCH_PROMPT_SETS, listed=True)
    new_tokens: int = option(64, "tokens each request generates", parse=int)
    repeats: int = option(3, "measured rounds (after one warm-up)", parse=int)
    concurrency: tuple[int, ...] | None = option(
        None, "stream counts (e.g. 1,8,32): bursts of concurrent streams per stage count, aggregate tok/s, "
        "TTFT and ITL percentiles, and the hf-generate-batch peer", parse=int, render=str, listed=True)
    stage_threads: tuple[str, ...] = option(
        ("default",), "with --concurrency, OpenMP threads of the stage processes to compare (default: as serve "
        "starts them, each its share of the cores), e.g. default,1", parse=_threads_or_default, listed=True)
    first_stage: tuple[str, ...] = option(
        ("embedded",), "where a mesh's first stage runs: embedded (in the frontend, here the bench process: "
        "serve's default) and/or process (a stage process of its own)", choices=FIRST_STAGE_FORMS, listed=True)
    speculative_disable_by_batch_size: int = option(
        DEFAULT_SPECULATIVE_DISABLE_BY_BATCH_SIZE, "with --concurrency, no speculation while this many streams "
        "run, as the frontend (0: always speculate)", parse=int)
    multi_turn: bool = switch("the prefix cache on and off: a conversation with a 1,500-token system prompt (TTFT "
                              "per turn), a repeated request, --concurrency conversations (default 8) sharing the "
                              "system prompt (prompt tokens the stages compute); greedy, no speculation")
    turns: int = option(6, "with --multi-turn, user turns of the conversation", parse=int)
    structured: bool = switch("structured output: decode tok/s and draft acceptance of json_schema-constrained "
                              "requests against free text, interleaved, per stage count and --speculative strategy; "
                              "greedy, one stream (--concurrency does not apply); needs a model whose vocabulary "
                              "covers its tokenizer's")
    peer: tuple[str, ...] = option(
        ("hf-generate",), "the latency bench's peers on the unsplit model: hf-generate (transformers) and/or "
        "llama-cpp (llama.cpp through llama-cpp-python, the `llama-cpp` extra: the model converted to GGUF by "
        "llama.cpp's converter, greedy on the same token ids, at the bench's threads and at each split's share of "
        "the cores; the report gets TPOT ratios against it)", choices=BENCH_PEERS, listed=True)
    llama_cpp_converter: str | None = option(
        None, "with --peer llama-cpp: llama.cpp's convert_hf_to_gguf.py, a llama.cpp checkout holding it, or an "
        "unpacked llama-cpp-python sdist (default: ~/.cache/inferencemesh/llama_cpp_python-VERSION, the installed "
        "version's sdist; see README, Benchmarks)")
    json: str | None = option(None, "write the results here")

    def check(self) -> BenchConfig:
        check_counts(self)
        if self.multi_turn and self.structured:
            raise ConfigError("--multi-turn and --structured are separate benchmarks: run one at a time")
        for name in ("new_tokens", "repeats", "turns"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{flag_name(name)} must be at least 1, not {getattr(self, name)}")
        for name in ("stages", "concurrency"):
            if any(n < 1 for n in getattr(self, name) or ()):
                raise ConfigError(f"{flag_name(name)} counts must be at least 1")
        return self
