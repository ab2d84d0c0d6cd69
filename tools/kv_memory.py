"""KV memory held ÷ KV memory the live tokens need (issue 35: "<= 1.1, blocks' tail waste only"),
sampled while many requests of mixed lengths run at once on a real 2-stage mesh (stage processes
as `serve` starts them, the engine in this process).

    python tools/kv_memory.py [--shape llama-150m | --model DIR] [--requests 48] [--json OUT]

Every SAMPLE_S while requests run: the pool's blocks in use (referenced by a session or a frame in
flight) x 16 positions, against the positions the running sessions' frames have reached (their
live keys and values). Distinct prompts, so that the ratio is the allocator's own overhead (a
shared prefix would push it below 1). For scale, what the old design reserved for the same
sessions: max_context positions each.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
from pathlib import Path

import torch
from kv_hit_cost import emit  # tools/ is not a package: run from the repository as tools/kv_memory.py

from inferencemesh.programs.bench.config import BenchConfig
from inferencemesh.programs.bench.mesh import meshes, start_mesh
from inferencemesh.programs.bench.models import load_bench_model
from inferencemesh.programs.bench.runners import EngineUnderTest

SAMPLE_S = 0.01
CONTEXT = 2048
TARGET = 1.1


async def measure(engine: EngineUnderTest, prompts: list[list[int]]) -> list[tuple[int, int, int]]:
    """(blocks in use, live positions, sessions) every SAMPLE_S while the requests run."""
    room = engine.engine.room
    samples: list[tuple[int, int, int]] = []

    async def sample() -> None:
        while True:
            live = sum(getattr(h, "positions", 0) for h in room.running)
            if live:
                samples.append((room.manager.used, live, len(room.running)))
            await asyncio.sleep(SAMPLE_S)

    sampler = asyncio.create_task(sample())
    await asyncio.gather(*(engine.run(p) for p in prompts))
    sampler.cancel()
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--shape", help="a bench shape (random weights)")
    where.add_argument("--model", help="a local checkpoint folder (default: the bundled code model)")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    model = load_bench_model(BenchConfig(model=args.model, shape=args.shape, stages=(2,)))
    rng = random.Random(0)
    vocab = model.facts.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(40, 900))] for _ in range(args.requests)]
    with meshes() as started:
        mesh = start_mesh(model.model_dir, model.dtype_name, 2, CONTEXT, first_stage="embedded")
        started.append(mesh)
        torch.set_num_threads(mesh.threads)
        engine = EngineUnderTest(mesh.pipeline, args.new_tokens, CONTEXT, prefix_cache=True)
        samples = asyncio.run(measure(engine, prompts))
    block = engine.engine.room.manager.block_tokens
    ratios = [used * block / live for used, live, _ in samples]
    busy = [r for r, (_, _, n) in zip(ratios, samples, strict=True) if n >= args.requests // 2]
    report = {"issue": 35, "model": str(args.shape or model.model_dir), "requests": args.requests,
              "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))], "new_tokens": args.new_tokens,
              "samples": len(samples), "most_running": max(n for _, _, n in samples),
              "held_over_live_mean": round(statistics.mean(ratios), 4), "held_over_live_max": round(max(ratios), 4),
              "held_over_live_mean_half_running": round(statistics.mean(busy), 4) if busy else None,
              "reservation_over_live_mean": round(statistics.mean(n * CONTEXT / live for _, live, n in samples), 2),
              "target": f"KV held / KV the live tokens need <= {TARGET}",
              "pass": max(ratios) <= TARGET, "torch": torch.__version__}
    return emit(report, args.json)


if __name__ == "__main__":
    sys.exit(main())
