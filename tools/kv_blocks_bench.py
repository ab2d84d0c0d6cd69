"""KV blocks against per-session reservations (issue 35's benchmarks): two source trees served in turn.

    python tools/kv_blocks_bench.py --old-src OLD/src --new-src NEW/src [--rounds 2]
        [--scenario NAME ...] [--model DIR | --shape llama-150m] [--json OUT]

e.g. (from the repository, the old tree a worktree of main: `git worktree add /tmp/kvbench-old 17193bb`)
    python tools/kv_blocks_bench.py --old-src /tmp/kvbench-old/src --new-src src \
        --json docs/benchmarks/kv-blocks-bundled.json

Each scenario runs `PYTHONPATH=TREE python3 -m inferencemesh serve --stages 2` (serve's defaults
otherwise, each tree its own: the old tree reserves 16 sessions at the full context, the new one
pools the same memory in blocks) on a fresh server, old, new, old, new... for --rounds rounds, one
server at a time; its numbers are medians over rounds, the raw rounds kept. Scenarios (kv_blocks_scenarios.py),
each after a warm-up batch, greedy completions:
- decode1, decode8, concurrency48: that many distinct short streams of 64 tokens at once (8, 3, 2
  bursts of them): completion tokens ÷ the bursts' wall time, and the most requests running at
  once (the frontend's gauge, read every 50 ms);
- burst16: a cold burst of 16 requests sharing a 1,450-token prefix: prompt tokens computed
  (prefix-cache queries - hits) ÷ (the prefix + the 16 suffixes), and stage 0's tokens;
- cancel_retry: a 1,150-token request closed after its first token, the identical one at once
  (3 trials): the share of its prompt that hit (usage's cached_tokens);
- mixed (--max-context 4096): 7 short streams of 128 tokens beside one decoding 3,000-token
  stream, twice, ÷ alone (before, between and after): their mean decode tok/s;
- multiturn: each tree's `inferencemesh bench --multi-turn --stages 2 --new-tokens 16`:
  identical-repeat and turn-6 TTFT ratios.
The targets are the issue's; a check passes on the new tree's median (or on new ÷ old)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kv_blocks_scenarios as sc  # noqa: E402 - beside this file, not a package

TREES = ("old", "new")


@dataclass(frozen=True)
class Check:
    """One of the issue's targets: `metric` of the new tree (`of` "new") or new ÷ old (`of` "ratio")
    compared with `value` by `op` (">=", "<=", "==")."""

    metric: str
    of: str
    op: str
    value: float
    text: str

    def holds(self, new: float | None, ratio: float | None) -> bool | None:
        x = new if self.of == "new" else ratio
        if x is None:
            return None
        return {">=": x >= self.value, "<=": x <= self.value, "==": x == self.value}[self.op]


@dataclass(frozen=True)
class Scenario:
    name: str
    measure: Callable[[sc.Mesh], Any]  # a coroutine function; None-like for multiturn (no server)
    checks: tuple[Check, ...]
    serve_flags: tuple[str, ...] = ()  # both trees, beside their own defaults


SCENARIOS = {s.name: s for s in (
    Scenario("decode1", lambda m: sc.decode(m, 1, bursts=8),
             (Check("tok_s", "ratio", ">=", 0.95, "decode tok/s at 1 stream >= 0.95x today's"),)),
    Scenario("decode8", lambda m: sc.decode(m, 8, bursts=3),
             (Check("tok_s", "ratio", ">=", 0.95, "decode tok/s at 8 streams >= 0.95x today's"),)),
    Scenario("concurrency48", lambda m: sc.decode(m, 48, bursts=2),
             (Check("max_running", "new", "==", 48, "all 48 streams running at once"),
              Check("tok_s", "ratio", ">=", 1.5, "aggregate decode tok/s at 48 streams >= 1.5x today's"))),
    Scenario("burst16", sc.burst,
             (Check("computed_over_ideal", "new", "<=", 3.0,
                    "cold burst of 16: prompt tokens computed <= 3x the prefix + the suffixes"),)),
    Scenario("cancel_retry", sc.cancel_retry,
             (Check("hit_share", "new", ">=", 0.8, "cancel after the first token, retry at once: >= 80% hit"),)),
    Scenario("mixed", sc.mixed,
             (Check("beside_over_alone", "new", ">=", 0.9,
                    "7 short streams beside a 3,000-token stream >= 0.9x their speed alone"),),
             serve_flags=("--max-context", "4096")),
    Scenario("multiturn", lambda m: None,
             (Check("repeat_over_cold", "new", "<=", 0.1, "bench --multi-turn identical-repeat TTFT ratio <= 0.1"),
              Check("turn6_ttft_on_over_off", "new", "<=", 0.25, "bench --multi-turn turn-6 TTFT ratio <= 0.25"))),
)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old-src", type=Path, required=True, help="the old checkout's src/ directory")
    p.add_argument("--new-src", type=Path, required=True, help="the new checkout's src/ directory")
    p.add_argument("--rounds", type=int, default=2, help="old, new turns per scenario (medians over them)")
    p.add_argument("--scenario", action="append", choices=list(SCENARIOS), help="repeatable (default: all)")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", help="a model directory or bundled://NAME (default: the bundled model)")
    model.add_argument("--shape", help="a random-weight preset of `inferencemesh bench` (e.g. llama-150m)")
    p.add_argument("--dtype", help="serve's and bench's --dtype (default: theirs)")
    p.add_argument("--old-serve-args", default="", help="more serve flags for the old tree (one string)")
    p.add_argument("--new-serve-args", default="", help="more serve flags for the new tree (one string)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--log-dir", type=Path, help="serve logs (default: a new temporary directory)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    args.scenario = args.scenario or list(SCENARIOS)
    return args


def model_flags(args: argparse.Namespace, shape_dir: Path | None) -> tuple[list[str], list[str]]:
    """(serve's, bench's) model flags: a shape is a checkpoint directory to serve, a preset to bench."""
    dtype = ["--dtype", args.dtype] if args.dtype else []
    if args.shape:
        return ["--model", str(shape_dir), *dtype], ["--shape", args.shape, *dtype]
    named = ["--model", args.model] if args.model else []
    return [*named, *dtype], [*named, *dtype]


def serve_flags(args: argparse.Namespace, tree: str, scenario: Scenario, model: list[str]) -> list[str]:
    extra = shlex.split(args.old_serve_args if tree == "old" else args.new_serve_args)
    return ["--stages", "2", *model, *scenario.serve_flags, *extra]


def make_shape(src: Path, shape: str, dtype: str | None) -> Path:
    """The bench's random-weight checkpoint of `shape` (made by the tree's own code, cached)."""
    code = ("import sys; from inferencemesh.programs.bench.models import make_shape_model; "
            "print(make_shape_model(sys.argv[1], sys.argv[2]))")
    out = subprocess.run([sys.executable, "-c", code, shape, dtype or "bfloat16"], check=True, text=True,
                         capture_output=True, env={**os.environ, "PYTHONPATH": str(src)})
    return Path(out.stdout.strip().splitlines()[-1])


def machine() -> dict[str, Any]:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = re.search(r"Model name:\s*(.+)", lscpu)
    flags = re.search(r"Flags:\s*(.+)", lscpu)
    return {"cpu": name.group(1).strip() if name else platform.processor(),
            "avx512_bf16": bool(flags and "avx512_bf16" in flags.group(1).split()),
            "cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}


def tree_facts(src: Path) -> dict[str, Any]:
    """The tree's commit (and whether its checkout has uncommitted changes) and serve's defaults."""
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(src), *a], capture_output=True, text=True).stdout.strip()

    help_text = subprocess.run([sys.executable, "-m", "inferencemesh", "serve", "--help"], capture_output=True,
                               text=True, env={**os.environ, "PYTHONPATH": str(src)}).stdout
    return {"src": str(src.resolve()), "commit": git("rev-parse", "HEAD"),
            "uncommitted_changes": bool(git("status", "--porcelain", "--untracked-files=no", "--", ".")),
            "serve_defaults": help_defaults(help_text, ("max-context", "max-sessions", "kv-cache-tokens",
                                                        "prefix-cache-tokens", "stages"))}


def help_defaults(help_text: str, options: tuple[str, ...]) -> dict[str, str]:
    """`--option: default` from argparse's help, for the options it has."""
    blocks = re.split(r"\n(?=  -)", help_text)  # one block per option, its help wrapped below it
    found = {}
    for block in blocks:
        head = re.match(r"\s*--([a-z0-9-]+)", block)
        default = re.search(r"\(default:\s+([^)]*)\)", " ".join(block.split()))
        if head and head.group(1) in options and default:
            found[head.group(1)] = default.group(1)
    return found


def run_once(scenario: Scenario, src: Path, flags: list[str], bench: list[str], log_dir: Path) -> dict[str, Any]:
    """One round of one scenario on one tree: its numbers, or the error that stopped it."""
    started, load = time.monotonic(), os.getloadavg()[0]
    try:
        if scenario.name == "multiturn":
            numbers = sc.multiturn(src, bench, log_dir)
        else:
            with sc.serving(src, flags, log_dir) as mesh:
                numbers = asyncio.run(_measure(scenario, mesh))
    except Exception as err:  # noqa: BLE001 - a failed round is reported, the others still run
        return {"error": f"{type(err).__name__}: {err}"[:4000], "seconds": round(time.monotonic() - started, 1)}
    return {**{k: _rounded(v) for k, v in numbers.items()}, "seconds": round(time.monotonic() - started, 1),
            "load_before": round(load, 2)}


def _rounded(value: Any) -> Any:
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return None if value is None else round(value, 4)


async def _measure(scenario: Scenario, mesh: sc.Mesh) -> dict[str, float]:
    try:
        return await scenario.measure(mesh)
    finally:
        await mesh.aclose()


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(scenario: Scenario, rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per metric the medians of each tree's good rounds and new ÷ old; each check with pass/fail
    (None: a tree had no good round, or old was 0)."""
    good = {t: [r for r in rounds[t] if "error" not in r] for t in TREES}
    keys = [k for k, v in (good["old"] or good["new"] or [{}])[0].items()
            if k not in ("seconds", "load_before") and not isinstance(v, list)]  # lists: raw, in the rounds
    metrics: dict[str, dict[str, float | None]] = {}
    for key in keys:
        old, new = (median([r[key] for r in good[t] if key in r]) for t in TREES)
        ratio = new / old if old and new is not None else None
        metrics[key] = {"old": old, "new": new, "ratio": round(ratio, 4) if ratio is not None else None}
    checks = []
    for check in scenario.checks:
        m = metrics.get(check.metric, {})
        checks.append({"target": check.text, "metric": check.metric, "of": check.of, "op": check.op,
                       "value": check.value, "new": m.get("new"), "ratio": m.get("ratio"),
                       "pass": check.holds(m.get("new"), m.get("ratio"))})
    errors = [f"{t} round {i + 1}: {r['error']}" for t in TREES for i, r in enumerate(rounds[t]) if "error" in r]
    return {"metrics": metrics, "checks": checks, "rounds": rounds, "errors": errors}


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = [f"{'scenario':<14} {'metric':<28} {'old':>10} {'new':>10} {'new/old':>8}  target"]
    for name, result in results.items():
        targets = {c["metric"]: c for c in result["checks"]}
        for key, m in result["metrics"].items():
            c = targets.get(key)
            verdict = "" if c is None else f"{c['op']} {c['value']:g} ({c['of']}): " + {
                True: "PASS", False: "FAIL", None: "n/a"}[c["pass"]]
            cells = f"{_fmt(m['old']):>10} {_fmt(m['new']):>10} {_fmt(m['ratio']):>8}"
            rows.append(f"{name:<14} {key:<28} {cells}  {verdict}")
        rows.extend(f"{name:<14} ERROR {e.splitlines()[0][:200]}" for e in result["errors"])
    return "\n".join(rows)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like ^C, so each scenario's `serve` is stopped on the way out, not left running
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kv-blocks-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    srcs = {"old": args.old_src.resolve(), "new": args.new_src.resolve()}
    shape_dir = make_shape(srcs["old"], args.shape, args.dtype) if args.shape else None
    serve_model, bench_model = model_flags(args, shape_dir)
    report: dict[str, Any] = {
        "issue": 35, "command": " ".join(["python3", "tools/kv_blocks_bench.py", *(argv or sys.argv[1:])]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(),
        "trees": {t: tree_facts(srcs[t]) for t in TREES}, "rounds": args.rounds, "order": "old, new per round",
        "model": args.shape or args.model or "bundled default", "log_dir": str(log_dir), "serve_flags": {},
        "results": {}}
    print(f"logs in {log_dir}", flush=True)
    for name in args.scenario:
        scenario = SCENARIOS[name]
        flags = {t: serve_flags(args, t, scenario, serve_model) for t in TREES}
        report["serve_flags"][name] = flags if name != "multiturn" else {
            t: ["bench", "--multi-turn", "--stages", "2", "--new-tokens", "16", *bench_model] for t in TREES}
        rounds: dict[str, list[dict[str, Any]]] = {t: [] for t in TREES}
        for r in range(args.rounds):
            for t in TREES:
                rounds[t].append(run_once(scenario, srcs[t], flags[t], bench_model, log_dir))
                print(f"{name} round {r + 1} {t}: {json.dumps(rounds[t][-1])[:400]}", flush=True)
        report["results"][name] = summarise(scenario, rounds)
        report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        if args.json:  # after every scenario: a run stopped half-way keeps what it measured
            args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report["results"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
