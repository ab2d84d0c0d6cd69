"""`inferencemesh serve`: a whole mesh as local processes on loopback.

The same plan the operator would make, the same `inferencemesh stage` / `inferencemesh
frontend` programs the pods run (local_stages.py). Stages start first and the frontend only once
every stage reports SERVING, downstream first. A stage or frontend that cannot load its model
exits with its one-line reason (in its termination message, which ManagedProcess points at a file
of ours), and serve ends at once with it. Once a pipeline has served, what dies of it is restarted
within a budget, and a stop lets the requests in flight finish (supervisor.py). Ctrl-C, SIGTERM or
SIGHUP stops everything, and the children die with this process whatever kills it
(process.supervised_popen_kwargs). A second Ctrl-C (or any stop signal during the stop) kills
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

import contextlib
import dataclasses
import datetime
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from types import FrameType

import yaml

from inferencemesh.config import API_KEY_ENV, RouterConfig, ServeConfig
from inferencemesh.cpus import share_of_cpus
from inferencemesh.flags import to_argv
from inferencemesh.planner import StagePlan, render_plan
from inferencemesh.programs.local_stages import LocalStages, frontend_config, stage_template
from inferencemesh.programs.plan import plan_from_settings
from inferencemesh.programs.process import CLI, ManagedProcess, accepting, free_port, on_stop_signals
from inferencemesh.programs.supervisor import LocalPipeline, ServeOver, stop_mesh
from inferencemesh.protocol.transport import message_limit

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


def router_config(config: ServeConfig, pipelines: list[LocalPipeline]) -> RouterConfig:
    """The router of --replicas N: on --host:--port, in front of each pipeline's frontend (p0, p1, ...)."""
    return RouterConfig(host=config.host, port=config.port,
                        frontends=tuple(f"p{r}=http://127.0.0.1:{p.port}" for r, p in enumerate(pipelines))).check()


def run_serve(config: ServeConfig) -> int:
    model, facts, plan = plan_from_settings(config)
    how = f", {config.quantization} quantized at load" if config.quantization else ""
    how += f" as {config.replicas} pipelines behind a router" if config.replicas > 1 else ""
    print(f"inferencemesh: serving {model}{how}\n{render_plan(plan)}", flush=True)
    limit = message_limit(hidden_size=facts.hidden_size, vocab_size=facts.vocab_size,
                          max_batch_tokens=config.max_batch_tokens, max_sessions=config.max_sessions,
                          max_context=config.max_context)
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
    threads = config.stage_threads or share_of_cpus(config.replicas * len(plan), config.device)
    pipelines = [build_pipeline(config, model, plan, max_message_bytes, certificates[r], replica=r, threads=threads)
                 for r in range(config.replicas)]
    # The router presents the frontends' key (API_KEY_ENV, whatever --api-key-env names) on its own
    # requests to them: their /kv/* routes are authenticated.
    router = (ManagedProcess("router", CLI + ["router", *to_argv(router_config(config, pipelines))],
                             {API_KEY_ENV: os.environ.get(config.api_key_env, "")})
              if config.replicas > 1 else None)
    signals = StopSignals()
    on_stop_signals(signals.receive)
    try:
        return _run_mesh(config, pipelines, router, signals)
    finally:
        signals.stopping = True  # from here, a signal hurries the stop
        if not signals.hurry and any(proc.alive() for proc in [router, *(p.frontend for p in pipelines)] if proc):
            print("inferencemesh: stopping: requests in flight finish first (Ctrl-C again to stop at once)",
                  flush=True)
        stop_mesh(router, pipelines, lambda: signals.hurry)
        print("inferencemesh: stopped", flush=True)


class StopSignals:
    """Ctrl-C, SIGTERM, SIGHUP: the first asks the mesh to stop (`stopping`), the mesh then stops
    in order; a second signal, or one while the mesh stops after a failure, kills what is left
    at once (`hurry`)."""

    def __init__(self) -> None:
        self.stopping = False
        self.hurry = False

    def receive(self, signum: int, _frame: FrameType | None) -> None:
        if self.stopping:
            self.hurry = True
        self.stopping = True


def _run_mesh(config: ServeConfig, pipelines: list[LocalPipeline], router: ManagedProcess | None,
              signals: StopSignals) -> int:
    """Start the stages, then (once they serve) the frontends, then supervise until a stop signal
    (0), a failure (1) or a signal while the stages load (130). The caller stops what runs."""
    for pipeline in pipelines:
        pipeline.start_stages()
    try:
        for pipeline in pipelines:
            pipeline.wait_stages(lambda: signals.stopping)
    except (RuntimeError, TimeoutError) as err:
        print(f"inferencemesh: {err}", file=sys.stderr, flush=True)
        return 130 if signals.stopping else 1
    for pipeline in pipelines:
        pipeline.frontend.start()
    announced = False
    while not signals.stopping:
        # The router starts once every frontend is ready (it would send requests to one still
        # loading); the endpoint is announced once it listens, never before: a user (or a script)
        # that reads the line may connect at once.
        if router is not None and router.process is None and all(p.served for p in pipelines):
            router.start()
        if not announced and (router or pipelines[0].frontend).alive() and accepting(config.host, config.port):
            announced = True
            announce(config, pipelines)
        time.sleep(0.5)
        if signals.stopping:
            break
        failure = _supervise(pipelines, router)
        if failure:
            print(f"inferencemesh: {failure}", file=sys.stderr, flush=True)
            return 1
    return 0


def _supervise(pipelines: list[LocalPipeline], router: ManagedProcess | None) -> str:
    """One round of supervision: why `serve` must end now, or ''."""
    try:
        for pipeline in pipelines:
            pipeline.supervise()
    except ServeOver as over:
        return str(over)
    if all(pipeline.failed for pipeline in pipelines):
        return "every pipeline was given up"
    if router is not None and router.process is not None and not router.alive():
        return f"router exited ({router.returncode})"
    return ""


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
