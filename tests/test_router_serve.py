"""`inferencemesh serve --replicas 2`: two whole pipelines of the bundled model behind the router,
as a user runs it, with the official openai client, and an API key (the router presents it on its own
requests to the frontends: their KV events are authenticated)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from mesh_helpers import serving_replicas
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from inferencemesh.config import API_KEY_ENV
from inferencemesh.protocol.kv_events import KvEventPage, prompt_digests

pytestmark = pytest.mark.slow
KEY = "serve-router-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def routed(base: str) -> dict[str, int]:
    return {r["name"]: r["routed"] for r in httpx.get(f"{base}/router/replicas", timeout=5).json()["replicas"]}


def replicas(base: str) -> dict[str, dict]:
    return {r["name"]: r for r in httpx.get(f"{base}/router/replicas", timeout=5).json()["replicas"]}


def affinity(base: str, outcome: str, scorer: str) -> dict[str, float]:
    """replica -> the router's prefix_affinity_{outcome} for this scorer."""
    name = f"inferencemesh_router_prefix_affinity_{outcome}"
    return {sample.labels["replica"]: sample.value
            for family in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=5).text)
            if family.name == name for sample in family.samples
            if sample.name == name + "_total" and sample.labels["scorer"] == scorer}


def cached_blocks(frontend: str, prompt: str) -> tuple[set[bytes], set[bytes]]:
    """(the prompt's reusable blocks' digests, every block the frontend's cache holds), from its own
    /tokenize and KV events: the digests the router computes are the ones it publishes."""
    ids = httpx.post(f"{frontend}/tokenize", json={"prompt": prompt}, headers=AUTH, timeout=10).json()["tokens"]
    page = KvEventPage.from_json(httpx.get(f"{frontend}/kv/events", headers=AUTH, timeout=10).json())
    assert page.snapshot
    return set(prompt_digests(ids, page.salt, page.block_tokens, 10_000)), set(page.blocks)


def wait_for(what: str, check: object, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _blocks_route_where_the_cache_holds_them(client: OpenAI, model: str, base: str, frontends: dict[str, str]) -> None:
    """A prompt computed on one replica behind the router's back (sent to its frontend directly): its
    longer continuation is routed there by the replica's KV events alone, counted as a hit by
    blocks; once that replica's cache evicted the blocks, no replica is preferred (a miss)."""
    wait_for("the router never scored by blocks", lambda: httpx.get(f"{base}/router/replicas").json()["scorer"]
             == "blocks")
    holder, url = "p1", frontends["1"]
    prompt = "".join(f"def kv_route_{i}(x):\n    return x + {i * 31}\n\n" for i in range(10))
    assert httpx.get(f"{url}/kv/events", timeout=10).status_code == 401  # the router presents the key
    direct = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    direct.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    digests, held = cached_blocks(url, prompt)
    assert len(digests) >= 4 and digests <= held
    wait_for("the router never read p1's blocks", lambda: replicas(base)[holder]["kv_blocks"] >= len(held))
    hits, before = affinity(base, "hits", "blocks"), routed(base)
    client.completions.create(model=model, prompt=prompt + "def kv_route_main(", max_tokens=2, temperature=0)
    after = routed(base)
    assert after[holder] == before[holder] + 1, (before, after)
    assert affinity(base, "hits", "blocks").get(holder, 0) == hits.get(holder, 0) + 1
    for i in range(4):  # past the pool's 1,024 positions: the prompt's blocks are reclaimed (LRU)
        filler = "".join(f"class Filler{i}_{j}:\n    size = {j * 977 + i}\n\n" for j in range(24))
        direct.completions.create(model=model, prompt=filler, max_tokens=1, temperature=0)
    digests, held = cached_blocks(url, prompt)
    assert not digests & held
    wait_for("the router never read p1's evictions", lambda: replicas(base)[holder]["kv_blocks"] == len(held))
    misses = sum(affinity(base, "misses", "blocks").values())
    client.completions.create(model=model, prompt=prompt + "def kv_route_main(", max_tokens=2, temperature=0)
    assert sum(affinity(base, "misses", "blocks").values()) == misses + 1


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        out = subprocess.run(["pgrep", "-P", str(todo.pop())], capture_output=True, text=True).stdout.split()
        found += [int(p) for p in out]
        todo += [int(p) for p in out]
    return found


def _a_shared_prefix_lands_on_one_replica(client: OpenAI, model: str, base: str) -> None:
    """A long shared prefix: every request lands where the first went."""
    prefix = "".join(f"def helper_{i}(x):\n    return x * {i}\n\n" for i in range(12))
    before = routed(base)
    for i in range(5):
        done = client.completions.create(model=model, prompt=prefix + f"def main_{i}(", max_tokens=4, temperature=0)
        assert done.choices[0].text is not None
    after = routed(base)
    gained = {name: after[name] - before[name] for name in after}
    assert sorted(gained.values()) == [0, 5], gained


def _a_burst_is_answered_by_both(client: OpenAI, model: str, base: str) -> None:
    """A burst of 16 different prompts: all answered, both replicas used."""
    before = routed(base)

    def ask(i: int) -> int:
        raw = client.completions.with_raw_response.create(model=model, prompt=f"# task {i}: {'x' * i}\nimport",
                                                          max_tokens=4, temperature=0)
        return raw.status_code

    with ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(ask, range(16)))
    assert statuses == [200] * 16
    after = routed(base)
    gained = {name: after[name] - before[name] for name in after}
    assert sum(gained.values()) == 16 and all(n > 0 for n in gained.values()), gained


def _ctrl_c_twice_during_a_stream(client: OpenAI, model: str, proc: subprocess.Popen, lines: list[str]) -> None:
    """Ctrl-C with a long stream in flight: the router holds the stop for it (it goes first); a
    second Ctrl-C stops everything at once, the stream cut."""
    # As long as the context allows (512), and the second Ctrl-C as soon as serve has taken the
    # first: 400 tokens once ran to their end in the fixed second between the two.
    stream = iter(client.completions.create(model=model, prompt="def long(", max_tokens=500, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    next(stream)
    proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 5
    while "Ctrl-C again to stop at once" not in "".join(lines):
        assert time.monotonic() < deadline, "".join(lines)
        time.sleep(0.05)
    assert proc.poll() is None, "".join(lines)
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(15) == 0, "".join(lines)
    assert time.monotonic() - started < 10
    finished: list[str] = []
    with contextlib.suppress(Exception):  # the cut connection: the openai client's error or httpx's
        finished += [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
    assert "length" not in finished  # cut, not run to its 500 tokens


def test_two_replicas_behind_the_router(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, KEY)  # serve's environment: its frontends and its router inherit it
    # a small pool (64 blocks): a few prompts sent to one replica evict what its cache held
    with serving_replicas("--kv-cache-tokens", "1024") as (base, proc, lines, frontends):
        text = "".join(lines)
        assert sorted(frontends) == ["0", "1"] and "router over 2 pipelines" in text, text
        children = descendants(proc.pid)
        commands = sorted(Path(f"/proc/{c}/cmdline").read_bytes().split(b"\0")[3].decode() for c in children)
        assert commands == ["frontend", "frontend", "router"], commands
        client = OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
        model = client.models.list().data[0].id
        assert set(routed(base)) == {"p0", "p1"}
        _a_shared_prefix_lands_on_one_replica(client, model, base)
        _a_burst_is_answered_by_both(client, model, base)
        _blocks_route_where_the_cache_holds_them(client, model, base, frontends)
        metrics = httpx.get(f"{base}/metrics").text
        assert 'inferencemesh_router_prefix_affinity_hits_total{replica=' in metrics
        # each pipeline's frontend answers on its own port too
        assert all(httpx.get(f"{url}/ready").status_code == 200 for url in frontends.values())
        _ctrl_c_twice_during_a_stream(client, model, proc, lines)
    # nothing serve started is left
    assert proc.returncode is not None
    assert KEY not in "".join(lines)  # nothing secret in the output of serve, its frontends or its router
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{c}") for c in children):
        assert time.monotonic() < deadline, [c for c in children if os.path.exists(f"/proc/{c}")]
        time.sleep(0.2)
