"""run_bench: the model under test, its speculation set-ups, then the benchmark the flags choose."""

from __future__ import annotations

import torch

from inferencemesh.flags import ConfigError
from inferencemesh.modeling.loader import resolve_device
from inferencemesh.programs.bench.config import BenchConfig
from inferencemesh.programs.bench.models import MAX_CONTEXT, load_bench_model
from inferencemesh.programs.bench.report import write_report
from inferencemesh.programs.bench.runners import speculation_setups


def run_bench(config: BenchConfig) -> int:
    from transformers import AutoModelForCausalLM

    from inferencemesh.programs.bench.concurrency import run_concurrency
    from inferencemesh.programs.bench.latency import run_latency
    from inferencemesh.programs.bench.multiturn import run_multi_turn
    from inferencemesh.programs.bench.structured import run_structured

    check_peers(config)
    model = load_bench_model(config)  # the process is set up by the CLI (process.set_up_process)
    print(f"bench: {model.model_dir} ({model.facts.num_layers} layers, {model.dtype}), {config.new_tokens} new "
          f"tokens, {config.repeats} repeats x {sum(len(p) for p in model.prompts.values())} prompts, torch "
          f"threads {torch.get_num_threads()}", flush=True)
    if config.multi_turn:
        return write_report(config, run_multi_turn(config, model))
    speculation = {}
    if config.speculative != ("none",):
        speculation = speculation_setups(config.speculative, model.model_dir, model.tokenizer, model.requested_dtype,
                                         MAX_CONTEXT)
    if config.structured:  # no transformers peer: it has no grammar to follow
        return write_report(config, run_structured(config, model, speculation))
    # The peer computes where the stages do (resolve_device: a GPU when there is one).
    target = AutoModelForCausalLM.from_pretrained(model.model_dir, dtype=model.dtype).eval()
    target.to(resolve_device("auto"))  # type: ignore[arg-type]  # transformers types .to() as its own wrapper
    run = run_concurrency if config.concurrency else run_latency
    return write_report(config, run(config, model, target, speculation))


def check_peers(config: BenchConfig) -> None:
    """llama.cpp is a peer of the latency bench only: refused, before anything loads, where another
    bench would run and ignore it (and its converter's path without it)."""
    others = [flag for flag, on in (("--concurrency", config.concurrency), ("--multi-turn", config.multi_turn),
                                    ("--structured", config.structured)) if on]
    if "llama-cpp" in config.peer and others:
        raise ConfigError(f"--peer llama-cpp is a peer of the latency bench only, not of {others[0]}: drop one")
    if config.llama_cpp_converter and "llama-cpp" not in config.peer:
        raise ConfigError("--llama-cpp-converter is read with --peer llama-cpp only")
