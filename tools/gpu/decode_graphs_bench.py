"""The stage's decode step eager against CUDA graphs (modeling/decode_graphs.py), in one process,
on one GPU, interleaved round by round: ms per step, aggregate tok/s, the weights' bandwidth at
batch 1, the first replay of each bucket (its capture), and whether the greedy tokens agree.

    python3 tools/gpu/decode_graphs_bench.py --shape llama-1b --json out.json
    python3 tools/gpu/decode_graphs_bench.py --shape llama-tiny --device cpu --steps 4   # a dry run here

Each batch's sessions each get a prompt of --prompt tokens in both pools, then decode --steps
tokens a round, the two pools taking turns; the tokens each pool feeds back are its own greedy
choices (bf16 kernels may round apart: their agreement is reported, not required). A stage of
the whole model, as `inferencemesh serve --stages 1` holds it; no gRPC, no frontend: the step only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from inferencemesh.checkpoint.read import read_local
from inferencemesh.modeling.kv_pool import BlockTableKV, KVPool
from inferencemesh.modeling.runtime import Segment, StageRuntime
from inferencemesh.programs.bench.models import make_shape_model

PEAK_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def prefill(runtime: StageRuntime, pool: KVPool, tables: list[list[int]], prompts: list[torch.Tensor]) -> list[int]:
    firsts = []
    for table, prompt in zip(tables, prompts, strict=True):
        logits = runtime.forward(BlockTableKV(pool, table, 0, len(prompt)), 0, token_ids=prompt)
        firsts.append(int(logits.argmax()))
    return firsts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32, help="decode steps a round, per pool")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=int, default=1, help="positions a row per step: 1 decodes; more is a "
                        "verify window's shape (the token repeated, every row's logits)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)  # a GPU stage's CPU threads (cpus.GPU_PROCESS_THREADS)
    device = torch.device(args.device)
    model_dir = make_shape_model(args.shape, args.dtype)
    facts = read_local(model_dir)
    weights = sum(t.nbytes for n, t in facts.tensors.items() if "embed_tokens" not in n)
    context = args.prompt + args.rounds * args.steps * args.window + 16
    runtime = StageRuntime(model_dir, 0, facts.num_layers, dtype=args.dtype, device=args.device, max_context=context)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BANDWIDTH.items() if k in name), None)
    report: dict = {"device": name, "torch": torch.__version__, "shape": args.shape, "dtype": args.dtype,
                    "window": args.window,
                    "weight_bytes": weights, "peak_bandwidth": peak, "rows": []}
    per_session = -(-context // 16)
    for batch in args.batches:
        blocks = batch * per_session
        eager = runtime.new_pool(blocks, decode_graphs=False)
        graphs = runtime.new_pool(blocks, decode_graphs=True)
        assert runtime._graphs is not None
        tables = [list(range(i * per_session, (i + 1) * per_session)) for i in range(batch)]
        gen = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(3, 30000 if facts.vocab_size > 30000 else facts.vocab_size - 1, (args.prompt,),
                                 generator=gen) for _ in range(batch)]
        state = {}
        for label, pool in (("eager", eager), ("graphs", graphs)):
            state[label] = {"pool": pool, "next": prefill(runtime, pool, tables, prompts), "tokens": [[] for _ in
                                                                                                       range(batch)],
                            "times": [], "first_ms": None}
        position = args.prompt
        for _ in range(args.rounds):
            for label in ("eager", "graphs"):
                s = state[label]
                pos = position
                for step in range(args.steps):
                    segments = [Segment(BlockTableKV(s["pool"], table, pos, args.window), pos,
                                        torch.tensor([token] * args.window), "all" if args.window > 1 else "last")
                                for table, token in zip(tables, s["next"], strict=True)]
                    sync(device)
                    started = time.perf_counter()
                    rows = runtime.forward_batch(segments)
                    chosen = torch.stack([row[-1] for row in rows]).argmax(-1).tolist()  # a sync, as a stage's
                    elapsed = time.perf_counter() - started
                    if s["first_ms"] is None:
                        s["first_ms"] = round(elapsed * 1e3, 2)  # graphs: the capture of the first bucket
                    elif step > 0:
                        s["times"].append(elapsed)
                    s["next"] = chosen
                    for seq, token in zip(s["tokens"], chosen, strict=True):
                        seq.append(token)
                    pos += args.window
            position += args.steps * args.window
        row: dict = {"batch": batch, "window": args.window, "captured": runtime._graphs.captured,
                     "capture_failed": runtime._graphs.failed}
        for label in ("eager", "graphs"):
            ms = statistics.median(state[label]["times"]) * 1e3
            row[label] = {"ms_per_step": round(ms, 3), "tok_s": round(batch * args.window / ms * 1e3, 1),
                          "first_step_ms": state[label]["first_ms"]}
            if batch == 1:
                row[label]["weight_GBps"] = round(weights / ms * 1e3 / 1e9, 1)
                if peak:
                    row[label]["bandwidth_share"] = round(weights / (ms / 1e3) / peak, 3)
        row["graphs_speedup"] = round(row["eager"]["ms_per_step"] / row["graphs"]["ms_per_step"], 2)
        pairs = [(a, b) for sa, sb in zip(state["eager"]["tokens"], state["graphs"]["tokens"], strict=True)
                 for a, b in zip(sa, sb, strict=True)]
        first_split = [next((i for i, (a, b) in enumerate(zip(sa, sb, strict=True)) if a != b), len(sa))
                       for sa, sb in zip(state["eager"]["tokens"], state["graphs"]["tokens"], strict=True)]
        row["greedy_agreement"] = round(sum(a == b for a, b in pairs) / len(pairs), 3)
        row["tokens_before_first_difference"] = min(first_split)
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
        del eager, graphs, state
        runtime._graphs = None
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
