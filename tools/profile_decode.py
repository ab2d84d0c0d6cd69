"""Where a decoded token's time goes: one stage in-process (the frontend's engine, the stage's
service and worker, the runtime and its layers), greedy, one request at a time.

For each configuration (transformers' decoder layers, then the lean ones: modeling/lean_layers.py),
interleaved round by round: TPOT (median inter-token gap), the thread's CPU time per token, the
Python calls per token, and a cProfile of one request with its own time grouped by where it is
spent (torch kernels, the model's Python, the stage, the frontend's engine, the event loop).
With --ops, also torch.profiler's self CPU time per token of the busiest operators (the matmuls
against the rest, and what each costs at this thread count).

    python tools/profile_decode.py [--shape llama-150m] [--threads 1] [--tokens 128] [--ops] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import statistics
import time
from pathlib import Path

import torch

from inferencemesh.modeling.runtime import StageRuntime
from inferencemesh.programs.bench.config import BenchConfig
from inferencemesh.programs.bench.models import load_bench_model
from inferencemesh.programs.bench.runners import EngineUnderTest
from inferencemesh.programs.mesh import in_process_pipeline

MAX_CONTEXT = 2048
# A profile entry's file (or built-in's name) -> the part of the path it belongs to, first match.
PARTS = (("kernels", ("built-in method torch", "of 'torch._C", "torch/_ops")),
         ("model", ("inferencemesh/modeling", "transformers/", "torch/nn/", "torch/_tensor", "torch/functional")),
         ("stage", ("inferencemesh/stage", "inferencemesh/sampling", "inferencemesh/protocol")),
         ("frontend", ("inferencemesh/frontend", "inferencemesh/programs")),
         ("event loop", ("asyncio/",)))


def part_of(where: str) -> str:
    for part, needles in PARTS:
        if any(n in where for n in needles):
            return part
    return "other"


async def tokens(engine: EngineUnderTest, prompt: list[int]) -> tuple[float, float]:
    """One request: (median inter-token gap, thread CPU per token), seconds."""
    cpu = time.thread_time()
    arrivals = await engine.stream(prompt)
    gaps = [b[0] - a[0] for a, b in zip(arrivals[1:], arrivals[2:], strict=False)]
    return statistics.median(gaps), (time.thread_time() - cpu) / max(1, sum(n for _, n in arrivals))


async def profile(engine: EngineUnderTest, prompt: list[int], count: int) -> dict:
    profiler = cProfile.Profile()
    profiler.enable()
    await engine.stream(prompt)
    profiler.disable()
    stats = pstats.Stats(profiler)
    own: dict[str, float] = {}
    calls = 0
    for (path, line, name), (_, ncalls, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        calls += ncalls
        where = f"{path}:{line}({name})" if path != "~" else name
        own[part_of(where)] = own.get(part_of(where), 0.0) + tottime
    total = sum(own.values())
    return {"python_calls_per_token": round(calls / count), "own_time_share": {
        k: round(v / total, 3) for k, v in sorted(own.items(), key=lambda kv: -kv[1])}}


async def operators(engine: EngineUnderTest, prompt: list[int], count: int, top: int = 12) -> dict:
    """torch.profiler over one request: the `top` operators by self CPU time, per token (the
    profiler's own cost included, so the shares matter more than the sums)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        await engine.stream(prompt)
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in rows)
    return {"ops_self_cpu_ms_per_token": round(total / count / 1e3, 3), "ops": {
        e.key: {"calls_per_token": round(e.count / count, 1),
                "self_cpu_us_per_token": round(e.self_cpu_time_total / count, 1)} for e in rows[:top]}}


def streaming_read_gb_per_s(mib: int = 256, rounds: int = 10) -> float:
    """This machine's memory bandwidth now, at torch's thread count: a sum over a buffer far larger
    than the caches (a decode step streams its weights much as this does; neighbours on a shared host
    move it by 20% within minutes, so it is measured in the same run)."""
    buffer = torch.ones(mib * 2**20 // 4)
    buffer.sum()
    started = time.perf_counter()
    for _ in range(rounds):
        buffer.sum()
    return round(buffer.numel() * 4 * rounds / (time.perf_counter() - started) / 1e9, 1)


async def run(args: argparse.Namespace) -> dict:
    config = BenchConfig(dtype=args.dtype, shape=args.shape, stages=(1,), new_tokens=args.tokens).check()
    model = load_bench_model(config)
    prompt = next(ids for prompts in model.prompts.values() for ids in prompts)
    engines = {}
    for name, lean in (("transformers-layers", False), ("lean-layers", True)):
        runtime = StageRuntime(model.model_dir, 0, model.facts.num_layers, dtype=model.dtype_name,
                               max_context=MAX_CONTEXT, lean=lean)
        engines[name] = EngineUnderTest(in_process_pipeline([runtime]), args.tokens, MAX_CONTEXT)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for round_index in range(args.rounds + 1):  # round 0 warms up
        for name, engine in engines.items():
            got = await tokens(engine, prompt)
            if round_index:
                samples[name].append(got)
    results = {}
    for name, engine in engines.items():
        results[name] = {
            "tpot_ms": round(statistics.median(s[0] for s in samples[name]) * 1e3, 3),
            "thread_cpu_ms_per_token": round(statistics.median(s[1] for s in samples[name]) * 1e3, 3),
            **await profile(engine, prompt, args.tokens),
            **(await operators(engine, prompt, args.tokens) if args.ops else {})}
        print(name, json.dumps(results[name]), flush=True)
    return {"model": str(model.model_dir.name), "shape": args.shape, "dtype": args.dtype, "threads": args.threads,
            "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"), "streaming_read_gb_per_s": streaming_read_gb_per_s(),
            "new_tokens": args.tokens, "rounds": args.rounds, "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default=None, help="a bench preset shape (default: the bundled model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ops", action="store_true", help="torch.profiler's self time per token by operator")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = asyncio.run(run(args))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
