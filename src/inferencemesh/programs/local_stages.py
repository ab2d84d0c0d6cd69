"""The stage processes of one plan on loopback, and the configs of a local mesh's programs.

What `serve` runs, and what the benchmarks and tests start: the same `inferencemesh stage` and
`inferencemesh frontend` programs the pods run, their configs derived from `serve`'s (flags.derive)
and a plan's layer ranges.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from inferencemesh import tls
from inferencemesh.config import FrontendConfig, ServeConfig, StageConfig
from inferencemesh.flags import derive, to_argv
from inferencemesh.planner import StagePlan
from inferencemesh.programs.process import CLI, STAGE_STOP_S, ManagedProcess, free_port, stop_processes


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
                # serve's own certificates (serve.run_certificates) name their process: only the
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
