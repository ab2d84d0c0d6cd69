"""Prefill speed per dtype: the stage runtime against transformers' own forward of the same
layers, and the time to first token of `inferencemesh serve` with its defaults.

    python tools/prefill_dtypes.py --json docs/benchmarks/prefill-dtypes.json

Part 1 runs a whole model as one stage and as transformers' AutoModelForCausalLM, in each dtype,
taking turns round by round (the machine is noisy), and reports the best of each; the ratio
transformers ÷ stage should be at least 1. Part 2 starts `inferencemesh serve` (its defaults:
`--dtype auto`, 2 stages, the first embedded) and asks for one streamed token of a long prompt,
several times, reporting each TTFT. The CPU's flags and the dtype `auto` chose are in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
from serve_probe import serving, ttft

from inferencemesh.bundled import resolve_model
from inferencemesh.checkpoint.read import read_local
from inferencemesh.compute_dtype import choose_dtype, cpu_flags


def stage_against_transformers(model: str, tokens: int, dtypes: list[str], rounds: int, threads: int) -> dict:
    from transformers import AutoModelForCausalLM

    from inferencemesh.modeling.runtime import StageRuntime

    torch.set_num_threads(threads)
    layers = read_local(model).num_layers
    stages = {d: StageRuntime(model, 0, layers, dtype=d, device="cpu", max_context=tokens + 8) for d in dtypes}
    peers = {d: AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, d)).eval() for d in dtypes}
    ids = torch.randint(0, read_local(model).vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
    times: dict[str, dict[str, list[float]]] = {d: {"stage": [], "transformers": []} for d in dtypes}
    for _ in range(rounds):
        for d in dtypes:
            start = time.perf_counter()
            stages[d].forward(stages[d].new_session(), 0, token_ids=ids)
            times[d]["stage"].append(time.perf_counter() - start)
            with torch.inference_mode():
                start = time.perf_counter()
                peers[d](ids[None], use_cache=True)
                times[d]["transformers"].append(time.perf_counter() - start)
    result = {}
    for d, t in times.items():
        best_stage, best_peer = min(t["stage"]), min(t["transformers"])
        result[d] = {"stage_s": round(best_stage, 4), "transformers_s": round(best_peer, 4),
                     "transformers_over_stage": round(best_peer / best_stage, 3),
                     "stage_runs_s": [round(x, 4) for x in t["stage"]],
                     "transformers_runs_s": [round(x, 4) for x in t["transformers"]]}
        print(f"{d:9} stage {best_stage:7.3f} s   transformers {best_peer:7.3f} s   "
              f"transformers / stage {best_peer / best_stage:5.2f}")
    return result


def serve_ttft(tokens: int, rounds: int, port: int) -> dict:
    """TTFT of a `tokens`-token prompt through `inferencemesh serve` with its defaults."""
    with serving(port) as base:
        ttfts = []
        for i in range(rounds + 1):  # the first warms up
            prompt = [(7 * j + 13 * i) % 4000 + 10 for j in range(tokens)]  # no two alike: no reuse to find
            took = ttft(base, prompt)
            if i:
                ttfts.append(round(took, 4))
    print(f"serve defaults, {tokens}-token prompt: TTFT {', '.join(f'{t:.2f}' for t in ttfts)} s")
    return {"prompt_tokens": tokens, "ttft_s": ttfts, "median_ttft_s": sorted(ttfts)[len(ttfts) // 2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: the bundled target)")
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--port", type=int, default=18431)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    model = resolve_model(args.model)
    flags = cpu_flags()
    auto = choose_dtype("auto", read_local(model).checkpoint_dtype, on_cpu=True)
    print(f"{platform.processor() or platform.machine()}: auto computes in {auto}")
    report = {
        "model": Path(model).name, "prompt_tokens": args.tokens, "threads": args.threads,
        "cpu_native_16_bit": sorted(f for f in flags if f in ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16")),
        "cpu_has_avx512f": "avx512f" in flags, "auto_dtype": auto.name, "auto_reason": auto.reason,
        "prefill": stage_against_transformers(model, args.tokens, args.dtypes.split(","), args.rounds, args.threads),
        "serve_defaults": serve_ttft(args.tokens, args.rounds, args.port) if args.model is None else None,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
