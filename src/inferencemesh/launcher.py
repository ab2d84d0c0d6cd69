"""`inferencemesh serve`: a whole mesh as local processes on loopback.

The same plan the operator would make, the same `inferencemesh stage` / `inferencemesh
frontend` programs the pods run. Stages start first and the frontend only once every stage
reports SERVING, downstream first; a stage that dies is restarted (as its Deployment would
be); Ctrl-C stops everything. LocalStages is also what the benchmarks and tests start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from inferencemesh.plan_command import plan_from_args
from inferencemesh.planner import StagePlan, render_plan

RESTART_BACKOFF_S = 2.0
CLI = [sys.executable, "-m", "inferencemesh.cli"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class ManagedProcess:
    name: str
    argv: list[str]
    env: dict[str, str] | None = None
    process: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0

    def start(self) -> None:
        env = {**os.environ, **self.env} if self.env else None
        self.process = subprocess.Popen(self.argv, env=env, start_new_session=True)  # Ctrl-C is ours to relay
        self.started_at = time.monotonic()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        if not self.alive():
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@dataclass(frozen=True)
class StageSettings:
    """What every stage process of a local mesh shares."""

    dtype: str = "auto"
    wire_dtype: str | None = None
    max_context: int = 2048
    max_sessions: int = 16
    session_ttl: float = 300.0
    device: str = "auto"
    revision: str | None = None
    debug_telemetry: bool = False
    tls_dir: str | None = None
    max_batch_tokens: int | None = None  # None: the stage's default
    env: dict[str, str] = field(default_factory=dict)


class LocalStages:
    """The stage processes of one plan, on loopback ports."""

    def __init__(self, model: str, plan: list[StagePlan], settings: StageSettings, base_port: int = 0) -> None:
        self.model, self.plan, self.settings = model, plan, settings
        self.ports = [base_port + i if base_port else free_port() for i in range(len(plan))]
        self.metrics_ports = [free_port() for _ in plan]
        # Idle stages on a shared CPU must not spin long in OpenMP barriers (the default spin
        # steals cores from the stage that is computing): measured on 2 cores, llama-150m, 2 stages,
        # 10k spins gave 0.92x the 1-stage tokens/s where the default gave 0.83x.
        env = {"GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", "10000"), **settings.env}
        self.processes = [ManagedProcess(f"stage-{i}", self._argv(i), env) for i in range(len(plan))]

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    def _argv(self, index: int) -> list[str]:
        stage, s = self.plan[index], self.settings
        argv = CLI + [
            "stage", "--model", self.model, "--dtype", s.dtype,
            "--layers", f"{stage.layer_start}:{stage.layer_end}", "--stage-index", str(index),
            "--num-stages", str(len(self.plan)), "--host", "127.0.0.1", "--port", str(self.ports[index]),
            "--metrics-port", str(self.metrics_ports[index]), "--max-context", str(s.max_context),
            "--max-sessions", str(s.max_sessions), "--session-ttl", str(s.session_ttl), "--device", s.device,
        ]
        if index + 1 < len(self.plan):
            argv += ["--downstream", f"127.0.0.1:{self.ports[index + 1]}"]
        if s.wire_dtype:
            argv += ["--wire-dtype", s.wire_dtype]
        if s.revision:
            argv += ["--revision", s.revision]
        if s.debug_telemetry:
            argv.append("--debug-telemetry")
        if s.tls_dir:
            argv += ["--tls-dir", s.tls_dir]
        if s.max_batch_tokens:
            argv += ["--max-batch-tokens", str(s.max_batch_tokens)]
        return argv

    def start(self) -> None:
        for proc in reversed(self.processes):  # downstream first
            proc.start()

    def wait_ready(self, timeout: float = 300.0, stopping: Callable[[], bool] = lambda: False,
                   on_ready: Callable[[int], None] | None = None) -> None:
        """Block until every stage is SERVING, last stage first; RuntimeError if one exits."""
        deadline = time.monotonic() + timeout
        for index in reversed(range(len(self.processes))):
            while not asyncio.run(_serving(self.addresses[index], 1.0, self.settings.tls_dir)):
                proc = self.processes[index]
                if not proc.alive():
                    raise RuntimeError(f"{proc.name} exited with {proc.process.returncode} while loading")
                if stopping() or time.monotonic() > deadline:
                    raise TimeoutError(f"{proc.name} not ready after {timeout:.0f}s")
            if on_ready is not None:
                on_ready(index)

    def restart_dead(self) -> list[ManagedProcess]:
        """Restart stages that exited (at most once per RESTART_BACKOFF_S each)."""
        restarted = []
        for proc in self.processes:
            if not proc.alive() and time.monotonic() - proc.started_at > RESTART_BACKOFF_S:
                proc.restarts += 1
                proc.start()
                restarted.append(proc)
        return restarted

    def stop(self) -> None:
        for proc in self.processes:
            with contextlib.suppress(Exception):
                proc.stop()


async def _serving(address: str, deadline: float, tls_dir: str | None = None) -> bool:
    from inferencemesh import tls
    from inferencemesh.frontend.pipeline import GrpcPipeline

    pipeline = GrpcPipeline([address], tls=tls.load(tls_dir))
    try:
        return await pipeline.wait_ready(deadline)
    finally:
        await pipeline.close()


def frontend_argv(args: argparse.Namespace, model: str, addresses: list[str]) -> list[str]:
    argv = CLI + [
        "frontend", "--model", model, "--dtype", args.dtype, "--stage-addresses", ",".join(addresses),
        "--host", args.host, "--port", str(args.port), "--max-context", str(args.max_context),
        "--max-sessions", str(args.max_sessions), "--device", args.device, "--draft-threads", str(args.draft_threads),
    ]
    for flag, value in (("--served-model-name", args.served_model_name), ("--speculative", args.speculative),
                        ("--draft", args.draft), ("--window", args.window), ("--revision", args.revision),
                        ("--tls-dir", args.tls_dir)):
        if value:
            argv += [flag, value]
    if args.no_draft:
        argv.append("--no-draft")
    return argv


def run_serve(args: argparse.Namespace) -> int:
    planned = plan_from_args(args)
    if planned is None:
        return 2
    model, plan = planned
    print(f"inferencemesh: serving {model}\n{render_plan(plan)}", flush=True)
    settings = StageSettings(dtype=args.dtype, wire_dtype=args.wire_dtype, max_context=args.max_context,
                             max_sessions=args.max_sessions, device=args.device, revision=args.revision,
                             debug_telemetry=args.debug_telemetry, tls_dir=args.tls_dir,
                             max_batch_tokens=args.max_batch_tokens)
    stages = LocalStages(model, plan, settings, args.base_stage_port)
    frontend = ManagedProcess("frontend", frontend_argv(args, model, stages.addresses))
    stopping = False

    def request_stop(signum, _frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        stages.start()
        try:
            stages.wait_ready(stopping=lambda: stopping, on_ready=lambda i: print(
                f"inferencemesh: stage {i} ready on {stages.addresses[i]} (metrics :{stages.metrics_ports[i]})",
                flush=True))
        except (RuntimeError, TimeoutError) as err:
            print(f"inferencemesh: {err}; see its log above", file=sys.stderr)
            return 130 if stopping else 1
        frontend.start()
        print(f"inferencemesh: OpenAI endpoint http://{args.host}:{args.port}/v1 (Ctrl-C to stop)", flush=True)
        while not stopping:
            time.sleep(0.5)
            if stopping:
                break
            for proc in stages.restart_dead():
                print(f"inferencemesh: {proc.name} had exited; restarted it (restart {proc.restarts})",
                      file=sys.stderr, flush=True)
            if not frontend.alive():
                print(f"inferencemesh: frontend exited ({frontend.process.returncode})", file=sys.stderr)
                return 1
        return 0
    finally:
        frontend.stop()
        stages.stop()
        print("inferencemesh: stopped", flush=True)
