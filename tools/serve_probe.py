"""`inferencemesh serve` as a benchmark sees it: started with some flags, asked for the time to
first token of a long prompt and for the decode rate of one stream, stopped with its process group.
Used by tools/prefill_dtypes.py and tools/pipeline_balance.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def serving(port: int, *flags: str) -> Iterator[str]:
    """The base URL of `inferencemesh serve --port PORT FLAGS...` once ready."""
    log = tempfile.TemporaryFile("w+")  # a file, not a pipe nobody reads until the end
    proc = subprocess.Popen([sys.executable, "-m", "inferencemesh", "serve", "--port", str(port), *flags],
                            stdout=log, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not answers(f"{base}/ready"):
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"serve exited: {log.read()}")
            if time.monotonic() > deadline:
                raise RuntimeError("serve not ready after 300 s")
            time.sleep(0.5)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(30)
        log.close()


def model_of(base: str) -> str:
    return httpx.get(f"{base}/v1/models").json()["data"][0]["id"]


def ttft(base: str, prompt: list[int]) -> float:
    """Seconds to the first streamed token of `prompt` (token ids), greedy."""
    body = {"model": model_of(base), "prompt": prompt, "max_tokens": 1, "stream": True, "temperature": 0}
    start = time.perf_counter()
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break
    return time.perf_counter() - start


def decode_rate(base: str, prompt: str, tokens: int) -> float:
    """Tokens per second of one greedy stream after its first token (ignore_eos: exactly `tokens`)."""
    body = {"model": model_of(base), "prompt": prompt, "max_tokens": tokens, "stream": True, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    first = end = None
    produced = 0
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("usage"):
                produced = chunk["usage"]["completion_tokens"]
            if chunk["choices"]:
                end = time.perf_counter()
                first = first or end
    if first is None or end is None or produced < 2:
        raise RuntimeError("the stream produced no tokens")
    return (produced - 1) / (end - first)
