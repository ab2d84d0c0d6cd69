"""The standing check after a hostile request: the server is unharmed.

Every hostile-input test (grammar bombs, cancellation storms, slow bodies, replica kills,
checkpoint bombs) ends with `assert_unharmed(base, max_sessions)`:
- an innocent request is answered within 2 s (INNOCENT_DEADLINE_S);
- `inferencemesh_num_requests_running` and `..._waiting` are back to 0 (no slot leaked);
- a burst of max_sessions concurrent requests is answered in full, every one 200.

`idle_latency(base)` measures the innocent request on an idle server, for the tests that check
latency during an attack stays within 2x of it.
"""

from __future__ import annotations

import asyncio
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

INNOCENT_DEADLINE_S = 2.0
MODEL = "imesh-code-target"
INNOCENT = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0}


def innocent_request(base: str, timeout: float = 30.0) -> float:
    """One small completion; its latency in seconds (raises unless it is a 200 with text)."""
    started = time.perf_counter()
    response = httpx.post(f"{base}/v1/completions", json=INNOCENT, timeout=timeout)
    elapsed = time.perf_counter() - started
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] is not None
    return elapsed


def idle_latency(base: str, tries: int = 3) -> float:
    """The innocent request's latency on an idle server (the best of a few, after a warm-up)."""
    innocent_request(base)
    return min(innocent_request(base) for _ in range(tries))


def gauges(base: str) -> dict[str, float]:
    """The frontend's request gauges (summed over their labels) from /metrics, parsed by
    Prometheus' own parser, and the share of the KV pool's blocks that requests reference: 0
    when idle, or blocks leaked (cached blocks nobody references do not count)."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    wanted = {"inferencemesh_num_requests_running", "inferencemesh_num_requests_waiting",
              "inferencemesh_kv_cache_usage_perc"}
    found = dict.fromkeys(wanted, 0.0)
    for family in text_string_to_metric_families(text):
        if family.name in wanted:
            found[family.name] = sum(sample.value for sample in family.samples)
    return found


def wait_for_idle(base: str, timeout: float = 10.0) -> dict[str, float]:
    """Wait until no request is running or waiting and no KV block is referenced; the gauges as
    last read."""
    deadline = time.monotonic() + timeout
    while True:
        now = gauges(base)
        if not any(now.values()) or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


async def _burst(base: str, count: int, timeout: float) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=timeout) as client:
        return await asyncio.gather(*(client.post(f"{base}/v1/completions", json=INNOCENT) for _ in range(count)))


def assert_unharmed(base: str, max_sessions: int, *, idle_timeout: float = 10.0) -> None:
    """The server took no harm: no request left running or waiting, an innocent request answered
    within INNOCENT_DEADLINE_S, and a burst of max_sessions requests all answered 200."""
    left = wait_for_idle(base, idle_timeout)
    assert not any(left.values()), f"requests left running or waiting, or KV blocks held, after the attack: {left}"
    latency = innocent_request(base, timeout=INNOCENT_DEADLINE_S * 5)
    assert latency < INNOCENT_DEADLINE_S, f"an innocent request took {latency:.2f}s after the attack"
    responses = asyncio.run(_burst(base, max_sessions, timeout=60))
    codes = [response.status_code for response in responses]
    assert codes == [200] * max_sessions, f"a burst of {max_sessions}: {codes}"
    left = wait_for_idle(base, idle_timeout)
    assert not any(left.values()), f"requests left running or waiting after the burst: {left}"
