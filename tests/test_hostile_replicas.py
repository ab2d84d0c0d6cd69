"""Replica kills under `inferencemesh serve --replicas 2`, as a user runs it: `kill -9` of one
replica's frontend leaves the router and the other replica serving, and serve restarts the dead
one (within its restart budget, logged) instead of stopping the whole mesh."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from hostile import INNOCENT, assert_unharmed
from mesh_helpers import serving_replicas

pytestmark = pytest.mark.slow


def frontend_pid(serve_pid: int, port: int) -> int:
    """The pid of serve's frontend child listening on `port` (its argv says --port PORT)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode().split("\0")
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == serve_pid and "frontend" in argv and argv[argv.index("--port") + 1] == str(port):
            return int(entry.name)
    raise AssertionError(f"no frontend child of {serve_pid} on port {port}")


def test_a_killed_replica_leaves_the_router_and_the_other_replica_serving_and_comes_back() -> None:
    with serving_replicas() as (base, proc, lines, frontends):
        victim, survivor = frontends["0"], frontends["1"]
        os.kill(frontend_pid(proc.pid, int(victim.rsplit(":", 1)[1])), signal.SIGKILL)
        killed = time.monotonic()

        time.sleep(1.0)  # a brief moment: serve notices, the router's next attempt goes elsewhere
        with httpx.Client(timeout=30) as client:
            codes = [client.post(f"{base}/v1/completions", json=INNOCENT).status_code for _ in range(8)]
        assert codes == [200] * 8, codes
        assert proc.poll() is None, "serve stopped when one replica died:\n" + "".join(lines)
        assert_unharmed(survivor, 4)

        # The dead replica is restarted (logged) and serves again: through its own port, and the
        # router keeps answering while it loads (its 503 not_ready is retried on the other).
        back = None
        while back is None and time.monotonic() - killed < 120:
            try:
                if httpx.get(f"{victim}/ready", timeout=2).status_code == 200:
                    back = time.monotonic() - killed
            except httpx.HTTPError:
                pass
            assert httpx.post(f"{base}/v1/completions", json=INNOCENT, timeout=30).status_code == 200
            time.sleep(0.5)
        text = "".join(lines)
        assert back is not None, "the killed replica never came back:\n" + text
        print(f"the killed replica answered /ready again {back:.1f}s after the kill")
        assert re.search(r"pipeline 0: frontend-0 exited \(-9\); restarted it \(restart 1;", text), text
        assert_unharmed(victim, 4)
        assert proc.poll() is None, text
