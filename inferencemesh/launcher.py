"""`inferencemesh serve`: a whole mesh as local processes on loopback.

The same plan the operator would make, the same `inferencemesh stage` / `inferencemesh
frontend` programs the pods run. Stages start first and the frontend only once every stage
reports SERVING, downstream first; a stage that dies is restarted (as its Deployment would
be); Ctrl-C stops everything.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from inferencemesh.bundled import resolve_model
from inferencemesh.checkpoint import CheckpointError
from inferencemesh.plan_command import plan_for
from inferencemesh.planner import PlanError, StagePlan, render_plan

RESTART_BACKOFF_S = 2.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class ManagedProcess:
    name: str
    argv: list[str]
    process: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = field(default=0.0)

    def start(self) -> None:
        self.process = subprocess.Popen(self.argv, start_new_session=True)  # own group: Ctrl-C is ours to relay
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


def stage_argv(args: argparse.Namespace, model: str, plan: list[StagePlan], ports: list[int],
               metrics_ports: list[int], index: int) -> list[str]:
    stage = plan[index]
    argv = [
        sys.executable, "-m", "inferencemesh.cli", "stage", "--model", model, "--dtype", args.dtype,
        "--layers", f"{stage.layer_start}:{stage.layer_end}", "--stage-index", str(index),
        "--num-stages", str(len(plan)), "--host", "127.0.0.1", "--port", str(ports[index]),
        "--metrics-port", str(metrics_ports[index]), "--max-context", str(args.max_context),
        "--max-sessions", str(args.max_sessions), "--device", args.device,
    ]
    if index + 1 < len(plan):
        argv += ["--downstream", f"127.0.0.1:{ports[index + 1]}"]
    if args.wire_dtype:
        argv += ["--wire-dtype", args.wire_dtype]
    if args.revision:
        argv += ["--revision", args.revision]
    if args.debug_telemetry:
        argv.append("--debug-telemetry")
    return argv


def frontend_argv(args: argparse.Namespace, model: str, ports: list[int]) -> list[str]:
    argv = [
        sys.executable, "-m", "inferencemesh.cli", "frontend", "--model", model, "--dtype", args.dtype,
        "--stage-addresses", ",".join(f"127.0.0.1:{p}" for p in ports), "--host", args.host,
        "--port", str(args.port), "--max-context", str(args.max_context), "--max-sessions", str(args.max_sessions),
        "--device", args.device,
    ]
    for flag, value in (("--served-model-name", args.served_model_name), ("--speculative", args.speculative),
                        ("--draft", args.draft), ("--window", args.window), ("--revision", args.revision)):
        if value:
            argv += [flag, value]
    if args.no_draft:
        argv.append("--no-draft")
    return argv


async def _wait_serving(address: str, deadline: float) -> bool:
    from inferencemesh.frontend.pipeline import GrpcPipeline

    pipeline = GrpcPipeline([address])
    try:
        return await pipeline.wait_ready(deadline)
    finally:
        await pipeline.close()


def run_serve(args: argparse.Namespace) -> int:
    model = resolve_model(args.model)
    try:
        plan = plan_for(model, stages=args.stages, stage_memory=args.stage_memory, dtype=args.dtype,
                        context_length=args.max_context, max_sessions=args.max_sessions, revision=args.revision)
    except (PlanError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"inferencemesh: serving {model}\n{render_plan(plan)}", flush=True)
    base = args.base_stage_port
    ports = [base + i if base else free_port() for i in range(len(plan))]
    metrics_ports = [free_port() for _ in plan]
    stages = [ManagedProcess(f"stage-{i}", stage_argv(args, model, plan, ports, metrics_ports, i))
              for i in range(len(plan))]
    frontend = ManagedProcess("frontend", frontend_argv(args, model, ports))
    everything = [frontend, *stages]

    stopping = False

    def request_stop(signum, _frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        for stage in reversed(stages):  # downstream first
            stage.start()
        for index in reversed(range(len(stages))):
            while not stopping and not asyncio.run(_wait_serving(f"127.0.0.1:{ports[index]}", 1.0)):
                if not stages[index].alive():
                    print(f"inferencemesh: {stages[index].name} exited with {stages[index].process.returncode} "
                          "while loading; see its log above", file=sys.stderr)
                    return 1
            if stopping:
                return 130
            print(f"inferencemesh: stage {index} ready on 127.0.0.1:{ports[index]} "
                  f"(metrics :{metrics_ports[index]})", flush=True)
        frontend.start()
        print(f"inferencemesh: OpenAI endpoint http://{args.host}:{args.port}/v1 (Ctrl-C to stop)", flush=True)
        while not stopping:
            time.sleep(0.5)
            for proc in stages:
                # restart a dead stage, at most once per RESTART_BACKOFF_S so a crash loop stays visible
                if not proc.alive() and not stopping and time.monotonic() - proc.started_at > RESTART_BACKOFF_S:
                    proc.restarts += 1
                    print(f"inferencemesh: {proc.name} exited ({proc.process.returncode}); restarting "
                          f"(restart {proc.restarts})", file=sys.stderr, flush=True)
                    proc.start()
            if not frontend.alive() and not stopping:
                print(f"inferencemesh: frontend exited ({frontend.process.returncode})", file=sys.stderr)
                return 1
        return 0
    finally:
        for proc in everything:
            with contextlib.suppress(Exception):
                proc.stop()
        print("inferencemesh: stopped", flush=True)
