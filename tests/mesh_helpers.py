"""Shared pieces of the pipeline tests: tiny meshes of real stage processes, HF references."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest
import torch

from inferencemesh.checkpoint.read import read_local
from inferencemesh.frontend.engine.api import GenerationRequest
from inferencemesh.frontend.engine.engine import EngineOptions, PipelineEngine
from inferencemesh.planner import PlanInputs, plan_stages
from inferencemesh.programs.local_stages import LocalStages, stage_template


def free_ports_at(offsets: Sequence[int]) -> int:
    """A base port with base + offset free now for every offset, below Linux's ephemeral range
    (32768+): a port the kernel hands out as free can be taken by another process's outgoing
    connection before a server binds it, and the ports a program derives from it (serve's stage
    metrics at --port + 100, --stage-metrics-port + i) were never checked at all."""
    for _ in range(200):
        base = random.randrange(20000, 32000 - max(offsets))
        sockets = [socket.socket() for _ in offsets]
        try:
            for offset, sock in zip(offsets, sockets, strict=True):
                sock.bind(("0.0.0.0", base + offset))  # also fails if 127.0.0.1 holds it
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no free ports at offsets {list(offsets)} in 20000-32000")


def free_port_run(count: int) -> int:
    """The first of `count` consecutive free ports (a --stage-metrics-port base)."""
    return free_ports_at(range(count))


def free_serve_port(stages: int = 4) -> int:
    """A --port for `inferencemesh serve` whose default stage metrics ports (+100, +101, ...) are free too."""
    return free_ports_at([0, *range(100, 100 + stages)])


# One compute thread per stage process: several processes share two cores in CI.
QUIET_THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def start_mesh(model_dir: Path, stages: int, *, max_context: int = 256, embed_first: bool = False,
               **settings) -> LocalStages:
    """The stage processes of a `stages`-stage plan (with embed_first, stages 1..: see embedded_pipeline)."""
    plan = plan_stages(PlanInputs.from_checkpoint(read_local(model_dir)), stages)
    mesh = LocalStages(stage_template(str(model_dir), max_context=max_context, **settings), plan, env=QUIET_THREADS,
                       embed_first=embed_first)
    mesh.start()
    try:
        mesh.wait_ready(120)
    except BaseException:
        mesh.stop()
        raise
    return mesh


def embedded_pipeline(model_dir: Path, mesh: LocalStages, *, max_context: int = 256, **settings):
    """The frontend's pipeline for a mesh started with embed_first: stage 0 in this process (built
    from a FrontendConfig as `inferencemesh frontend` builds it), then the mesh's processes."""
    from inferencemesh.config import FrontendConfig
    from inferencemesh.programs.mesh import frontend_pipeline

    config = FrontendConfig(model=str(model_dir), stage_addresses=tuple(mesh.addresses), max_context=max_context,
                            first_stage_layers=mesh.first_stage_layers, **settings).check()
    return frontend_pipeline(config)


def hf_greedy(model_dir: Path, prompt: list[int], new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare full lengths, no early stop
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


async def collect(engine: PipelineEngine, prompt: list[int], new_tokens: int, **sampling) -> list[int]:
    out: list[int] = []
    request = GenerationRequest(f"t-{id(out)}", prompt, new_tokens, **sampling)
    async for tokens in engine.generate(request):
        out.extend(tokens)
    return out


def generate(pipeline, prompt: list[int], new_tokens: int, proposer_for=None, max_context: int = 256,
             **sampling) -> list[int]:
    """Run one request through a pipeline (closing it afterwards)."""
    async def go() -> list[int]:
        engine = PipelineEngine(pipeline, EngineOptions("test", max_context=max_context), proposer_for=proposer_for)
        try:
            return await collect(engine, prompt, new_tokens, **sampling)
        finally:
            await engine.close()

    return asyncio.run(go())


@contextlib.contextmanager
def serving(*flags: str) -> Iterator[tuple[str, subprocess.Popen, list[str]]]:
    """`inferencemesh serve` as a user starts it (plus flags), ready: (base URL, process, its output)."""
    port = free_serve_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "inferencemesh", "serve", "--port", str(port),
                             "--max-sessions", "4", *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, "".join(lines)
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("serve never became ready:\n" + "".join(lines))
    try:
        yield base, proc, lines
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)


@contextlib.contextmanager
def serving_replicas(*flags: str) -> Iterator[tuple[str, subprocess.Popen, list[str], dict[str, str]]]:
    """`serve --replicas 2 --stages 1` (plus flags) once it has announced its endpoint: (base URL,
    process, its output, each pipeline's frontend URL by index)."""
    import re

    with serving("--replicas", "2", "--stages", "1", "--max-context", "512", *flags) as (base, proc, lines):
        deadline = time.monotonic() + 30  # the router answers /ready a moment before serve announces it
        while not any("OpenAI endpoint" in line for line in lines):
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        frontends = dict(re.findall(r"pipeline (\d): frontend (http://127\.0\.0\.1:\d+)/v1", "".join(lines)))
        yield base, proc, lines, frontends

