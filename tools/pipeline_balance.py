"""How the split of layers between stages shows in a long prompt's time to first token and in
decode: `inferencemesh serve` with its default plan (no memory budget: the layers' compute
balanced) against the plan balanced by memory (what a budget that does not bind gives, and the
default before), and transformers' single forward of the same prompt in this process.

    python tools/pipeline_balance.py --json docs/benchmarks/pipeline-balance.json

Rounds interleave the three (the machine is noisy); each serve run measures TTFT of fresh
prompts (no two alike: the prefix cache finds nothing) and one stream's decode rate.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import torch
from serve_probe import decode_rate, serving, ttft

from inferencemesh.bundled import resolve_model

VARIANTS = {"balanced compute (default)": [], "balanced memory (--stage-memory 64Gi)": ["--stage-memory", "64Gi"]}


def plan_of(flags: list[str]) -> list[list[int]]:
    out = subprocess.run([sys.executable, "-m", "inferencemesh", "plan", "--json", *flags],
                         capture_output=True, text=True, check=True).stdout
    return [[s["layer_start"], s["layer_end"]] for s in json.loads(out)["stages"]]


def transformers_forward(model: str, tokens: int) -> float:
    from transformers import AutoModelForCausalLM

    peer = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.randint(10, 4000, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        peer(ids, use_cache=True)  # warm
        start = time.perf_counter()
        peer(ids, use_cache=True)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--port", type=int, default=18441)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    model = resolve_model(None)
    results: dict[str, dict[str, list[float]]] = {v: {"ttft_s": [], "decode_tok_s": []} for v in VARIANTS}
    peer: list[float] = []
    for round_index in range(args.rounds):
        peer.append(round(transformers_forward(model, args.tokens), 4))
        for name, flags in VARIANTS.items():
            with serving(args.port, *flags) as base:
                for i in range(4):  # the first warms up
                    prompt = [(7 * j + 13 * i + 101 * round_index) % 3990 + 10 for j in range(args.tokens)]
                    took = ttft(base, prompt)
                    if i:
                        results[name]["ttft_s"].append(round(took, 4))
                results[name]["decode_tok_s"].append(round(decode_rate(base, "def main():", args.decode_tokens), 2))
            print(f"round {round_index}: {name}: TTFT {results[name]['ttft_s'][-3:]} s, "
                  f"decode {results[name]['decode_tok_s'][-1]} tok/s; transformers forward {peer[-1]} s", flush=True)
    best_peer = min(peer)
    report = {"model": Path(model).name, "prompt_tokens": args.tokens, "cpus": os.cpu_count(),
              "transformers_forward_s": peer, "variants": {}}
    for name, flags in VARIANTS.items():
        r = results[name]
        report["variants"][name] = {
            "flags": flags, "plan": plan_of(flags), **r, "median_ttft_s": median(r["ttft_s"]),
            "ttft_over_transformers": round(median(r["ttft_s"]) / best_peer, 3),
            "median_decode_tok_s": median(r["decode_tok_s"])}
        print(f"{name:40} plan {report['variants'][name]['plan']}  TTFT {median(r['ttft_s']):.3f} s "
              f"({median(r['ttft_s']) / best_peer:.2f}x transformers {best_peer:.3f} s)  "
              f"decode {median(r['decode_tok_s']):.1f} tok/s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
