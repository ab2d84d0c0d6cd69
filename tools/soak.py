"""Bounded soak test: many concurrent streaming clients against a local mesh, then the ledger.

    python tools/soak.py --clients 32 --seconds 300 --json soak.json

Starts a 2-stage mesh of the bundled model and two frontends over the same stages (one with
the package's draft model, one with auto n-gram speculation), so prompt lengths, sampling
settings and speculative strategies are mixed. Reports aggregate tokens/s, p50/p99 TTFT and
inter-token latency, errors (must be 0), sessions left open on every stage (must be 0) and
the RSS growth of every process after warm-up (bounded by --rss-bound-mib). Exits non-zero
when a bound is broken. Traffic goes only to loopback; every loop is bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import grpc
import httpx

from inferencemesh.bundled import resolve_model
from inferencemesh.checkpoint.read import read_local
from inferencemesh.config import FrontendConfig
from inferencemesh.cpus import share_of_cpus
from inferencemesh.flags import to_argv
from inferencemesh.planner import PlanInputs, plan_stages
from inferencemesh.programs.local_stages import LocalStages, stage_template
from inferencemesh.programs.process import CLI, ManagedProcess, free_port
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol import stage_pb2_grpc as pb_grpc

PROMPTS = [
    "def fib(n):\n",
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n",
    "Traceback (most recent call last):\n  File \"main.py\", line 3, in <module>\n    main()\nValueError: bad\n",
    "The quick brown fox",
    "    def __eq__(self, other):\n        if not isinstance(other, type(self)):\n            return NotImplemented\n"
    * 6,
]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:  # not listening yet
        return False


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def client(base: str, deadline: float, rng: random.Random, stats: dict) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        while time.monotonic() < deadline:
            body = {"model": "imesh-code-target", "prompt": rng.choice(PROMPTS), "stream": True,
                    "stream_options": {"include_usage": True},
                    "max_tokens": rng.randint(8, 96), "temperature": rng.choice([0.0, 0.0, 0.8]),
                    "seed": rng.randint(0, 9)}
            started = last = time.perf_counter()
            first = True
            try:
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        stats["errors"].append(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
                        continue
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            stats["errors"].append(str(chunk["error"])[:200])
                            break
                        if chunk.get("usage"):
                            stats["tokens"] += chunk["usage"]["completion_tokens"]
                        if not chunk.get("choices"):
                            continue
                        now = time.perf_counter()
                        if first:
                            stats["ttft"].append(now - started)
                            first = False
                        else:
                            stats["itl"].append(now - last)
                        last = now
                        stats["chunks"] += 1
                stats["requests"] += 1
            except httpx.HTTPError as err:
                stats["errors"].append(f"{type(err).__name__}: {err}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--warmup-seconds", type=float, default=20)
    parser.add_argument("--rss-bound-mib", type=float, default=256, help="allowed RSS growth per process")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    model = resolve_model(None)
    plan = plan_stages(PlanInputs.from_checkpoint(read_local(model), kv_tokens=16 * 1024), 2)
    # serve's threads rule: each stage its share of the cores
    stages = LocalStages(stage_template(model, max_sessions=64, max_context=1024, threads=share_of_cpus(len(plan))),
                         plan)
    ports = [free_port(), free_port()]
    frontends = [
        ManagedProcess(f"frontend-{name}", CLI + ["frontend", *to_argv(FrontendConfig(
            model=model, stage_addresses=tuple(stages.addresses), host="127.0.0.1", port=port, max_sessions=32,
            max_context=1024, speculative=name))])
        for name, port in zip(("draft", "auto"), ports, strict=True)
    ]
    processes = [*stages.processes, *frontends]
    try:
        stages.start()
        stages.wait_ready(300)
        for f in frontends:
            f.start()
        for port in ports:
            deadline = time.monotonic() + 120
            while not _ready(f"http://127.0.0.1:{port}/ready"):
                if time.monotonic() > deadline:
                    raise SystemExit(f"frontend on {port} never became ready")
                time.sleep(0.5)

        async def phase(seconds: float) -> dict:
            stats = {"ttft": [], "itl": [], "chunks": 0, "tokens": 0, "requests": 0, "errors": []}
            deadline = time.monotonic() + seconds
            await asyncio.gather(*(client(f"http://127.0.0.1:{ports[i % 2]}", deadline, random.Random(i), stats)
                                   for i in range(args.clients)))
            return stats

        asyncio.run(phase(args.warmup_seconds))
        rss_start = {p.name: rss_mib(p.process.pid) for p in processes}
        started = time.monotonic()
        stats = asyncio.run(phase(args.seconds))
        elapsed = time.monotonic() - started
        time.sleep(2)  # let releases land
        rss_end = {p.name: rss_mib(p.process.pid) for p in processes}
        open_sessions = {}
        for i, address in enumerate(stages.addresses):
            with grpc.insecure_channel(address) as channel:
                info = pb_grpc.StageStub(channel).Info(pb.InfoRequest(), timeout=5)
                open_sessions[f"stage-{i}"] = info.active_sessions
        growth = {name: round(rss_end[name] - rss_start[name], 1) for name in rss_start}
        report = {
            "clients": args.clients, "seconds": round(elapsed, 1), "requests": stats["requests"],
            "stream_chunks": stats["chunks"], "tokens": stats["tokens"],
            "tokens_per_s": round(stats["tokens"] / elapsed, 1),
            "ttft_ms_p50": round(1000 * percentile(stats["ttft"], 0.5), 1),
            "ttft_ms_p99": round(1000 * percentile(stats["ttft"], 0.99), 1),
            "itl_ms_p50": round(1000 * percentile(stats["itl"], 0.5), 2),
            "itl_ms_p99": round(1000 * percentile(stats["itl"], 0.99), 2),
            "errors": len(stats["errors"]), "error_samples": stats["errors"][:5],
            "open_sessions_at_end": open_sessions, "rss_mib_after_warmup": rss_start, "rss_mib_at_end": rss_end,
            "rss_growth_mib": growth, "rss_bound_mib": args.rss_bound_mib,
            "median_ttft_ms": round(1000 * statistics.median(stats["ttft"]), 1) if stats["ttft"] else None,
        }
        print(json.dumps(report, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        ok = (report["errors"] == 0 and not any(open_sessions.values())
              and all(g <= args.rss_bound_mib for g in growth.values()))
        return 0 if ok else 1
    finally:
        for proc in frontends:
            proc.stop()
        stages.stop()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
