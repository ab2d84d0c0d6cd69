"""Supervised processes, through the real command (`python -m inferencemesh`, this tree's CLI):
children die with their parent whatever kills it, SIGHUP stops like SIGTERM, and a taken port or
an impossible plan is one line and an exit status, with nothing left running."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from mesh_helpers import free_serve_port

from inferencemesh.programs.process import free_port

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
CLI = [sys.executable, "-m", "inferencemesh"]


def program_of(pid: int) -> str | None:
    """Which `inferencemesh` program a process runs (the word after `-m inferencemesh`): not any
    argument that happens to say "frontend" (a stage's --peers does)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return argv[argv.index("inferencemesh") + 1] if "inferencemesh" in argv[:-1] else None


def session_members(sid: int) -> list[int]:
    """Live (not zombie) processes of session `sid`, read from /proc: serve's children stay in
    its session (their own process groups), so this finds every process it started."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp session ...
        if int(fields[3]) == sid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def wait_until_gone(sid: int, timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := session_members(sid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@contextmanager
def serve_started(*flags: str) -> Iterator[tuple[subprocess.Popen, list[str]]]:
    """`serve` in a session of its own, running until its endpoint line is printed."""
    port = free_serve_port()
    proc = subprocess.Popen([*CLI, "serve", "--port", str(port), "--max-sessions", "2", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=REPO,
                            start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    try:
        deadline = time.monotonic() + 300
        while not any("OpenAI endpoint" in line for line in lines):
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "serve never announced its endpoint:\n" + "".join(lines)
            time.sleep(0.5)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # announced only once bound
        yield proc, lines
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        for pid in session_members(proc.pid):  # whatever a failed test left
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_serve_killed_by_sigkill_leaves_no_process() -> None:
    with serve_started() as (proc, lines):
        members = session_members(proc.pid)
        assert len(members) == 3, "".join(lines)  # serve, stage 1, frontend
        for pid in set(members) - {proc.pid}:  # the children's spinning is serve's (process.prepare_process)
            assert b"GOMP_SPINCOUNT=10000\0" in Path(f"/proc/{pid}/environ").read_bytes()
        proc.kill()  # serve alone: nothing of it runs to stop the children
        proc.wait(10)
        left = wait_until_gone(proc.pid)
        assert not left, f"still running after serve was killed: {left}\n" + "".join(lines)


@pytest.mark.slow
def test_sighup_stops_serve_cleanly() -> None:
    with serve_started() as (proc, lines):
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(60) == 0, "".join(lines)
        assert not wait_until_gone(proc.pid), "".join(lines)
        assert "inferencemesh: stopped" in "".join(lines) and "Traceback" not in "".join(lines), "".join(lines)


@pytest.mark.slow
def test_sighup_stops_the_frontend_as_sigterm_does() -> None:
    """uvicorn handles SIGTERM only; the frontend relays SIGHUP to it, so it drains and shuts down
    gracefully and exits 0 as after SIGTERM, instead of dying of the SIGHUP at once."""
    with serve_started() as (proc, lines):
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        frontend = next(int(pid) for pid in children if program_of(int(pid)) == "frontend")
        os.kill(frontend, signal.SIGHUP)
        assert proc.wait(60) == 1, "".join(lines)  # serve stops once its frontend is gone
        text = "".join(lines)
        assert "Application shutdown complete" in text and "frontend exited (0)" in text, text
        assert "draining: 0 request(s) in flight" in text, text  # the SIGTERM path: a drain, with nothing to wait for
        assert not wait_until_gone(proc.pid), "".join(lines)


@pytest.mark.slow
def test_bench_stopped_by_sigterm_stops_its_stage_processes(tmp_path: Path) -> None:
    env = {**ENV, "HOME": str(tmp_path)}  # the shape's checkpoint is cached under ~/.cache
    proc = subprocess.Popen([*CLI, "bench", "--shape", "llama-tiny", "--dtype", "float32", "--stages", "2",
                             "--first-stage", "process", "--concurrency", "1", "--new-tokens", "2000",
                             "--repeats", "50"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    try:
        deadline = time.monotonic() + 240
        while not any("interleaved rounds" in line for line in lines):  # its stage processes serve
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.5)
        assert len(session_members(proc.pid)) == 3, "".join(lines)  # bench and two stage processes
        proc.terminate()
        assert proc.wait(60) == 128 + signal.SIGTERM, "".join(lines)
        assert not wait_until_gone(proc.pid), "".join(lines)
        assert "Traceback" not in "".join(lines), "".join(lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in session_members(proc.pid):
            os.kill(pid, signal.SIGKILL)


def run_cli(*argv: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """The command in a session of its own; afterwards, nothing of that session may run."""
    proc = subprocess.Popen([*CLI, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env or ENV, cwd=REPO, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not wait_until_gone(proc.pid, 10), "processes left running"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def assert_one_line_error(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and "terminate called" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, done.stderr
    assert all(word in errors[0] for word in words), errors[0]


@contextmanager
def taken_port() -> Iterator[int]:
    with socket.socket() as holder:
        holder.bind(("", 0))  # every interface: as a stage's metrics binds
        holder.listen()
        yield holder.getsockname()[1]


def test_serve_on_a_taken_port_is_one_line() -> None:
    with taken_port() as port:
        done = run_cli("serve", "--port", str(port), timeout=60)
    assert_one_line_error(done, "port", str(port), "in use")
    assert "OpenAI endpoint" not in done.stdout


def test_serve_with_a_taken_stage_metrics_port_is_one_line() -> None:
    with taken_port() as port:
        # Stage 1's metrics port (stage 0 is embedded): --stage-metrics-port + 1.
        done = run_cli("serve", "--port", str(free_port()), "--stage-metrics-port", str(port - 1), timeout=60)
    assert_one_line_error(done, "stage 1 metrics", str(port))


def test_stage_with_a_taken_metrics_port_is_one_line() -> None:
    with taken_port() as port:
        done = run_cli("stage", "--model", "bundled://imesh-code-target", "--layers", "0:1", "--stage-index", "0",
                       "--num-stages", "1", "--port", "0", "--metrics-port", str(port), timeout=60)
    assert_one_line_error(done, "metrics", str(port))


def test_bench_with_more_stages_than_layers_is_one_line(tmp_path: Path) -> None:
    env = {**ENV, "HOME": str(tmp_path)}  # the shape's checkpoint is cached under ~/.cache
    done = run_cli("bench", "--shape", "llama-tiny", "--dtype", "float32", "--stages", "4", env=env)
    assert_one_line_error(done, "4 stages", "2 layers")


CHILD = textwrap.dedent("""
    import sys, threading, time
    from inferencemesh.programs.process import watch_lifeline
    watch_lifeline()
    print("ready", flush=True)
    time.sleep(120)
""")

PARENT = textwrap.dedent("""
    import subprocess, sys, threading
    from inferencemesh.programs.process import supervised_popen_kwargs
    started = []
    def start():  # from a helper thread: no parent-death signal, the lifeline alone
        started.append(subprocess.Popen([sys.executable, "-c", sys.argv[1]], **supervised_popen_kwargs()))
    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    print(started[0].pid, flush=True)
    started[0].wait()
""")


def test_the_lifeline_alone_stops_a_child_whose_parent_was_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD], stdout=subprocess.PIPE, text=True, env=ENV,
                              start_new_session=True)
    try:
        child = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "ready"
        parent.kill()
        parent.wait(10)
        assert not wait_until_gone(parent.pid, 15), f"child {child} outlived its parent"
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)


def test_one_set_up_for_every_program() -> None:
    """process.prepare_process and set_up_process: the spin default before torch loads (a value
    given wins), huge pages for a local mesh (serve, bench) and what it starts but not for a pod's
    program (a value given wins there too), grad mode off and the threads a program asks for."""
    script = textwrap.dedent("""
        import os, sys
        from inferencemesh.programs.process import prepare_process, set_up_process
        prepare_process(sys.argv[1])
        import torch
        set_up_process("stage", threads=1)
        print(os.environ["GOMP_SPINCOUNT"], os.environ.get("THP_MEM_ALLOC_ENABLE", "-"), torch.is_grad_enabled(),
              torch.get_num_threads())
    """)
    env = {k: v for k, v in ENV.items() if k not in ("GOMP_SPINCOUNT", "OMP_NUM_THREADS", "THP_MEM_ALLOC_ENABLE")}

    def run(program: str, **extra: str) -> list[str]:
        done = subprocess.run([sys.executable, "-c", script, program], capture_output=True, text=True, check=True,
                              env={**env, **extra})
        return done.stdout.split()

    assert run("stage") == ["10000", "-", "False", "1"]
    assert run("serve")[:2] == run("bench")[:2] == ["10000", "1"]
    assert run("serve", GOMP_SPINCOUNT="0", THP_MEM_ALLOC_ENABLE="0")[:2] == ["0", "0"]
    assert run("frontend", THP_MEM_ALLOC_ENABLE="1")[1] == "1"
