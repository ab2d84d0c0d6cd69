"""What tools/kv_blocks_bench.py runs against one `inferencemesh serve`: the mesh (started from a
source tree as a user starts it, ready, stopped with its process group), its Prometheus counters,
and issue 35's benchmark scenarios, each a coroutine that returns its numbers.

Prompts of a given length are token ids: a fixed text tokenised by the server's own /tokenize and
cut at the length, so every tree computes the same prompt and the ideal counts are exact (each
response's usage confirms them)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

READY_TIMEOUT_S = 300
STOP_TIMEOUT_S = 60
POLL_S = 0.05  # how often a run reads the frontend's gauges
TOPICS = ["sum", "maximum", "median", "reverse", "sorted copy", "unique items", "length", "mean", "product",
          "first even number", "last word", "longest string"]


@dataclass
class Mesh:
    """One running `inferencemesh serve`: its endpoint, every /metrics it exposes, its model name."""

    base: str
    metrics_urls: list[str]
    model: str
    http: httpx.AsyncClient = field(default_factory=lambda: httpx.AsyncClient(timeout=60))
    _client: AsyncOpenAI | None = None

    def client(self) -> AsyncOpenAI:
        """One client for the run (making one costs tens of milliseconds: a retry "at once" must not)."""
        if self._client is None:
            self._client = AsyncOpenAI(base_url=f"{self.base}/v1", api_key="unused", timeout=900, max_retries=0)
        return self._client

    async def aclose(self) -> None:
        await self.http.aclose()
        if self._client is not None:
            await self._client.close()


def free_port() -> int:
    """A port P with P + 100.. P + 103 free too (serve's default stage metrics ports)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 60000 and all(_bindable(port + d) for d in (0, 100, 101, 102, 103)):
            return port
    raise RuntimeError("no free port with its metrics ports free")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@contextlib.contextmanager
def serving(src: Path, flags: list[str], log_dir: Path) -> Iterator[Mesh]:
    """`PYTHONPATH=SRC python3 -m inferencemesh serve --port P FLAGS`, ready (/ready answers and serve
    has announced its endpoint); SIGTERM to its process group afterwards, SIGKILL if it lingers."""
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="serve-", suffix=".log", dir=log_dir)[1])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(src), "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "inferencemesh", "serve", "--port", str(port), *flags],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=log_dir, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_ready(proc, base, log_path)
        text = log_path.read_text()
        stage_ports = sorted({int(p) for p in re.findall(r"\(metrics :(\d+)\)", text)})
        model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        yield Mesh(base, [f"{base}/metrics", *(f"http://127.0.0.1:{p}/metrics" for p in stage_ports)], model)
    finally:
        _stop(proc)


def _wait_ready(proc: subprocess.Popen, base: str, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            # the frontend answers /ready a moment before serve prints the endpoint (and the stages' ports)
            if httpx.get(f"{base}/ready", timeout=2).status_code == 200 and "OpenAI endpoint" in log_path.read_text():
                return
        time.sleep(0.5)
    raise RuntimeError(f"serve not ready after {READY_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    with contextlib.suppress(ProcessLookupError):  # a stage process the supervisor left behind
        os.killpg(proc.pid, signal.SIGKILL)


# --- metrics -------------------------------------------------------------------------------------

Snapshot = dict[str, float]  # 'name{label=value,...}' (model_name left out) -> value


def parse_metrics(text: str) -> Snapshot:
    out: Snapshot = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            out[f"{sample.name}{{{labels}}}"] = out.get(f"{sample.name}{{{labels}}}", 0.0) + sample.value
    return out


def total(snap: Snapshot, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    want = [f"{k}={v}" for k, v in labels.items()]
    found = 0.0
    for key, value in snap.items():
        metric, _, rest = key.partition("{")
        if metric == name and all(w in rest.rstrip("}").split(",") for w in want):
            found += value
    return found


async def scrape(mesh: Mesh, frontend_only: bool = False) -> Snapshot:
    snap: Snapshot = {}
    for url in mesh.metrics_urls[:1] if frontend_only else mesh.metrics_urls:
        snap.update(parse_metrics((await mesh.http.get(url)).text))
    return snap


def delta(after: Snapshot, before: Snapshot, name: str, **labels: str) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


class GaugePeaks:
    """The highest values of the frontend's gauges while a block runs (read every POLL_S)."""

    GAUGES = ("inferencemesh_num_requests_running", "inferencemesh_num_requests_waiting",
              "inferencemesh_kv_cache_usage_perc")

    def __init__(self, mesh: Mesh) -> None:
        self.mesh, self.peaks = mesh, dict.fromkeys(self.GAUGES, 0.0)
        self._task: asyncio.Task | None = None

    async def _poll(self) -> None:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                snap = await scrape(self.mesh, frontend_only=True)
                for g in self.GAUGES:
                    self.peaks[g] = max(self.peaks[g], total(snap, g))
            await asyncio.sleep(POLL_S)

    async def __aenter__(self) -> GaugePeaks:
        self._task = asyncio.create_task(self._poll())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


# --- requests ------------------------------------------------------------------------------------

@dataclass
class Stream:
    """One streamed request's timings (perf_counter seconds) and usage."""

    sent: float
    first: float = 0.0
    done: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = None

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first, per second after the first."""
        span = self.done - self.first
        return (self.completion_tokens - 1) / span if span > 0 and self.completion_tokens > 1 else 0.0


async def stream(mesh: Mesh, prompt: str | list[int], max_tokens: int,
                 started: asyncio.Event | None = None, logprobs: int | None = None) -> Stream:
    """A greedy streamed completion of text or token ids, to its end (completions, not chat: a
    random-weight shape has no chat template). With `logprobs`, every token is seen as it comes,
    also one that decodes to no text yet (a random-weight shape's tokens often do)."""
    out = Stream(time.perf_counter())
    response: Any = await mesh.client().completions.create(
        model=mesh.model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        logprobs=logprobs, stream_options={"include_usage": True})
    async with response:
        async for chunk in response:
            if chunk.choices and (chunk.choices[0].text or chunk.choices[0].logprobs) and not out.first:
                out.first = time.perf_counter()
                if started is not None:
                    started.set()
            if chunk.usage is not None:
                out.completion_tokens, out.prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                out.cached_tokens = details.cached_tokens if details is not None else None
    out.done = time.perf_counter()
    return out


async def first_token_then_close(mesh: Mesh, prompt: list[int], max_tokens: int) -> float:
    """Stream until the first token arrives, then close the connection (a stop button); its time."""
    response: Any = await mesh.client().completions.create(model=mesh.model, prompt=prompt, max_tokens=max_tokens,
                                                           temperature=0, stream=True)
    async for chunk in response:
        if chunk.choices and chunk.choices[0].text:
            break
    await response.close()
    return time.perf_counter()


async def prompt_ids(mesh: Mesh, tokens: int, seed: str) -> list[int]:
    """Exactly `tokens` token ids of a fixed code text (different for each `seed`), BOS first when
    the tokenizer adds one."""
    lines = "".join(f"def {seed}_helper_{i}(values):\n    \"\"\"Return the {TOPICS[i % len(TOPICS)]} of values "
                    f"{i}.\"\"\"\n    return compute(values, {i})\n\n" for i in range(tokens // 8 + 8))
    ids = await tokenize(mesh, lines, special=True)
    if len(ids) < tokens:
        raise RuntimeError(f"the fixed text has {len(ids)} tokens, fewer than {tokens}")
    return ids[:tokens]


async def tokenize(mesh: Mesh, text: str, special: bool) -> list[int]:
    body = {"model": mesh.model, "prompt": text, "add_special_tokens": special}
    response = await mesh.http.post(f"{mesh.base}/tokenize", json=body)
    response.raise_for_status()
    return list(response.json()["tokens"])


def short_prompt(i: int, kind: str = "task") -> str:
    """A distinct short code prompt (a few dozen tokens)."""
    topic = TOPICS[i % len(TOPICS)]
    return f"def {kind}_{i}(values):\n    \"\"\"Return the {topic} of a list of {i + 2} numbers.\"\"\"\n"


async def warm_up(mesh: Mesh) -> None:
    """A batch of short streams, then one alone: a fresh process pays one-off costs (allocations,
    kernels picked per shape) on its first batched and its first speculative passes."""
    await asyncio.gather(*(stream(mesh, short_prompt(900 + i, "warmup"), 24) for i in range(8)))
    await stream(mesh, short_prompt(999, "warmup"), 24)


# --- scenarios -----------------------------------------------------------------------------------

async def decode(mesh: Mesh, streams: int, bursts: int = 1, max_tokens: int = 64) -> dict[str, Any]:
    """`bursts` times `streams` distinct short streams at once: completion tokens over the wall
    time from each burst's first request to its last done (summed), and the most requests the
    frontend ran at once."""
    await warm_up(mesh)
    before = await scrape(mesh)
    runs: list[Stream] = []
    walls: list[float] = []
    async with GaugePeaks(mesh) as peaks:
        for b in range(bursts):
            start = time.perf_counter()
            runs += await asyncio.gather(*(stream(mesh, short_prompt(b * streams + i), max_tokens)
                                           for i in range(streams)))
            walls.append(time.perf_counter() - start)
    after = await scrape(mesh)
    tokens = sum(r.completion_tokens for r in runs)
    return {"tok_s": tokens / sum(walls), "completion_tokens": tokens, "wall_s": sum(walls), "burst_walls_s": walls,
            "max_running": peaks.peaks["inferencemesh_num_requests_running"],
            "max_waiting": peaks.peaks["inferencemesh_num_requests_waiting"],
            "max_kv_cache_usage_perc": peaks.peaks["inferencemesh_kv_cache_usage_perc"],
            # None where no first token showed text (a random-weight shape's often decode to none)
            "ttft_s_median": statistics.median(r.first - r.sent for r in runs) if all(r.first for r in runs) else None,
            "preemptions": delta(after, before, "inferencemesh_num_preemptions_total")}


async def burst(mesh: Mesh, requests: int = 16, prefix_tokens: int = 1450) -> dict[str, float]:
    """A cold burst sharing a prefix: the prompt tokens computed (queries - hits at the frontend,
    and stage 0's tokens), against the ideal: the prefix once plus every suffix."""
    await warm_up(mesh)
    prefix = await prompt_ids(mesh, prefix_tokens, "burst")
    suffixes = [await tokenize(mesh, "\n# " + short_prompt(i, "burst") + "\n", special=False) for i in range(requests)]
    before = await scrape(mesh)
    runs = await asyncio.gather(*(stream(mesh, prefix + s, 8) for s in suffixes))
    after = await scrape(mesh)
    ideal = prefix_tokens + sum(len(s) for s in suffixes)
    sent = sum(prefix_tokens + len(s) for s in suffixes)
    if sum(r.prompt_tokens for r in runs) != sent:
        raise RuntimeError(f"usage counts {sum(r.prompt_tokens for r in runs)} prompt tokens, {sent} were sent")
    queries = delta(after, before, "inferencemesh_prefix_cache_queries_total")
    hits = delta(after, before, "inferencemesh_prefix_cache_hits_total")
    stage0 = delta(after, before, "inferencemesh_stage_tokens_total", stage="0")
    return {"computed_over_ideal": (queries - hits) / ideal, "prompt_tokens_computed": queries - hits,
            "ideal": ideal, "prompt_tokens_sent": sent, "hits": hits, "queries": queries,
            "stage0_tokens": stage0, "stage0_over_ideal": stage0 / ideal,
            "cached_tokens_usage": sum(r.cached_tokens or 0 for r in runs)}


async def cancel_retry(mesh: Mesh, prompt_tokens: int = 1150, trials: int = 3) -> dict[str, float]:
    """Close the stream after its first token, send the identical request at once: the share of its
    prompt that hit (usage's cached_tokens), per trial (a new prompt each)."""
    await warm_up(mesh)
    shares, metric_shares, gaps = [], [], []
    for trial in range(trials):
        prompt = await prompt_ids(mesh, prompt_tokens, f"cancel{trial}")
        before = await scrape(mesh, frontend_only=True)
        closed = await first_token_then_close(mesh, prompt, 64)
        retry = await stream(mesh, prompt, 8)
        after = await scrape(mesh, frontend_only=True)
        gaps.append(retry.sent - closed)
        cached = retry.cached_tokens
        # both requests' hits: the first's are 0 (a prompt this server has not seen)
        metric_shares.append(delta(after, before, "inferencemesh_prefix_cache_hits_total") / prompt_tokens)
        shares.append((cached if cached is not None else metric_shares[-1] * prompt_tokens) / retry.prompt_tokens)
    return {"hit_share": sum(shares) / trials, "hit_share_min": min(shares),
            "hit_share_metrics": sum(metric_shares) / trials, "retry_gap_ms": 1000 * max(gaps),
            "prompt_tokens": prompt_tokens, "trials": trials}


async def mixed(mesh: Mesh, shorts: int = 7, long_tokens: int = 3000, context: int = 4096,
                pairs: int = 2, short_tokens: int = 128) -> dict[str, Any]:
    """`shorts` short streams alone, then beside one stream of a `long_tokens` prompt that is
    decoding (started first, its first token awaited), `pairs` times, then alone once more: their
    mean decode tok/s beside ÷ alone (alone phases bracket the beside ones: the machine drifts).
    Every stream asks for logprobs, so its first token is seen whatever its text (random weights)."""
    await warm_up(mesh)
    long_prompt = await prompt_ids(mesh, long_tokens, "long")

    async def shorts_rate(kind: str) -> float:
        runs = await asyncio.gather(*(stream(mesh, short_prompt(i, kind), short_tokens, logprobs=1)
                                      for i in range(shorts)))
        return sum(r.decode_tok_s for r in runs) / shorts

    alone, beside, long_throughout = [await shorts_rate("alone0")], [], True
    for pair in range(pairs):
        started = asyncio.Event()
        long_task = asyncio.create_task(stream(mesh, long_prompt, context - long_tokens - 16, started=started,
                                                logprobs=1))
        waited = asyncio.create_task(started.wait())
        await asyncio.wait([long_task, waited], return_when=asyncio.FIRST_COMPLETED)
        if long_task.done():
            waited.cancel()
            raise RuntimeError(f"the long stream ended before its first token: {long_task.result()}")
        beside.append(await shorts_rate(f"beside{pair}"))
        long_throughout &= not long_task.done()
        long_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await long_task
        alone.append(await shorts_rate(f"alone{pair + 1}"))
    mean_alone, mean_beside = statistics.mean(alone), statistics.mean(beside)
    return {"beside_over_alone": mean_beside / mean_alone, "alone_tok_s": mean_alone, "beside_tok_s": mean_beside,
            "alone_spread": (max(alone) - min(alone)) / mean_alone, "long_decoding_throughout": float(long_throughout),
            "alone_phases_tok_s": alone, "beside_phases_tok_s": beside}


def multiturn(src: Path, bench_flags: list[str], log_dir: Path) -> dict[str, float]:
    """The tree's own `inferencemesh bench --multi-turn --stages 2` (cache on ÷ off in one process)."""
    out = Path(tempfile.mkstemp(prefix="multiturn-", suffix=".json", dir=log_dir)[1])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(src)}
    cmd = [sys.executable, "-m", "inferencemesh", "bench", "--multi-turn", "--stages", "2", "--new-tokens", "16",
           *bench_flags, "--json", str(out)]
    done = subprocess.run(cmd, env=env, cwd=log_dir, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return multiturn_numbers(json.loads(out.read_text()))


def multiturn_numbers(report: dict[str, Any]) -> dict[str, float]:
    """The ratios issue 35 holds the bench to, from its JSON."""
    result = report["results"][0]
    turns = result["conversation"]["turns"]
    shared = result.get("shared_system_prompt") or [{}]
    return {"repeat_over_cold": result["repeat"]["repeat_over_cold"],
            "turn6_ttft_on_over_off": next(t["ttft_on_over_off"] for t in turns if t["turn"] == 6),
            "shared_prompt_on_over_off": shared[0].get("on_over_off", float("nan")),
            "decode_on_over_off": result["conversation"].get("decode_on_over_off") or float("nan"),
            "same_answers": float(bool(result["repeat"].get("same_answers", True))
                                  and bool(result["conversation"].get("same_answers", True)))}
