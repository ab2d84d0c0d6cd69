"""The supervisor of `serve`'s pipelines: restarts what dies, and stops a mesh in order.

Once a pipeline has served, a process of it that dies is restarted (as its Deployment's pod would
be) within the operator's default restart budget, beyond which the pipeline is stopped and the
others keep serving (LocalPipeline.supervise). A pipeline whose frontend dies before it ever
served (its model cannot load: every pipeline shares it), or exits 0 (it was asked to stop), ends
`serve` (ServeOver).

The stop (stop_mesh) lets the requests in flight finish, outermost process first: the router
(with --replicas N) finishes its open streams, then the frontends drain (each up to its
--drain-timeout), then the stages stop; each step's processes get SIGTERM together and are
killed if they outlast their grace.

How a child is started, dies with its parent and says why it exited is process.py's
(ManagedProcess): the mechanism every parent shares; this module is the policy.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from inferencemesh.programs.local_stages import LocalStages
from inferencemesh.programs.process import STAGE_STOP_S, ManagedProcess, reachable_address, stop_processes

RESTART_BACKOFF_S = 2.0
# A pipeline whose processes exit more than RESTART_BUDGET times within RESTART_WINDOW_S is given up
# (stopped; the other pipelines keep serving): the operator's default spec.restartBudget.
RESTART_BUDGET = 5
RESTART_WINDOW_S = 600.0
# How long a stopped process may take beyond its own grace (a drain's timeout, the router's
# graceful shutdown) before it is killed: its exit after that grace (the frontend's last cut
# requests, the interpreter's teardown).
STOP_MARGIN_S = 5.0


def answers_ready(port: int, host: str = "127.0.0.1") -> bool:
    """Whether the frontend on host:port says it is ready (GET /ready: 200)."""
    target = reachable_address(host)
    target = f"[{target}]" if ":" in target else target
    try:
        with urllib.request.urlopen(f"http://{target}:{port}/ready", timeout=1.0) as response:  # noqa: S310
            return response.status == 200
    except (OSError, ValueError):
        return False


class ServeOver(Exception):  # noqa: N818 - what ends `serve`, said in one line
    """`serve` must stop: a pipeline failed while starting (its reason is the model's, which every
    pipeline shares), or its frontend stopped on its own (exit 0: it was asked to)."""


@dataclass
class LocalPipeline:
    """One complete pipeline of `serve`: its stage processes and its frontend process, on `port`.

    Supervised (supervise) as the operator supervises a pipeline's pods: a process that exits after
    the pipeline has served is restarted (each at most once per RESTART_BACKOFF_S), RESTART_BUDGET
    times within RESTART_WINDOW_S; beyond that the pipeline is given up (`failed` says why), and
    the others behind the router keep serving."""

    label: str  # "" alone; "pipeline R: " as one of --replicas N
    stages: LocalStages
    frontend: ManagedProcess
    host: str
    port: int
    drain_timeout: float  # its frontend's --drain-timeout
    served: bool = False  # its frontend has answered ready (since then, an exit is restarted)
    restarted_at: list[float] = dataclasses.field(default_factory=list)  # within RESTART_WINDOW_S
    failed: str = ""  # why it was given up; "" while it serves

    def start_stages(self) -> None:
        self.stages.start()

    def wait_stages(self, stopping: Callable[[], bool]) -> None:
        """Until every stage is SERVING (RuntimeError, TimeoutError: one failed)."""
        stages = self.stages
        stages.wait_ready(stopping=stopping, on_ready=lambda i: print(
            f"inferencemesh: {self.label}stage {stages.configs[i].stage_index} ready on {stages.addresses[i]} "
            f"(metrics :{stages.metrics_ports[i]})", flush=True))

    @property
    def processes(self) -> list[ManagedProcess]:
        return [*self.stages.processes, self.frontend]

    def supervise(self) -> None:
        """Restart what exited, within the budget (else give the pipeline up: `failed`, its processes
        stopped). ServeOver when its frontend exits before it ever served (start-up: an embedded
        stage or a tokenizer that cannot load) or exits 0 (asked to stop)."""
        if self.failed:
            return
        if not self.served and self.frontend.alive():
            self.served = answers_ready(self.port, self.host)
        frontend = self.frontend
        if not frontend.alive() and (frontend.returncode == 0 or not self.served):
            raise ServeOver(self.label + frontend.ended("" if self.served else " before it was ready"))
        now = time.monotonic()
        self.restarted_at = [t for t in self.restarted_at if now - t < RESTART_WINDOW_S]
        for proc in self.processes:
            if proc.alive() or now - proc.started_at < RESTART_BACKOFF_S:
                continue
            if len(self.restarted_at) >= RESTART_BUDGET:
                self.give_up(f"{proc.ended()}, after {len(self.restarted_at)} restarts within "
                             f"{RESTART_WINDOW_S:.0f}s")
                return
            ended = proc.ended()
            proc.restarts += 1
            self.restarted_at.append(now)
            proc.start()
            print(f"inferencemesh: {self.label}{ended}; restarted it (restart {proc.restarts}; "
                  f"{RESTART_BUDGET - len(self.restarted_at)} more within {RESTART_WINDOW_S:.0f}s before the "
                  "pipeline is given up)", file=sys.stderr, flush=True)

    def give_up(self, why: str) -> None:
        """Stop this pipeline for good (the others keep serving); `failed` says why."""
        self.failed = why
        print(f"inferencemesh: {self.label}given up: {why}; its processes stop", file=sys.stderr, flush=True)
        stop_processes(self.processes, STAGE_STOP_S)

    def stop(self) -> None:
        stop_mesh(None, [self])


def stop_mesh(router: ManagedProcess | None, pipelines: list[LocalPipeline],
              hurry: Callable[[], bool] = lambda: False) -> None:
    """Stop a mesh so that the requests in flight finish: the router first (its graceful shutdown
    finishes the streams it relays), then every frontend (each drains: new requests get 503, those
    in flight finish, up to its --drain-timeout), then every stage. Each step waits for its
    processes' grace plus STOP_MARGIN_S, then kills them; once `hurry()` is true (a second Ctrl-C),
    what is left is killed at once."""
    if router is not None:
        from inferencemesh.programs.router import GRACEFUL_SHUTDOWN_S

        stop_processes([router], GRACEFUL_SHUTDOWN_S + STOP_MARGIN_S, hurry)
    if pipelines:
        stop_processes([p.frontend for p in pipelines], max(p.drain_timeout for p in pipelines) + STOP_MARGIN_S,
                       hurry)
        stop_processes([proc for p in pipelines for proc in p.stages.processes], STAGE_STOP_S, hurry)
