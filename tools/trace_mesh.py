"""Where per-token time goes in a local mesh under concurrent streams: a py-spy trace of
every process (the frontend's engine in this one, each stage process), folded into categories.

    python tools/trace_mesh.py --shape llama-150m --stages 2 --streams 8 --json out.json

It starts the stages as `inferencemesh bench` does (stage processes on loopback gRPC, the
engine in this process with the frontend's threads), runs one warm-up burst of --streams
concurrent greedy requests, then samples every process with py-spy (`pip install py-spy`;
it needs ptrace rights) while --bursts more bursts run. Each sample of a thread that was on
the CPU is put in the first category whose rule matches its stack (CATEGORIES); a thread's
samples short of duration x rate are its waiting. Reported per process and thread: ms of each
category per generated token, and the share of the wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

from inferencemesh.programs.bench.mesh import start_mesh
from inferencemesh.programs.bench.models import make_shape_model, prompt_ids
from inferencemesh.programs.bench.runners import EngineUnderTest

# (category, test on the stack's frames, root first). First match wins, so the specific come first.
CATEGORIES: list[tuple[str, object]] = [
    ("attention (cache write, gather, sdpa)", lambda fs: _any(fs, "stage_attention", "sdpa_attention_forward",
                                                              "_PackedCache.update", "kv.py", "kv_pool.py",
                                                              "positions.py")),
    ("layer matmuls (projections, MLP)", lambda fs: _any(fs, "modeling_llama.py", "lean_layers.py")
     and _any(fs, "packed.py")),
    ("layer other (norms, rotary, activations)", lambda fs: _any(fs, "modeling_llama.py", "modeling_layers.py",
                                                                 "lean_layers.py")),
    ("head + norm (last stage)", lambda fs: _any(fs, "runtime.py") and _any(fs, "packed.py", "normalization",
                                                                             "modeling_llama.py")),
    ("decide: sampling / verify", lambda fs: _any(fs, "sampling.py", "_decide")),
    ("runtime glue (pack, rope, split)", lambda fs: _any(fs, "runtime.py")),
    # A thread waking another: the compute thread completing an asyncio future (self-pipe write),
    # the event loop queueing work for the compute thread.
    ("asyncio hand-offs (cross-thread wake-ups)", lambda fs: _any(fs, "_write_to_self", "call_soon_threadsafe",
                                                                  "run_coroutine_threadsafe", "Executor.submit",
                                                                  "run_in_executor")),
    # By the running (leaf) function: the event loop's own machinery, gRPC, serialisation.
    ("asyncio (event loop, epoll wake-ups)", lambda fs: _any(fs[-1:], "selectors.py", "asyncio/")),
    ("gRPC", lambda fs: _any(fs[-1:], "grpc/") or _any(fs[:1], "_poll_wrapper")),
    ("serialisation (codec, protobuf)", lambda fs: _any(fs, "codec.py", "SerializeToString", "FromString",
                                                        "_pb2")),
    ("engine + pipeline client (frontend)", lambda fs: _any(fs, "engine.py", "session.py", "pipeline.py",
                                                            "scheduler.py", "proposers/", "bench/")),
    ("stage server, worker", lambda fs: _any(fs, "server.py", "service.py", "stream.py", "local.py", "worker.py",
                                             "decide.py", "sessions.py")),
    ("gRPC", lambda fs: _any(fs, "grpc/")),
    ("asyncio (other loop work)", lambda fs: _any(fs, "asyncio/", "concurrent/futures", "threading.py")),
    ("other", lambda fs: True),
]


def _any(frames: list[str], *needles: str) -> bool:
    return any(needle in frame for frame in frames for needle in needles)


def categorise(frames: list[str]) -> str:
    for name, rule in CATEGORIES:
        if rule(frames):
            return name
    raise AssertionError("the last rule matches everything")


def fold(raw: str) -> tuple[dict[str, Counter], dict[str, Counter]]:
    """py-spy's raw (collapsed) output, recorded with --threads: per thread, samples per category
    and per leaf frame (the function that was running)."""
    out: dict[str, Counter] = defaultdict(Counter)
    leaves: dict[str, Counter] = defaultdict(Counter)
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = "?"
        while frames and (frames[0].startswith("thread (") or frames[0].startswith("process ")):
            head = frames.pop(0)
            if head.startswith("thread ("):
                thread = head
        # The thread's name leads, for the rules that go by thread (gRPC's poller).
        out[thread][categorise([thread, *frames])] += int(count)
        if frames:
            leaves[thread][frames[-1]] += int(count)
    return out, leaves


async def bursts(runner: EngineUnderTest, prompts: list[list[int]], count: int) -> int:
    tokens = 0
    for _ in range(count):
        streams = await asyncio.gather(*(runner.stream(ids) for ids in prompts))
        tokens += sum(n for stream in streams for _, n in stream)
    return tokens


async def traced_bursts(runner: EngineUnderTest, prompts: list[list[int]], count: int, spy_argv: dict[str, list[str]]):
    """A warm-up burst, then `count` bursts with py-spy recording each process (name: argv).
    Returns (tokens, wall seconds, load average before, {name: py-spy process})."""
    await bursts(runner, prompts, 1)
    spies = {name: subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for name, argv in spy_argv.items()}
    await asyncio.sleep(1.0)  # py-spy attaches
    load_before = os.getloadavg()
    started = time.perf_counter()
    tokens = await bursts(runner, prompts, count)
    wall = time.perf_counter() - started
    await asyncio.sleep(0.5)
    for spy in spies.values():
        spy.send_signal(signal.SIGINT)
    return tokens, wall, load_before, spies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama-150m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--bursts", type=int, default=2, help="traced bursts (after one warm-up)")
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--stage-threads", type=int, default=None,
                        help="OMP_NUM_THREADS of the stage processes (default: unset, as `serve` runs them)")
    parser.add_argument("--first-stage", default="embedded", choices=["embedded", "process"],
                        help="stage 0 in this process (the frontend), as serve runs it, or a process of its own")
    parser.add_argument("--raw-dir", default=None, help="keep py-spy's raw stacks here (one file per process)")
    parser.add_argument("--json", dest="json_out", default=None)
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        raise SystemExit("py-spy not found: pip install py-spy")
    from transformers import AutoTokenizer

    torch.set_grad_enabled(False)
    model_dir = make_shape_model(args.shape, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    from inferencemesh.checkpoint.read import read_local

    facts = read_local(model_dir)
    pool = prompt_ids(tokenizer, ["code", "prose"], facts.vocab_size)
    flat = [ids for ids_of_set in pool.values() for ids in ids_of_set]
    prompts = [flat[i % len(flat)] for i in range(args.streams)]
    max_context = 1024
    env = {"OMP_NUM_THREADS": str(args.stage_threads)} if args.stage_threads else None
    mesh = start_mesh(model_dir, args.dtype, args.stages, max_context, env=env,
                      first_stage=args.first_stage)
    stages, pipeline = mesh.stages, mesh.pipeline
    torch.set_num_threads(mesh.threads)  # this process plays the frontend
    tmp = Path(args.raw_dir) if args.raw_dir else Path(tempfile.mkdtemp(prefix="trace-mesh-"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        runner = EngineUnderTest(pipeline, args.new_tokens, max_context)
        here = "frontend (engine" + (" + stage 0)" if args.first_stage == "embedded" else ")")
        pids = {here: os.getpid(), **{f"stage {c.stage_index}": p.process.pid
                                      for c, p in zip(stages.configs, stages.processes, strict=True)}}
        spy_argv = {name: [py_spy, "record", "--pid", str(pid), "--rate", str(args.rate), "--format", "raw",
                           "--threads", "--nonblocking", "--output", str(tmp / f"{pid}.txt")]
                    for name, pid in pids.items()}
        tokens, wall, load_before, spies = asyncio.run(traced_bursts(runner, prompts, args.bursts, spy_argv))
        for name, spy in spies.items():
            if spy.wait(60) != 0 and not (tmp / f"{pids[name]}.txt").exists():
                raise SystemExit(f"py-spy on {name} failed: {spy.stderr.read().decode()[-500:]}")
        processes = {}
        for name, pid in pids.items():
            threads, leaves = fold((tmp / f"{pid}.txt").read_text())
            processes[name] = {}
            for thread, counts in sorted(threads.items(), key=lambda kv: -sum(kv[1].values())):
                busy = sum(counts.values())
                per_token = {cat: round(1000 * n / args.rate / tokens, 3) for cat, n in counts.most_common()}
                # Busy samples fall within the bursts (the margins around them are idle).
                processes[name][thread] = {
                    "busy_share": round(busy / args.rate / wall, 3),
                    "ms_per_token": per_token,
                    "waiting_ms_per_token": round(1000 * max(0.0, wall - busy / args.rate) / tokens, 3),
                    "top_functions_ms_per_token": {leaf: round(1000 * n / args.rate / tokens, 3)
                                                   for leaf, n in leaves[thread].most_common(8)},
                }
    finally:
        stages.stop()
        if not args.raw_dir:
            shutil.rmtree(tmp, ignore_errors=True)
    report = {
        "shape": args.shape, "dtype": args.dtype, "stages": args.stages, "streams": args.streams,
        "first_stage": args.first_stage,
        "stage_threads": args.stage_threads or f"default ({os.cpu_count()} cores)",
        "new_tokens": args.new_tokens, "bursts": args.bursts, "tokens": tokens, "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2), "ms_per_token_wall": round(1000 * wall / tokens, 3),
        "rate_hz": args.rate, "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()], "torch": torch.__version__,
        "processes": processes,
    }
    print(f"{tokens} tokens in {wall:.2f} s: {report['tokens_per_s']} tok/s aggregate, "
          f"{report['ms_per_token_wall']} ms of wall per token; load {load_before[0]:.2f}")
    for name, threads in processes.items():
        for thread, info in threads.items():
            if info["busy_share"] < 0.01:
                continue
            print(f"{name} {thread}: busy {100 * info['busy_share']:.0f}% of the wall, "
                  f"waiting {info['waiting_ms_per_token']} ms/token")
            for cat, ms in info["ms_per_token"].items():
                print(f"    {ms:>8.3f} ms/token  {cat}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
