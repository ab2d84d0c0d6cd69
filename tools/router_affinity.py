"""The router's prefix-affinity hit rate on a chat/agent workload, against a router with affinity off.

    python tools/router_affinity.py [--conversations 8] [--turns 4] [--concurrency 3] [--max-tokens 16]
                                    [--json docs/benchmarks/router-affinity.json]

It starts `inferencemesh serve --replicas 2 --stages 1` (the bundled model; its router is the
affinity router, on default settings) and, in front of the same two frontends, a second
`inferencemesh router --affinity-ttl 0.001`: every prefix block is forgotten a millisecond after it
was recorded, so that router spreads requests by load alone, equal loads by a hash of the whole
prompt (the baseline).

The workload is K conversations that share one system prompt (about --system-chars characters), each
with its own opening user message, T turns each: every turn appends the model's answer and a new user
message (greedy, --max-tokens, streamed). The conversations run interleaved: each is a sequence of
turns, at most --concurrency requests in flight among all of them. The workload runs through the
affinity router first, then, with a different system prompt and openings (so that the first phase's
prefix-cache entries do not help), through the baseline router.

Per phase it reports: the router's own affinity hits and misses (its /metrics, deltas); the replicas'
prefix-cache hit tokens over query tokens (the frontends' inferencemesh_prefix_cache_hits_total /
_queries_total, deltas); the replica each request was sent to, and from that the share of each
conversation's turns on its most used replica; TTFT (to the first streamed content) median and p90
per turn index.

Which replica a request went to: a response does not say. The router counts each prompted request's
first choice in inferencemesh_router_prefix_affinity_{hits,misses}_total{replica=...} as soon as it has
chosen, before the request leaves for the replica; so the tool starts requests one at a time (a lock
held from sending a request until that router's counters show it, a few milliseconds) and reads the
replica, and whether it was a hit, off the counter that moved. A retried request (the replica answered
429/502/503) would end on another replica: the retries are reported too (0 in a run without overload).

Every process it starts is stopped on every path (serve with SIGINT, as a user's Ctrl-C: it stops
its router and frontends; then any of serve's children still alive, by pid).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
ROUTER_HITS = "inferencemesh_router_prefix_affinity_hits_total"
ROUTER_MISSES = "inferencemesh_router_prefix_affinity_misses_total"
ROUTER_RETRIES = "inferencemesh_router_retries_total"
CACHE_QUERIES = "inferencemesh_prefix_cache_queries_total"
CACHE_HITS = "inferencemesh_prefix_cache_hits_total"
BASELINE_TTL_S = 0.001


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- processes ----------------------------------------------------------------------------------


def child_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (from /proc: each one's parent)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def wait_ok(url: str, proc: subprocess.Popen, timeout: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-4000:] if log and log.exists() else ""
            why = f"exited with {proc.returncode}" if proc.poll() is not None else f"not ready after {timeout:.0f}s"
            raise RuntimeError(f"{url}: {why}\n{tail}")
        time.sleep(0.25)


def stop(proc: subprocess.Popen, sig: signal.Signals, grace_s: float) -> None:
    """Stop a process as a user would (`sig`), killing it if it outlasts `grace_s`."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def serve_mesh(stages: int, extra: list[str], logdir: Path) -> Iterator[str]:
    """`inferencemesh serve --replicas 2`, ready (its router answers /ready): its router's base URL.
    Stopped on the way out: SIGINT (serve stops its router, then its frontends, then its stages),
    SIGKILL if it outlasts 90 s, then any child of it still alive, by pid."""
    port = free_port()
    log = logdir / "serve.log"
    argv = [sys.executable, "-m", "inferencemesh", "serve", "--replicas", "2", "--stages", str(stages),
            "--host", "127.0.0.1", "--port", str(port), *extra]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=child_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    children: set[int] = set()
    try:
        deadline = time.monotonic() + 600
        while True:  # the router starts once both frontends are ready
            children.update(descendants(proc.pid))
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("serve never became ready:\n" + log.read_text(errors="replace")[-4000:])
            time.sleep(0.5)
        children.update(descendants(proc.pid))
        yield f"http://127.0.0.1:{port}"
    finally:
        children.update(descendants(proc.pid) if proc.poll() is None else [])
        stop(proc, signal.SIGINT, 90)
        deadline = time.monotonic() + 15  # they follow their parent (its lifeline); wait, then kill
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{c}") for c in children):
            time.sleep(0.2)
        for child in children:
            if os.path.exists(f"/proc/{child}") and "inferencemesh" in cmdline(child):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)


@contextlib.contextmanager
def router_process(frontends: dict[str, str], affinity_ttl: float, logdir: Path) -> Iterator[str]:
    """A second `inferencemesh router` in front of the same frontends: its base URL."""
    port = free_port()
    log = logdir / "baseline-router.log"
    argv = [sys.executable, "-m", "inferencemesh", "router", "--host", "127.0.0.1", "--port", str(port),
            "--frontends", ",".join(f"{name}={url}" for name, url in frontends.items()),
            "--affinity-ttl", repr(affinity_ttl)]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=child_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ok(f"http://127.0.0.1:{port}/ready", proc, 60, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc, signal.SIGTERM, 35)


# ---- metrics ------------------------------------------------------------------------------------

SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)', re.M)


def samples(text: str, name: str) -> dict[str, float]:
    """`name`'s samples: their label text -> value."""
    return {m["labels"] or "": float(m["value"]) for m in SAMPLE.finditer(text) if m["name"] == name}


def by_replica(text: str, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, value in samples(text, name).items():
        replica = re.search(r'replica="([^"]*)"', labels)
        if replica:
            out[replica[1]] = out.get(replica[1], 0.0) + value
    return out


def router_counts(text: str) -> dict[str, dict[str, float]]:
    return {"hits": by_replica(text, ROUTER_HITS), "misses": by_replica(text, ROUTER_MISSES),
            "retries": by_replica(text, ROUTER_RETRIES)}


def cache_counts(frontends: dict[str, str]) -> dict[str, dict[str, float]]:
    out = {}
    for name, url in frontends.items():
        text = httpx.get(f"{url}/metrics", timeout=10).text
        out[name] = {"queries": sum(samples(text, CACHE_QUERIES).values()),
                     "hits": sum(samples(text, CACHE_HITS).values())}
    return out


# ---- the workload -------------------------------------------------------------------------------

TEAMS = ["payments", "search", "billing", "ingest", "mobile", "platform", "data", "identity"]
SUBJECTS = ["the retry policy", "the cache layer", "the schema migration", "the rate limiter", "the job queue",
            "the feature flags", "the audit log", "the export service", "the webhook sender", "the sync worker"]
RULES = [
    "Answer in short paragraphs and put code in fenced blocks with the language named.",
    "Prefer the standard library; name any third-party package and say why it is needed.",
    "When a question is ambiguous, state the assumption you make before answering.",
    "Quote the exact error message when you explain a failure, then its most likely cause.",
    "Never invent an API: if you are unsure a function exists, say so and suggest how to check.",
    "Keep examples runnable: imports included, no placeholders that would not parse.",
    "For performance questions, say what to measure first and which tool measures it.",
    "Mention tests: every change you propose should come with the test that shows it works.",
    "Point out security concerns such as injection, secrets in logs and unchecked input.",
    "When you refactor, keep behaviour the same and list every change in behaviour you could not avoid.",
    "Use the team's naming: snake_case functions, PascalCase classes, UPPER_CASE constants.",
    "Type-annotate public functions and keep docstrings to one line unless more is needed.",
    "Log at INFO for state changes and at DEBUG for details; never log personal data.",
    "Say which Python versions an answer needs when it uses a recent feature.",
]
QUESTIONS = [
    "Can you show the smallest change that fixes it?", "What would a test for that look like?",
    "How would that behave under concurrent callers?", "What should I log when that path fails?",
    "Is there a simpler way that avoids the extra dependency?", "How do I measure whether it got faster?",
    "What happens if the input is empty or very large?", "Could you rewrite that as a small function?",
]


def system_prompt(rng: random.Random, phase: str, chars: int) -> str:
    team = rng.choice(TEAMS)
    text = (f"[{phase}] You are the coding assistant of the {team} team at Example Corp. "
            f"Follow these house rules in every answer.\n")
    rules = RULES[:]
    rng.shuffle(rules)
    i = 0
    while len(text) < chars:
        text += f"{i + 1}. {rules[i % len(rules)]}\n"
        i += 1
    return text[:chars]


def opening(rng: random.Random, phase: str, index: int) -> str:
    subject, team = rng.choice(SUBJECTS), rng.choice(TEAMS)
    return (f"({phase} conversation {index}) I maintain {subject} of the {team} service. "
            f"Since yesterday it fails about one call in {rng.randint(20, 400)} with a timeout after "
            f"{rng.randint(2, 30)} seconds. Where should I start looking?")


@dataclass
class Turn:
    conversation: int
    turn: int
    replica: str | None = None
    affinity_hit: bool | None = None
    ttft_s: float | None = None
    total_s: float | None = None
    status: int | None = None
    error: str | None = None
    answer_chars: int = 0


@dataclass
class Phase:
    name: str
    router: str
    turns: list[Turn] = field(default_factory=list)


async def read_counts(client: httpx.AsyncClient, router: str) -> dict[str, dict[str, float]]:
    return router_counts((await client.get(f"{router}/metrics")).text)


def moved(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> list[tuple[str, bool]]:
    """The (replica, hit) counters that rose between two reads, one entry per request."""
    out = []
    for kind in ("hits", "misses"):
        for replica, value in after[kind].items():
            out += [(replica, kind == "hits")] * round(value - before[kind].get(replica, 0.0))
    return out


async def chat_turn(client: httpx.AsyncClient, router: str, body: dict[str, Any], turn: Turn) -> str:
    """One streamed chat completion: its answer's text; `turn` gets its TTFT and total time."""
    started = time.perf_counter()
    parts: list[str] = []
    try:
        async with client.stream("POST", f"{router}/v1/chat/completions", json=body) as response:
            turn.status = response.status_code
            if response.status_code != 200:
                turn.error = (await response.aread()).decode(errors="replace")[:300]
                return ""
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    text = (choice.get("delta") or {}).get("content")
                    if text and turn.ttft_s is None:
                        turn.ttft_s = time.perf_counter() - started
                    if text:
                        parts.append(text)
                    if choice.get("finish_reason") and turn.ttft_s is None:  # an empty answer: its end
                        turn.ttft_s = time.perf_counter() - started
    except httpx.HTTPError as err:
        turn.error = f"{type(err).__name__}: {err}"
    finally:
        turn.total_s = time.perf_counter() - started
    turn.answer_chars = len("".join(parts))
    return "".join(parts)


async def run_phase(phase: Phase, model: str, conversations: list[list[dict[str, str]]], follow_ups: list[list[str]],
                    args: argparse.Namespace) -> None:
    """Every conversation as a task of sequential turns; at most args.concurrency requests in flight;
    requests start one at a time, each attributed to the replica whose router counter it moved."""
    limit = asyncio.Semaphore(args.concurrency)
    start_lock = asyncio.Lock()
    timeout = httpx.Timeout(args.request_timeout, connect=10)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client, \
            httpx.AsyncClient(timeout=10, trust_env=False) as probe:

        async def conversation(c: int) -> None:
            messages = conversations[c]
            for t in range(args.turns):
                if t:
                    messages.append({"role": "user", "content": follow_ups[c][t - 1]})
                turn = Turn(c, t + 1)
                phase.turns.append(turn)
                body = {"model": model, "messages": list(messages), "max_tokens": args.max_tokens,
                        "temperature": 0, "stream": True, "ignore_eos": args.ignore_eos}
                async with limit:
                    async with start_lock:
                        before = await read_counts(probe, phase.router)
                        task = asyncio.create_task(chat_turn(client, phase.router, body, turn))
                        deadline = time.monotonic() + 30
                        while time.monotonic() < deadline:
                            rose = moved(before, await read_counts(probe, phase.router))
                            if rose:
                                turn.replica, turn.affinity_hit = rose[0]
                                if len(rose) > 1:
                                    turn.error = f"attribution: {len(rose)} counters moved"
                                break
                            if task.done():
                                break
                            await asyncio.sleep(0.002)
                    answer = await task
                messages.append({"role": "assistant", "content": answer})

        await asyncio.gather(*(conversation(c) for c in range(len(conversations))))


def workload(args: argparse.Namespace, phase: str) -> tuple[str, list[list[dict[str, str]]], list[list[str]]]:
    rng = random.Random(f"{args.seed}:{phase}")
    system = system_prompt(rng, phase, args.system_chars)
    conversations = [[{"role": "system", "content": system}, {"role": "user", "content": opening(rng, phase, c)}]
                     for c in range(args.conversations)]
    follow_ups = [[f"{rng.choice(QUESTIONS)} (turn {t + 2})" for t in range(args.turns - 1)]
                  for _ in range(args.conversations)]
    return system, conversations, follow_ups


# ---- results ------------------------------------------------------------------------------------


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 1)


def summarize(phase: Phase, router_delta: dict[str, dict[str, float]], cache_delta: dict[str, dict[str, float]],
              turns: int) -> dict[str, Any]:
    hits = sum(router_delta["hits"].values())
    misses = sum(router_delta["misses"].values())
    queries = sum(c["queries"] for c in cache_delta.values())
    cached = sum(c["hits"] for c in cache_delta.values())
    per_conversation = {}
    for c in sorted({t.conversation for t in phase.turns}):
        replicas = [t.replica for t in sorted(phase.turns, key=lambda t: t.turn) if t.conversation == c]
        known = [r for r in replicas if r is not None]
        top = Counter(known).most_common(1)[0][1] if known else 0
        per_conversation[c] = {"replicas": replicas, "share_on_one_replica": top / len(replicas) if replicas else None,
                               "switches": sum(a != b for a, b in zip(known, known[1:], strict=False))}
    shares = [v["share_on_one_replica"] for v in per_conversation.values() if v["share_on_one_replica"] is not None]
    per_turn = []
    for t in range(1, turns + 1):
        ttfts = [x.ttft_s for x in phase.turns if x.turn == t and x.ttft_s is not None and x.status == 200]
        flags = [x.affinity_hit for x in phase.turns if x.turn == t and x.affinity_hit is not None]
        per_turn.append({"turn": t, "requests": len(ttfts), "ttft_median_ms": ms(quantile(ttfts, 0.5)),
                         "ttft_p90_ms": ms(quantile(ttfts, 0.9)),
                         "affinity_hit_share": round(sum(flags) / len(flags), 3) if flags else None})
    ttfts = [x.ttft_s for x in phase.turns if x.ttft_s is not None and x.status == 200]
    return {
        "router": phase.router,
        "requests": len(phase.turns),
        "errors": [{"conversation": t.conversation, "turn": t.turn, "status": t.status, "error": t.error}
                   for t in phase.turns if t.error or t.status != 200],
        "router_affinity": {"hits": hits, "misses": misses,
                            "hit_rate": round(hits / (hits + misses), 3) if hits + misses else None,
                            "hits_by_replica": router_delta["hits"], "misses_by_replica": router_delta["misses"],
                            "retries_by_replica": router_delta["retries"]},
        "replica_prefix_cache": {"hit_tokens": cached, "query_tokens": queries,
                                 "hit_rate": round(cached / queries, 3) if queries else None,
                                 "by_replica": cache_delta},
        "requests_by_replica": dict(Counter(t.replica or "unknown" for t in phase.turns)),
        "conversations": {"share_of_turns_on_one_replica_mean": round(statistics.fmean(shares), 3) if shares else None,
                          "all_turns_on_one_replica": sum(s == 1.0 for s in shares),
                          "of": len(shares),
                          "each": per_conversation},
        "ttft_all_turns": {"median_ms": ms(quantile(ttfts, 0.5)), "p90_ms": ms(quantile(ttfts, 0.9))},
        "ttft_by_turn": per_turn,
    }


def delta(after: dict[str, dict[str, float]], before: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    return {key: {name: after[key][name] - before.get(key, {}).get(name, 0.0) for name in after[key]}
            for key in after}


def print_table(results: dict[str, dict[str, Any]], turns: int) -> None:
    names = list(results)
    print(f"\n{'':44}" + "".join(f"{n:>22}" for n in names))

    def row(label: str, cells: list[str]) -> None:
        print(f"{label:44}" + "".join(f"{c:>22}" for c in cells))

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x * 100:.1f}%"

    row("router affinity hits / misses", [f"{r['router_affinity']['hits']:.0f} / {r['router_affinity']['misses']:.0f}"
                                          f" ({pct(r['router_affinity']['hit_rate'])})" for r in results.values()])
    row("replica prefix cache hit / query tokens",
        [f"{r['replica_prefix_cache']['hit_tokens']:.0f}/{r['replica_prefix_cache']['query_tokens']:.0f}"
         f" ({pct(r['replica_prefix_cache']['hit_rate'])})" for r in results.values()])
    row("requests by replica", [" ".join(f"{k}:{v}" for k, v in sorted(r["requests_by_replica"].items()))
                                for r in results.values()])
    row("conversation turns on one replica (mean)",
        [pct(r["conversations"]["share_of_turns_on_one_replica_mean"]) for r in results.values()])
    row("conversations wholly on one replica",
        [f"{r['conversations']['all_turns_on_one_replica']} of {r['conversations']['of']}" for r in results.values()])
    row("TTFT median / p90, all turns (ms)",
        [f"{r['ttft_all_turns']['median_ms']} / {r['ttft_all_turns']['p90_ms']}" for r in results.values()])
    for t in range(turns):
        row(f"  turn {t + 1}: TTFT median / p90 (ms)",
            [f"{r['ttft_by_turn'][t]['ttft_median_ms']} / {r['ttft_by_turn'][t]['ttft_p90_ms']}"
             for r in results.values()])
    row("errors", [str(len(r["errors"])) for r in results.values()])


# ---- main ---------------------------------------------------------------------------------------


def stop_on_signals() -> None:
    """SIGTERM and SIGHUP end the run as Ctrl-C does: every `finally` runs, every process is stopped."""
    def interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGHUP, interrupt)


def warm_up(frontends: dict[str, str], model: str, args: argparse.Namespace) -> None:
    """Straight to each frontend, a conversation's first two turns with a system prompt of its own
    (text neither phase uses): first-request costs, and those of the first long prefill, out of the
    measured phases."""
    _, conversations, follow_ups = workload(args, "warm-up")
    with httpx.Client(timeout=args.request_timeout, trust_env=False) as client:
        for i, url in enumerate(frontends.values()):
            messages = list(conversations[i % len(conversations)])
            for _ in range(2):
                body = {"model": model, "messages": messages, "max_tokens": args.max_tokens, "temperature": 0,
                        "ignore_eos": args.ignore_eos}
                response = client.post(f"{url}/v1/chat/completions", json=body)
                response.raise_for_status()
                messages = [*messages, {"role": "assistant",
                                        "content": response.json()["choices"][0]["message"]["content"] or ""},
                            {"role": "user", "content": follow_ups[0][0] if follow_ups[0] else "And then?"}]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=3, help="requests in flight at most, all conversations")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--system-chars", type=int, default=1500)
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="let answers stop at the end-of-sequence token (default: each is --max-tokens long)")
    parser.add_argument("--stages", type=int, default=1, help="stages per pipeline")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="FLAG",
                        help="an extra flag for `inferencemesh serve` (repeatable; --serve-arg=--max-sessions=8)")
    parser.add_argument("--baseline-first", action="store_true",
                        help="run the baseline phase first (to see what the order itself changes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=600)
    parser.add_argument("--json", default=str(REPO / "docs" / "benchmarks" / "router-affinity.json"))
    args = parser.parse_args()
    if args.conversations < 1 or args.turns < 1 or args.concurrency < 1:
        parser.error("--conversations, --turns and --concurrency must be at least 1")
    stop_on_signals()
    started = time.time()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="router-affinity-") as tmp, contextlib.ExitStack() as stack:
        logdir = Path(tmp)
        affinity = stack.enter_context(serve_mesh(args.stages, args.serve_arg, logdir))
        replicas = httpx.get(f"{affinity}/router/replicas", timeout=10).json()["replicas"]
        frontends = {r["name"]: r["url"] for r in replicas}
        baseline = stack.enter_context(router_process(frontends, BASELINE_TTL_S, logdir))
        model = httpx.get(f"{affinity}/v1/models", timeout=10).json()["data"][0]["id"]
        print(f"router-affinity: serve's router {affinity}, baseline router {baseline}, frontends {frontends}",
              flush=True)
        warm_up(frontends, model, args)
        results: dict[str, dict[str, Any]] = {}
        prompts: dict[str, dict[str, Any]] = {}
        phases = [("affinity", affinity), ("baseline", baseline)]
        for name, router in reversed(phases) if args.baseline_first else phases:
            system, conversations, follow_ups = workload(args, name)
            prompts[name] = {"system_prompt_chars": len(system),
                             "opening_chars": [len(c[1]["content"]) for c in conversations]}
            phase = Phase(name, router)
            router_before = router_counts(httpx.get(f"{router}/metrics", timeout=10).text)
            cache_before = cache_counts(frontends)
            t0 = time.perf_counter()
            asyncio.run(run_phase(phase, model, conversations, follow_ups, args))
            wall = time.perf_counter() - t0
            router_after = router_counts(httpx.get(f"{router}/metrics", timeout=10).text)
            cache_after = cache_counts(frontends)
            results[name] = summarize(phase, delta(router_after, router_before), delta(cache_after, cache_before),
                                      args.turns)
            results[name]["wall_s"] = round(wall, 2)
            print(f"router-affinity: {name} phase done in {wall:.1f}s", flush=True)
        serve_log = (logdir / "serve.log").read_text(errors="replace")
    lines = serve_log.splitlines()
    first = next((i for i, line in enumerate(lines) if "inferencemesh: serving" in line), None)
    plan = [] if first is None else [lines[first], *itertools.takewhile(
        lambda line: not line.startswith("inferencemesh:"), lines[first + 1:])]
    report = {
        "what": "prefix-affinity routing on a chat/agent workload: `inferencemesh serve --replicas 2` (its router: "
                "default affinity) vs a second `inferencemesh router --affinity-ttl 0.001` (affinity off: by load, "
                "equal loads by a per-prompt hash) in front of the same two frontends; each phase its own system "
                "prompt and openings",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "processor": platform.processor() or platform.machine(),
                    "load_average_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]},
        "settings": {"conversations": args.conversations, "turns": args.turns, "concurrency": args.concurrency,
                     "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": args.ignore_eos,
                     "system_chars": args.system_chars, "stages_per_pipeline": args.stages, "replicas": 2,
                     "serve_extra_flags": args.serve_arg, "seed": args.seed, "model": model,
                     "serve": plan, "baseline_affinity_ttl_s": BASELINE_TTL_S,
                     "order": ("baseline phase first, then affinity" if args.baseline_first
                               else "affinity phase first, then baseline"), "prompts": prompts},
        "results": results,
        "duration_s": round(time.time() - started, 1),
    }
    print_table(results, args.turns)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nrouter-affinity: wrote {args.json}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as stop:  # Ctrl-C, SIGTERM, SIGHUP: every process it started is stopped by now
        print(f"router-affinity: interrupted ({stop or 'Ctrl-C'}); every process it started is stopped",
              file=sys.stderr)
        sys.exit(130)
