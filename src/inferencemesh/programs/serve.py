"""`inferencemesh serve`: a whole mesh as local processes on loopback.

The same plan the operator would make, the same `inferencemesh stage` / `inferencemesh
frontend` programs the pods run. Stages start first and the frontend only once every stage
reports SERVING, downstream first. A stage or frontend that cannot load its model exits with its
one-line reason (in its termination message, which ManagedProcess points at a file of ours), and
serve ends at once with it. Once a pipeline has served, a process of it that dies is restarted
(as its Deployment's pod would be) within the operator's default restart budget, beyond which the
pipeline is stopped and the others keep serving (LocalPipeline.supervise). Ctrl-C, SIGTERM or
SIGHUP stops everything, and the children die with this process whatever kills it
(process.supervised_popen_kwargs). LocalStages is also what the benchmarks
and tests start.

The stop (stop_mesh) lets the requests in flight finish, outermost process first: the router
(with --replicas N) finishes its open streams, then the frontends drain (each up to its
--drain-timeout), then the stages stop; each step's processes get SIGTERM together and are
killed if they outlast their grace. A second Ctrl-C (or any stop signal during the stop) kills
what is left at once.

With --replicas N, serve runs N such pipelines (LocalPipeline: the unit of start, readiness,
restarts and stop), each its own stages and certificates and its frontend on a free loopback
port, the CPUs shared among all their stage processes, and `inferencemesh router` on --port in
front of their frontends, started once every frontend is ready.

Stage traffic is mutual TLS even here: the stages listen on loopback only, but any local user
could reach a plaintext port (free compute, the model path, every session slot). Unless
--tls-dir brings certificates, each run makes its own (run_certificates): a CA and one leaf per
stage process and the frontend, in a private temporary directory removed at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import yaml

from inferencemesh import tls
from inferencemesh.config import FrontendConfig, RouterConfig, ServeConfig, StageConfig
from inferencemesh.cpus import share_of_cpus
from inferencemesh.flags import derive, to_argv
from inferencemesh.planner import StagePlan, render_plan
from inferencemesh.programs.plan import plan_from_settings
from inferencemesh.programs.process import TERMINATION_LOG_ENV, on_stop_signals, supervised_popen_kwargs
from inferencemesh.protocol.transport import message_limit

RESTART_BACKOFF_S = 2.0
# A pipeline whose processes exit more than RESTART_BUDGET times within RESTART_WINDOW_S is given up
# (stopped; the other pipelines keep serving): the operator's default spec.restartBudget.
RESTART_BUDGET = 5
RESTART_WINDOW_S = 600.0
# How long a stopped process may take beyond its own grace (a drain's timeout, the router's
# graceful shutdown) before it is killed: its exit after that grace (the frontend's last cut
# requests, the interpreter's teardown).
STOP_MARGIN_S = 5.0
STAGE_STOP_S = 10.0  # a stage's graceful stop, SIGTERM to kill
CLI = [sys.executable, "-m", "inferencemesh"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_exit_notes: str | None = None


def _exit_notes_dir() -> str:
    """A private directory for this process's children's exit notes, removed when it exits."""
    global _exit_notes
    if _exit_notes is None:
        _exit_notes = tempfile.mkdtemp(prefix="inferencemesh-exits-")
        atexit.register(shutil.rmtree, _exit_notes, True)
    return _exit_notes


@dataclass
class ManagedProcess:
    """A child program, which dies with this process (process.supervised_popen_kwargs) and leaves
    the one line its CLI exits with (a stage that cannot load its layers: why) where exit_reason
    reads it: its termination message (process.write_termination_message) goes to a file of ours."""

    name: str
    argv: list[str]
    env: dict[str, str] | None = None
    process: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    note: str = ""  # the file its termination message goes to

    def start(self) -> None:
        if not self.note:
            self.note = os.path.join(_exit_notes_dir(), f"{self.name}-{id(self)}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.note)  # a restart's reason is its own
        env = {**os.environ, **(self.env or {}), TERMINATION_LOG_ENV: self.note}
        self.process = subprocess.Popen(self.argv, **supervised_popen_kwargs(env))
        self.started_at = time.monotonic()

    def exit_reason(self) -> str:
        """The one line it exited with (without the CLI's "inferencemesh CMD: error: "), or ''."""
        try:
            with open(self.note, encoding="utf-8", errors="replace") as f:
                line = f.read().strip()
        except OSError:
            return ""
        return re.sub(r"^inferencemesh [a-z]+: (error: )?", "", line)

    def ended(self, when: str = "") -> str:
        """How it ended, for a log line: `stage-1 exited (1){when}: why`."""
        reason = self.exit_reason()
        return f"{self.name} exited ({self.returncode}){when}" + (f": {reason}" if reason else "")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        """How the process ended (None: running, or never started)."""
        return None if self.process is None else self.process.returncode

    def terminate(self) -> None:
        """SIGTERM: a graceful stop (a frontend drains, the router finishes its streams)."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL, and reap it."""
        if self.process is None:
            return
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        self.process.wait()

    def stop(self, timeout: float = STAGE_STOP_S) -> None:
        stop_processes([self], timeout)


def stop_processes(processes: list[ManagedProcess], timeout: float,
                   hurry: Callable[[], bool] = lambda: False) -> None:
    """Stop `processes` together: SIGTERM to each that runs, then wait until all have exited; those
    still running after `timeout` seconds, or once `hurry()` is true, are killed. Returns once every
    one has exited."""
    running = [proc for proc in processes if proc.alive()]
    for proc in running:
        proc.terminate()
    deadline = time.monotonic() + timeout
    while any(proc.alive() for proc in running) and time.monotonic() < deadline and not hurry():
        time.sleep(0.05)
    for proc in running:
        proc.kill()


class LocalStages:
    """The stage processes of one plan, on loopback ports.

    `template` holds what every stage shares (model, dtype, runtime settings); each stage's
    own fields (layers, index, ports, downstream) are filled in from the plan. With
    `embed_first`, stage 0 runs inside the frontend (FrontendConfig.first_stage_layers) and the
    processes here are stages 1 and after. `tls_dirs`: each stage process's own certificates,
    by stage index (else the template's tls_dir, if any, for all).
    """

    def __init__(self, template: StageConfig, plan: list[StagePlan], env: dict[str, str] | None = None,
                 base_port: int = 0, metrics_ports: list[int] | None = None, embed_first: bool = False,
                 tls_dirs: dict[int, str] | None = None) -> None:
        self.plan = plan
        self.first_index = int(embed_first)
        own = plan[self.first_index:]
        self.ports = [base_port + i if base_port else free_port() for i in range(len(own))]
        self.metrics_ports = metrics_ports or [free_port() for _ in own]  # free ones for tests and bench
        self.configs = [
            dataclasses.replace(
                template, layers=(stage.layer_start, stage.layer_end), stage_index=self.first_index + i,
                num_stages=len(plan), host="127.0.0.1", port=self.ports[i], metrics_port=self.metrics_ports[i],
                downstream=self.addresses[i + 1] if i + 1 < len(own) else None,
                tls_dir=tls_dirs[self.first_index + i] if tls_dirs else template.tls_dir,
                # serve's own certificates (run_certificates) name their process: only the
                # frontend and the stage before may call; the user's --tls-dir names nobody we know.
                peers=tls.stage_peers(self.first_index + i, self.first_index, "frontend", lambda j: f"stage-{j}")
                if tls_dirs else (),
            ).check()
            for i, stage in enumerate(own)
        ]
        # Beside the environment they inherit; their OpenMP spinning is every program's
        # (process.prepare_process, in the child's own CLI).
        self.env = dict(env or {})
        self.processes = [ManagedProcess(f"stage-{c.stage_index}", CLI + ["stage", *to_argv(c)], self.env)
                          for c in self.configs]

    @property
    def first_stage_layers(self) -> tuple[int, int] | None:
        """The embedded first stage's layer range (the frontend runs it), or None."""
        first = self.plan[0]
        return (first.layer_start, first.layer_end) if self.first_index else None

    @property
    def tls_dir(self) -> str | None:
        return self.configs[0].tls_dir if self.configs else None

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    def start(self) -> None:
        for proc in reversed(self.processes):  # downstream first
            proc.start()

    def wait_ready(self, timeout: float = 300.0, stopping: Callable[[], bool] = lambda: False,
                   on_ready: Callable[[int], None] | None = None) -> None:
        """Block until every stage is SERVING, last stage first; RuntimeError if one exits."""
        from inferencemesh.protocol.health import check  # the stage's health, asked as its probes ask

        deadline = time.monotonic() + timeout
        credentials = tls.load(self.tls_dir)
        for index in reversed(range(len(self.processes))):
            while not check(self.addresses[index], timeout=1.0, tls=credentials):
                proc = self.processes[index]
                if not proc.alive():  # a stage that cannot load exits at once, with why (programs.stage)
                    raise RuntimeError(proc.ended(" while loading"))
                if stopping() or time.monotonic() > deadline:
                    raise TimeoutError(f"{proc.name} not ready after {timeout:.0f}s")
                time.sleep(0.25)  # a refused connection answers at once
            if on_ready is not None:
                on_ready(index)

    def stop(self) -> None:
        stop_processes(self.processes, STAGE_STOP_S)


def stage_template(model: str, source: ServeConfig | None = None, **fields: Any) -> StageConfig:
    """What every stage of a local mesh shares (from `serve`'s config, or fields); LocalStages
    fills in each stage's own layers, index, ports and downstream."""
    placeholders = {"model": model, "layers": (0, 1), "stage_index": 0, "num_stages": 1, **fields}
    return derive(StageConfig, source, **placeholders) if source else StageConfig(**placeholders)


def frontend_config(config: ServeConfig, model: str, stages: LocalStages, threads: int = 0,
                    tls_dir: str | None = None, max_message_bytes: int | None = None) -> FrontendConfig:
    """The frontend of a local mesh: in front of `stages`, holding stage 0 itself (on `threads`)
    when they embed it; `tls_dir`: its own certificates (else serve's --tls-dir);
    `max_message_bytes`: the plan's message limit, as the stages have it."""
    embedded = stages.first_stage_layers
    return derive(FrontendConfig, config, model=model, stage_addresses=tuple(stages.addresses),
                  first_stage_layers=embedded, threads=threads if embedded else 0,
                  tls_dir=tls_dir or config.tls_dir, max_message_bytes=max_message_bytes).check()


# A run's certificates outlive any run; they are removed when it ends (a `kill -9` leaves the
# private directory behind, with keys that only this run's processes trusted).
RUN_CERTIFICATE_LIFETIME = datetime.timedelta(days=365)


@contextlib.contextmanager
def run_certificates(names: list[str]) -> Iterator[dict[str, str]]:
    """A CA for this run and a leaf for each of `names` (issued for 127.0.0.1 and localhost,
    where the stages listen), each a tls dir (tls.crt, tls.key, ca.crt) inside a private temporary
    directory (0700); yields name -> its dir, and removes everything on the way out."""
    from inferencemesh.certificates import issue, make_ca, write_tls_dir

    root = tempfile.mkdtemp(prefix="inferencemesh-tls-")  # made 0700: only this user reads the keys
    try:
        authority = make_ca(f"inferencemesh serve {os.getpid()}", RUN_CERTIFICATE_LIFETIME)
        yield {name: str(write_tls_dir(os.path.join(root, name),
                                       issue(authority, name, ["127.0.0.1", "localhost"], RUN_CERTIFICATE_LIFETIME)))
               for name in names}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def scrape_config(frontend: str | list[str], stages: list[str], router: str | None = None) -> str:
    """A Prometheus `scrape_configs` section for a local mesh (targets are HOST:PORT): its
    frontend(s), its stages, and with --replicas N the router. Stage series carry their own
    `stage` label, so the targets need none."""
    frontends = [frontend] if isinstance(frontend, str) else list(frontend)
    jobs = [{"job_name": "inferencemesh-frontend", "static_configs": [{"targets": frontends}]},
            {"job_name": "inferencemesh-stages", "static_configs": [{"targets": list(stages)}]}]
    if router is not None:
        jobs.append({"job_name": "inferencemesh-router", "static_configs": [{"targets": [router]}]})
    return yaml.safe_dump({"scrape_configs": jobs}, sort_keys=False)


def accepting(host: str, port: int) -> bool:
    """Whether something listens on host:port now (a wildcard host: asked on loopback)."""
    try:
        with socket.create_connection((_reachable(host), port), timeout=1.0):
            return True
    except OSError:
        return False


def _reachable(host: str) -> str:
    """The address to ask for a server listening on `host` (a wildcard host: loopback)."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # noqa: S104 - compared


def answers_ready(port: int, host: str = "127.0.0.1") -> bool:
    """Whether the frontend on host:port says it is ready (GET /ready: 200)."""
    target = _reachable(host)
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
                self.failed = (f"{proc.ended()}, after {len(self.restarted_at)} restarts within "
                               f"{RESTART_WINDOW_S:.0f}s")
                print(f"inferencemesh: {self.label}given up: {self.failed}; its processes stop", file=sys.stderr,
                      flush=True)
                stop_processes(self.processes, STAGE_STOP_S)
                return
            ended = proc.ended()
            proc.restarts += 1
            self.restarted_at.append(now)
            proc.start()
            print(f"inferencemesh: {self.label}{ended}; restarted it (restart {proc.restarts}; "
                  f"{RESTART_BUDGET - len(self.restarted_at)} more within {RESTART_WINDOW_S:.0f}s before the "
                  "pipeline is given up)", file=sys.stderr, flush=True)

    def stop(self) -> None:
        stop_mesh(None, [self])


# A pipeline's certificates: each stage process's tls dir by stage index, and the frontend's
# (None, None: serve's --tls-dir, if any, for all).
PipelineCertificates = tuple[dict[int, str] | None, str | None]


def build_pipeline(config: ServeConfig, model: str, plan: list[StagePlan], max_message_bytes: int,
                   certificates: PipelineCertificates, *, replica: int, threads: int) -> LocalPipeline:
    """Pipeline `replica` of `serve`: alone, its frontend on --host:--port; one of --replicas N, on a
    free loopback port behind the router. Each stage process computes on `threads`."""
    stage_tls, frontend_tls = certificates
    embed = config.embed_first_stage
    alone = config.replicas == 1
    stages = LocalStages(stage_template(model, config, threads=threads, max_message_bytes=max_message_bytes), plan,
                         base_port=config.base_stage_port_of(replica),
                         metrics_ports=config.stage_metrics_ports(len(plan), replica)[int(embed):],
                         embed_first=embed, tls_dirs=stage_tls)
    settings = frontend_config(config, model, stages, threads=threads, tls_dir=frontend_tls,
                               max_message_bytes=max_message_bytes)
    if not alone:
        settings = dataclasses.replace(settings, host="127.0.0.1", port=free_port())
    frontend = ManagedProcess(f"frontend-{replica}" if not alone else "frontend",
                              CLI + ["frontend", *to_argv(settings)], stages.env)
    return LocalPipeline("" if alone else f"pipeline {replica}: ", stages, frontend, settings.host, settings.port,
                         settings.drain_timeout)


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


def router_config(config: ServeConfig, pipelines: list[LocalPipeline]) -> RouterConfig:
    """The router of --replicas N: on --host:--port, in front of each pipeline's frontend (p0, p1, ...)."""
    return RouterConfig(host=config.host, port=config.port,
                        frontends=tuple(f"p{r}=http://127.0.0.1:{p.port}" for r, p in enumerate(pipelines))).check()


def run_serve(config: ServeConfig) -> int:
    model, facts, plan = plan_from_settings(config)
    print(f"inferencemesh: serving {model}" + (f" as {config.replicas} pipelines behind a router"
                                               if config.replicas > 1 else "") + f"\n{render_plan(plan)}", flush=True)
    limit = message_limit(hidden_size=facts.hidden_size, vocab_size=facts.vocab_size,
                          max_batch_tokens=config.max_batch_tokens, max_sessions=config.max_sessions)
    if config.tls_dir:  # brought by the user: every process presents it
        return _serve_mesh(config, model, plan, limit, [(None, None)] * config.replicas)
    processes = range(int(config.embed_first_stage), len(plan))  # the stages that run as processes
    with contextlib.ExitStack() as stack:
        certificates: list[PipelineCertificates] = []
        for _ in range(config.replicas):  # each pipeline its own CA: one's frontend cannot call another's stages
            dirs = stack.enter_context(run_certificates([*(f"stage-{i}" for i in processes), "frontend"]))
            certificates.append(({i: dirs[f"stage-{i}"] for i in processes}, dirs["frontend"]))
        return _serve_mesh(config, model, plan, limit, certificates)


def _serve_mesh(config: ServeConfig, model: str, plan: list[StagePlan], max_message_bytes: int,
                certificates: list[PipelineCertificates]) -> int:
    """The mesh's processes, until a stop signal or a frontend's (or the router's) exit;
    `max_message_bytes`: the plan's message limit, for both ends of every stage stream;
    `certificates`: each pipeline's."""
    # Each stage process gets its share of the CPUs: more threads than cores preempt each other.
    # (with the first stage embedded, the frontend process is the one that computes stage 0)
    threads = config.stage_threads or share_of_cpus(config.replicas * len(plan))
    pipelines = [build_pipeline(config, model, plan, max_message_bytes, certificates[r], replica=r, threads=threads)
                 for r in range(config.replicas)]
    router = (ManagedProcess("router", CLI + ["router", *to_argv(router_config(config, pipelines))])
              if config.replicas > 1 else None)
    stopping = hurry = False

    def request_stop(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping, hurry
        if stopping:  # a second signal, or one while the mesh stops after a failure: no more waiting
            hurry = True
        stopping = True

    on_stop_signals(request_stop)
    try:
        for pipeline in pipelines:
            pipeline.start_stages()
        try:
            for pipeline in pipelines:
                pipeline.wait_stages(lambda: stopping)
        except (RuntimeError, TimeoutError) as err:
            print(f"inferencemesh: {err}", file=sys.stderr, flush=True)
            return 130 if stopping else 1
        for pipeline in pipelines:
            pipeline.frontend.start()
        announced = False
        while not stopping:
            # The router starts once every frontend is ready (it would send requests to one still
            # loading); the endpoint is announced once it listens, never before: a user (or a script)
            # that reads the line may connect at once.
            if router is not None and router.process is None and all(p.served for p in pipelines):
                router.start()
            if not announced and (router or pipelines[0].frontend).alive() and accepting(config.host, config.port):
                announced = True
                announce(config, pipelines)
            time.sleep(0.5)
            if stopping:
                break
            try:
                for pipeline in pipelines:
                    pipeline.supervise()
            except ServeOver as over:
                print(f"inferencemesh: {over}", file=sys.stderr, flush=True)
                return 1
            if all(pipeline.failed for pipeline in pipelines):
                print("inferencemesh: every pipeline was given up", file=sys.stderr, flush=True)
                return 1
            if router is not None and router.process is not None and not router.alive():
                print(f"inferencemesh: router exited ({router.returncode})", file=sys.stderr)
                return 1
        return 0
    finally:
        stopping = True  # from here, a signal hurries the stop
        if not hurry and any(proc.alive() for proc in [router, *(p.frontend for p in pipelines)] if proc):
            print("inferencemesh: stopping: requests in flight finish first (Ctrl-C again to stop at once)",
                  flush=True)
        stop_mesh(router, pipelines, lambda: hurry)
        print("inferencemesh: stopped", flush=True)


def announce(config: ServeConfig, pipelines: list[LocalPipeline]) -> None:
    """What a user needs once the mesh serves: Prometheus targets and the endpoint(s)."""
    host = "127.0.0.1" if config.host in ("", "0.0.0.0") else config.host  # noqa: S104 - compared, not bound
    routed = len(pipelines) > 1
    stage_targets = [f"127.0.0.1:{p}" for pipeline in pipelines for p in pipeline.stages.metrics_ports]
    frontends = [f"127.0.0.1:{p.port}" for p in pipelines] if routed else f"{host}:{config.port}"
    print("inferencemesh: Prometheus scrape configuration (prometheus.yml):\n"
          + scrape_config(frontends, stage_targets, f"{host}:{config.port}" if routed else None), flush=True)
    for pipeline in pipelines:
        if pipeline.stages.first_index:
            print(f"inferencemesh: {pipeline.label}stage 0 runs inside the frontend (its metrics on "
                  f":{pipeline.port}/metrics)", flush=True)
        if routed:
            print(f"inferencemesh: {pipeline.label}frontend http://127.0.0.1:{pipeline.port}/v1", flush=True)
    if routed:
        print(f"inferencemesh: router over {len(pipelines)} pipelines (prefix-aware; GET /router/replicas)",
              flush=True)
    print(f"inferencemesh: OpenAI endpoint http://{config.host}:{config.port}/v1 (Ctrl-C to stop)", flush=True)
