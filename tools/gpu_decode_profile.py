"""Where a decode step's time goes on a GPU (the GPU checklist's item 2): one stage, batch 1.

For the stage runtime over its KV pool, eager and as its decode graphs (modeling/decode_graphs.py),
the stage runtime over a session's cache (lean layers and transformers' layers) and transformers' own forward with
its cache, each on the same weights: the time per step (synchronized, median of many), the CUDA
kernel time in it (torch.profiler: the sum of kernel durations, how many kernels), what is left
(launch gaps and host Python, the GPU idle), and the bandwidth it reaches: the weight bytes a step
must read over the step's time, against the card's peak. The engine's and the hop's costs are
measured by `inferencemesh bench`; this is the step alone.

    python tools/gpu_decode_profile.py --shape llama-1b --dtype bfloat16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from inferencemesh.checkpoint.read import read_local
from inferencemesh.modeling.kv_pool import BlockTableKV
from inferencemesh.modeling.runtime import Segment, StageRuntime
from inferencemesh.programs.bench.models import make_shape_model
from inferencemesh.protocol.transport import KV_BLOCK_TOKENS

# Datasheet HBM bandwidth, bytes/s: what "% of peak" is measured against (GPU.md's figures).
PEAK_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}
PROMPT = 32


def peak_bandwidth(name: str) -> float | None:
    return next((v for k, v in PEAK_BANDWIDTH.items() if k in name), None)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_steps(step, steps: int) -> list[float]:
    """Each step's wall time, the device synchronized around it."""
    times = []
    for i in range(steps):
        sync()
        started = time.perf_counter()
        step(i)
        sync()
        times.append(time.perf_counter() - started)
    return times


def kernel_split(step, steps: int) -> dict:
    """Kernel time and count per step from torch.profiler, over `steps` steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:  # CUDA: none on a CPU
        wall = sum(time_steps(step, steps))
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_us = sum(e.device_time for e in kernels)  # microseconds
    return {"kernels_per_step": len(kernels) / steps, "kernel_ms_per_step": kernel_us / 1e3 / steps,
            "profiled_wall_ms_per_step": wall * 1e3 / steps}


def stage_step(runtime: StageRuntime, prompt: torch.Tensor):
    """A decode step as the stage's service runs it: the token id comes from the host (a frame) and
    the chosen token goes back to it."""
    kv = runtime.new_session()
    logits = runtime.forward(kv, 0, token_ids=prompt.cpu())
    state = {"token": int(logits[-1].argmax()), "pos": len(prompt)}

    def step(_: int) -> None:
        out = runtime.forward(kv, state["pos"], token_ids=torch.tensor([state["token"]]))
        state["token"] = int(out[-1].argmax())
        state["pos"] += 1
    return step


def pool_step(runtime: StageRuntime, prompt: torch.Tensor, graphs: bool):
    """A decode step as the stage's worker runs it, over the stage's KV pool and a block table:
    through the decode graphs (modeling/decode_graphs.py, captured on a GPU) or eagerly."""
    pool = runtime.new_pool(-(-runtime.max_context // KV_BLOCK_TOKENS), decode_graphs=graphs)
    table = list(range(pool.num_blocks))
    logits = runtime.forward(BlockTableKV(pool, table, 0, len(prompt)), 0, token_ids=prompt.cpu())
    state = {"token": int(logits[-1].argmax()), "pos": len(prompt)}

    def step(_: int) -> None:
        pos = state["pos"]
        rows = runtime.forward_batch([Segment(BlockTableKV(pool, table, pos, 1), pos, torch.tensor([state["token"]]))])
        state["token"] = int(rows[0][-1].argmax())
        state["pos"] += 1
    return step


def host_profile(step, steps: int) -> list[dict]:
    """The host functions with the most own time over `steps` steps (cProfile)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    time_steps(step, steps)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    rows = sorted(((tt, calls, f"{Path(file).name}:{line}:{name}") for (file, line, name), (_, calls, tt, _, _)
                   in stats.items()), reverse=True)[:15]
    return [{"where": where, "calls_per_step": round(calls / steps, 1), "own_us_per_step": round(tt / steps * 1e6)}
            for tt, calls, where in rows]


def graph_replay_ms(decode, steps: int) -> dict:
    """decode(): one decode step on device-resident inputs, captured as one CUDA graph and replayed:
    the step with no host work at all, a floor for what graphs would give (each replay redoes the
    same position; the kernels' work is a decode step's). A capture that fails is reported."""
    try:
        with torch.inference_mode():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    decode()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                decode()
            times = time_steps(lambda _: graph.replay(), steps)
        return {"graph_ms_per_step": round(statistics.median(times) * 1e3, 3)}
    except Exception as err:  # noqa: BLE001 (reported: the capture is an experiment)
        return {"graph_error": repr(err)[:300]}


def hf_step(model, prompt: torch.Tensor):
    from transformers import DynamicCache

    cache = DynamicCache()
    out = model(prompt[None], past_key_values=cache, use_cache=True)
    state = {"token": out.logits[0, -1].argmax().view(1, 1), "cache": out.past_key_values}

    def step(_: int) -> None:
        o = model(state["token"], past_key_values=state["cache"], use_cache=True)
        state["token"], state["cache"] = o.logits[0, -1].argmax().view(1, 1), o.past_key_values
    return step


def hf_static_decode(model, prompt: torch.Tensor):
    """transformers' decode step on a StaticCache (its cache_position a device tensor)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=len(prompt) + 8)
    with torch.inference_mode():
        model(prompt[None], past_key_values=cache, cache_position=torch.arange(len(prompt), device=prompt.device))
    token = prompt[-1:].view(1, 1).clone()
    position = torch.tensor([len(prompt)], device=prompt.device)
    return lambda: model(token, past_key_values=cache, cache_position=position)


def graph_row(name: str, decode, weights: int, steps: int, peak: float | None) -> dict:
    try:
        graph = graph_replay_ms(decode(), steps)
    except Exception as err:  # noqa: BLE001 (the set-up of an experiment)
        graph = {"graph_error": repr(err)[:300]}
    if "graph_ms_per_step" in graph:
        ms = graph["graph_ms_per_step"]
        graph["weight_GBps"] = round(weights / (ms / 1e3) / 1e9, 1)
        if peak:
            graph["bandwidth_share"] = round(weights / (ms / 1e3) / peak, 3)
    row = {"config": name, **graph}
    print(json.dumps(row), flush=True)
    return row


def measure(name: str, step, weight_bytes: int, steps: int, peak: float | None) -> dict:
    with torch.inference_mode():
        time_steps(step, 10)  # warm-up: kernels chosen, caches allocated
        times = time_steps(step, steps)
        split = kernel_split(step, 20)
        host = host_profile(step, 10)
    ms = statistics.median(times) * 1e3
    row = {"config": name, "ms_per_step": round(ms, 3), **{k: round(v, 3) for k, v in split.items()},
           "gpu_busy": round(split["kernel_ms_per_step"] / split["profiled_wall_ms_per_step"], 3),
           "weight_GBps": round(weight_bytes / (ms / 1e3) / 1e9, 1)}
    if peak:
        row["bandwidth_share"] = round(weight_bytes / (ms / 1e3) / peak, 3)
        row["floor_ms"] = round(weight_bytes / peak * 1e3, 3)
    print(json.dumps(row), flush=True)
    return {**row, "host_profile": host}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads (a stage's share of cores)")
    parser.add_argument("--json")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model_dir = make_shape_model(args.shape, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of this script
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak = peak_bandwidth(name)
    prompt = torch.randint(3, 500, (PROMPT,), device=device)
    facts = read_local(model_dir)
    # What a decode step must read: every weight but the embedding (of which it reads one row).
    weights = sum(t.nbytes for n, t in facts.tensors.items() if "embed_tokens" not in n)
    steps_taken = 10 + args.steps + 20 + 10  # measure()'s warm-up, timed, profiled and host-profiled steps
    report = {"device": name, "torch": torch.__version__, "shape": args.shape, "dtype": args.dtype,
              "threads": args.threads, "peak_bandwidth": peak, "rows": []}

    def keep(row: dict) -> None:  # written after each row: a later one can take the process down
        report["rows"].append(row)
        for line in row.get("host_profile", [])[:8]:
            print(f"  host {line['own_us_per_step']:>7} us/step {line['calls_per_step']:>6} calls  {line['where']}")
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))

    # The stage's own path: its KV pool, eager and as the decode graphs (the kernels a replay runs,
    # the gaps between them).
    runtime = StageRuntime(model_dir, 0, facts.num_layers, dtype=args.dtype, device=device,
                           max_context=PROMPT + steps_taken + 8)
    for graphs in (False, True):
        keep(measure(f"stage runtime over its KV pool, {'decode graphs' if graphs else 'eager'}",
                     pool_step(runtime, prompt, graphs), weights, args.steps, peak))
    del runtime
    for lean in (True, False):
        runtime = StageRuntime(model_dir, 0, facts.num_layers, dtype=args.dtype, device=device,
                               max_context=PROMPT + steps_taken + 8, lean=lean)
        adopted = sum(layer is not None for layer in runtime._lean)
        keep(measure(f"stage runtime ({'lean' if lean else 'transformers'} layers, {adopted} lean)",
                     stage_step(runtime, prompt), weights, args.steps, peak))
        del runtime
        torch.cuda.empty_cache()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).to(device).eval()
    keep(measure("transformers forward + DynamicCache", hf_step(model, prompt), weights, args.steps, peak))
    if device == "cuda":
        # Last: transformers' StaticCache capture hit a device-side assert on the H200 (2026-11-27),
        # which leaves the CUDA context unusable for anything after it.
        keep(graph_row("transformers + StaticCache, one CUDA graph", lambda: hf_static_decode(model, prompt),
                       weights, args.steps, peak))

if __name__ == "__main__":
    main()
