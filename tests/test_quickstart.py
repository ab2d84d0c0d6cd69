"""The README's first command, exactly as a new user meets it: a fresh virtualenv, a regular (not
editable) `pip install "torch==2.13.0" .`, then `inferencemesh serve` started from the clone's
root, and a completion through the official openai client. Once, `python -m inferencemesh`
children run from the root imported the clone's own folder instead of the installed package;
this test is what keeps that from coming back unseen."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from mesh_helpers import free_serve_port
from openai import OpenAI

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def test_readme_quick_start_from_the_clone_root(tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    assert 'pip install "torch==2.13.0" . && inferencemesh serve' in readme  # the command this test runs
    venv = tmp_path / "venv"
    # System site-packages only spare the test re-installing torch and friends (minutes, GBs); the
    # project itself goes into the venv as a regular wheel install and shadows any other copy.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}:{env['PATH']}", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    subprocess.run(["pip", "install", "-q", "torch==2.13.0", "."], cwd=REPO, env=env, check=True, timeout=600)
    installed = subprocess.run(["python", "-c", "import inferencemesh.stage, sys; print(inferencemesh.stage.__file__)"],
                               cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout
    assert str(venv) in installed, f"not the venv's regular install: {installed}"

    port = free_serve_port()
    proc = subprocess.Popen(["inferencemesh", "serve", "--port", str(port)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, "serve exited:\n" + "".join(lines)
            assert time.monotonic() < deadline, "serve never became ready:\n" + "".join(lines)
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        done = client.completions.create(model="imesh-code-target", prompt="def fibonacci(n):", max_tokens=16)
        assert done.choices[0].text and done.usage.completion_tokens > 0
        assert not any("ModuleNotFoundError" in line or "Traceback" in line for line in lines), "".join(lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(30)
