"""`inferencemesh serve` as a user runs it: the bundled model, real processes, the official openai client."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from mesh_helpers import serving
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from inferencemesh.bundled import resolve_model
from inferencemesh.checkpoint.read import read_local
from inferencemesh.config import DEFAULT_MAX_BATCH_TOKENS, DEFAULT_MAX_CONTEXT
from inferencemesh.programs.process import ManagedProcess, stop_processes
from inferencemesh.programs.supervisor import stop_mesh
from inferencemesh.protocol.health import check
from inferencemesh.protocol.transport import message_limit
from inferencemesh.tls import TlsMaterial

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served():
    with serving() as running:
        yield running


def test_openai_client_completions_and_chat(served) -> None:
    base, _, _ = served
    client = OpenAI(base_url=f"{base}/v1", api_key="unused")
    model = client.models.list().data[0].id
    done = client.completions.create(model=model, prompt="def add(a, b):\n", max_tokens=24, temperature=0)
    assert done.choices[0].text and done.usage.completion_tokens > 0
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="def add(a, b):\n", max_tokens=24, temperature=0, stream=True) if c.choices)
    assert streamed == done.choices[0].text  # greedy: streaming changes nothing
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "import os"}],
                                          max_tokens=16, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason in ("stop", "length")
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "import os"}], max_tokens=16, temperature=0,
        stream=True) if c.choices]
    assert "".join(pieces) == chat.choices[0].message.content


STAGE_SERIES = {"inferencemesh_stage_forward_seconds", "inferencemesh_stage_active_sessions",
                "inferencemesh_stage_tokens"}


def test_metrics_of_frontend_and_every_stage_parse(served) -> None:
    """serve's default embeds stage 0 in the frontend: its series are on the frontend's page,
    stage 1's on the stage process's own."""
    base, _, lines = served
    stage_ports = [int(m) for m in re.findall(r"metrics :(\d+)", "".join(lines))]
    assert len(stage_ports) == 1 and "stage 0 runs inside the frontend" in "".join(lines), "".join(lines)
    pages = {"frontend": httpx.get(f"{base}/metrics").text,
             "stage1": httpx.get(f"http://127.0.0.1:{stage_ports[0]}/metrics").text}
    for name, text in pages.items():
        families = list(text_string_to_metric_families(text))
        names = {f.name for f in families}
        stages = {s.labels["stage"] for f in families if f.name in STAGE_SERIES for s in f.samples}
        assert STAGE_SERIES <= names, names
        if name == "frontend":
            assert {"inferencemesh_time_to_first_token_seconds", "inferencemesh_generation_tokens",
                    "inferencemesh_microbatch_frames", "inferencemesh_microbatches_in_flight"} <= names
            sizes = next(f for f in families if f.name == "inferencemesh_microbatch_frames")
            assert next(s.value for s in sizes.samples if s.name.endswith("_count")) > 0  # the earlier test's
            assert stages == {"0"}
        else:
            assert "inferencemesh_stage_activation_bytes_sent" in names and stages == {"1"}
        if shutil.which("promtool"):
            check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
            assert check.returncode == 0, f"{name}: {check.stdout}{check.stderr}"


def test_a_separate_first_stage_answers_as_the_embedded_one(served) -> None:
    """`--no-embed-first-stage`: stage 0 as a process of its own (3 processes), the same answers."""
    prompts = ["def add(a, b):\n", "import os\nimport sys\n"]

    def greedy(base: str) -> list[str]:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        model = client.models.list().data[0].id
        return [client.completions.create(model=model, prompt=p, max_tokens=24, temperature=0).choices[0].text
                for p in prompts]

    embedded = greedy(served[0])
    with serving("--no-embed-first-stage") as (base, proc, lines):
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout
        assert len(children.split()) == 3, "".join(lines)  # two stage processes and the frontend
        assert "stage 0 ready on" in "".join(lines) and "inside the frontend" not in "".join(lines)
        assert greedy(base) == embedded


def flag_of_children(pid: int, flag: str) -> dict[str, str]:
    """The value of `flag` each child of `pid` was started with, by its command (stage, frontend)."""
    values = {}
    for child in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split():
        argv = Path(f"/proc/{child}/cmdline").read_bytes().decode().split("\0")
        values[argv[argv.index("-m") + 2]] = argv[argv.index(flag) + 1]
    return values


def tls_dirs_of_children(pid: int) -> dict[str, str]:
    return flag_of_children(pid, "--tls-dir")


def test_plan_shows_the_split_serve_runs_and_the_log_says_the_dtype(served) -> None:
    """`plan` with serve's flags prints the plan serve printed (the same device, first stage and
    dtype decisions), and each stage's log says what it computes in and why."""
    _, _, lines = served
    out = subprocess.run([sys.executable, "-m", "inferencemesh", "plan", "--max-sessions", "4"], capture_output=True,
                         text=True, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}).stdout
    table = out[out.index("stage  layers"):].strip()
    assert table in "".join(lines), "".join(lines)
    said = [line for line in lines if "compute in" in line]
    assert len(said) >= 2 and all(" (" in line for line in said), "".join(lines)  # stage 0, stage 1 (and the draft)


def test_stage_streams_take_the_plans_message_limit_at_both_ends(served) -> None:
    """Not gRPC's 256 MiB of old: the largest Batch this plan makes (transport.message_limit), given
    to the stage and the frontend alike."""
    _, proc, _ = served
    facts = read_local(resolve_model(None))
    limit = message_limit(hidden_size=facts.hidden_size, vocab_size=facts.vocab_size,
                          max_batch_tokens=DEFAULT_MAX_BATCH_TOKENS, max_sessions=4,  # serving()'s --max-sessions
                          max_context=DEFAULT_MAX_CONTEXT)
    assert flag_of_children(proc.pid, "--max-message-bytes") == {"stage": str(limit), "frontend": str(limit)}


def test_stages_refuse_plaintext_and_take_the_runs_certificates(served) -> None:
    """serve's stages listen on loopback with mutual TLS from a per-run CA: a plaintext client is
    refused, a client with the run's certificate is answered; the keys sit in a private directory."""
    _, proc, lines = served
    address = re.search(r"stage 1 ready on (\S+)", "".join(lines)).group(1)
    assert address.startswith("127.0.0.1:")
    assert not check(address, timeout=5)  # plaintext: the TLS handshake fails
    dirs = tls_dirs_of_children(proc.pid)
    assert set(dirs) == {"stage", "frontend"} and dirs["stage"] != dirs["frontend"]
    assert check(address, timeout=5, tls=TlsMaterial.from_dir(dirs["frontend"]))
    root = Path(dirs["stage"]).parent
    assert root == Path(dirs["frontend"]).parent and root.stat().st_mode & 0o777 == 0o700


def test_ctrl_c_lets_a_stream_finish_then_stops_every_process(served) -> None:
    """Ctrl-C while a stream runs: the frontend drains (the stream gets every token), then the
    stages stop, serve exits 0 and leaves nothing behind."""
    base, proc, lines = served
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout
    assert len(children.split()) == 2  # stage 1 and the frontend, which holds stage 0
    certificates = Path(tls_dirs_of_children(proc.pid)["stage"]).parent
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    stream = iter(client.completions.create(model=model, prompt="def add(a, b):\n", max_tokens=800, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    next(stream)
    proc.send_signal(signal.SIGINT)
    finished = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
    assert finished == ["length"], "".join(lines)  # all 800 tokens: the stop waited for them
    assert proc.wait(60) == 0, "".join(lines)
    text = "".join(lines)
    assert "draining: 1 request(s) in flight" in text and "Ctrl-C again to stop at once" in text, text
    time.sleep(1)
    for pid in children.split():
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
    assert not certificates.exists()  # the run's keys go with it


# ---- the stop's order and its second Ctrl-C, on stand-in processes (no model) ----------------

# A stand-in for a frontend, stage or router: on SIGTERM it notes the time, stays `grace` seconds
# (a drain, the router's open streams), notes the time again and exits 0.
STAND_IN = r"""
import signal, sys, time
log, name, grace = sys.argv[1], sys.argv[2], float(sys.argv[3])
def note(what):
    with open(log, "a") as out:
        out.write(f"{name} {what} {time.monotonic()}\n")
def term(*_):
    note("term")
    time.sleep(grace)
    note("exit")
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
note("up")
while True:
    time.sleep(0.05)
"""


def stand_in(log: Path, name: str, grace: float) -> ManagedProcess:
    proc = ManagedProcess(name, [sys.executable, "-c", STAND_IN, str(log), name, str(grace)])
    proc.start()
    return proc


def wait_up(log: Path, names: list[str]) -> None:
    deadline = time.monotonic() + 30
    while not all(f"{name} up" in (log.read_text() if log.exists() else "") for name in names):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def events(log: Path) -> dict[tuple[str, str], float]:
    return {(name, what): float(at) for name, what, at in (line.split() for line in log.read_text().splitlines())}


def stand_in_mesh(log: Path, *, frontend_grace: float, drain_timeout: float) -> tuple[ManagedProcess, list]:
    """A router and two pipelines (a frontend and two stages each) of stand-ins, all up."""
    router = stand_in(log, "router", 0.5)
    pipelines = [SimpleNamespace(frontend=stand_in(log, f"frontend-{r}", frontend_grace), drain_timeout=drain_timeout,
                                 stages=SimpleNamespace(processes=[stand_in(log, f"stage-{r}-{i}", 0.0)
                                                                   for i in range(2)]))
                 for r in range(2)]
    wait_up(log, ["router", "frontend-0", "frontend-1", "stage-0-0", "stage-0-1", "stage-1-0", "stage-1-1"])
    return router, pipelines


def everything(router: ManagedProcess, pipelines: list) -> list[ManagedProcess]:
    return [router, *(p.frontend for p in pipelines), *(s for p in pipelines for s in p.stages.processes)]


def test_the_stop_goes_router_then_frontends_then_stages(tmp_path: Path) -> None:
    """The router finishes its streams before a frontend is told to drain, and every frontend has
    drained before a stage is stopped; all exit on their own (0), none is left."""
    log = tmp_path / "log"
    router, pipelines = stand_in_mesh(log, frontend_grace=0.5, drain_timeout=30)
    stop_mesh(router, pipelines)
    seen = events(log)
    frontends = [f"frontend-{r}" for r in range(2)]
    stages = [f"stage-{r}-{i}" for r in range(2) for i in range(2)]
    assert all(seen["router", "exit"] <= seen[f, "term"] for f in frontends), seen
    assert all(seen[f, "exit"] <= seen[s, "term"] for f in frontends for s in stages), seen
    assert abs(seen["frontend-0", "term"] - seen["frontend-1", "term"]) < 0.4  # drained together, not in turn
    assert all(proc.returncode == 0 for proc in everything(router, pipelines))


def test_a_second_ctrl_c_kills_what_is_left_at_once(tmp_path: Path) -> None:
    """Frontends that would drain for 60 s: the hurry (serve's second signal) kills them, and the
    stages after them, without waiting."""
    log = tmp_path / "log"
    router, pipelines = stand_in_mesh(log, frontend_grace=60, drain_timeout=60)
    hurry = threading.Event()
    threading.Timer(1.0, hurry.set).start()
    started = time.monotonic()
    stop_mesh(router, pipelines, hurry.is_set)
    assert time.monotonic() - started < 5
    assert router.returncode == 0
    assert [p.frontend.returncode for p in pipelines] == [-signal.SIGKILL] * 2
    assert not any(proc.alive() for proc in everything(router, pipelines))
    for proc in everything(router, pipelines):
        assert not os.path.exists(f"/proc/{proc.process.pid}")  # reaped, not a zombie


def test_a_process_that_outlasts_its_grace_is_killed(tmp_path: Path) -> None:
    log = tmp_path / "log"
    slow = stand_in(log, "slow", 60)
    quick = stand_in(log, "quick", 0)
    wait_up(log, ["slow", "quick"])
    started = time.monotonic()
    stop_processes([slow, quick], timeout=1.0)
    assert 1.0 <= time.monotonic() - started < 4
    assert (slow.returncode, quick.returncode) == (-signal.SIGKILL, 0)
