"""A user's mistakes on the command line: one clear line naming the problem and the way out,
a non-zero exit, and no traceback, for every command that takes a model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMMANDS = {
    "plan": [],
    "serve": ["--port", "0"],
    "stage": ["--layers", "0:1", "--stage-index", "0", "--num-stages", "1"],
    "frontend": ["--stage-addresses", "127.0.0.1:9"],
}


def run(command: str, model: str, tmp_path: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # Offline with an empty cache: the hub is never contacted, whatever the machine's network.
    env = env or {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    return subprocess.run([sys.executable, "-m", "inferencemesh", command, "--model", model, *COMMANDS[command]],
                          capture_output=True, text=True, timeout=120, env=env, cwd=REPO)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_missing_model_directory(command: str, tmp_path: Path) -> None:
    done = run(command, str(tmp_path / "no" / "such" / "dir"), tmp_path)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "does not exist" in lines[0], done.stderr


@pytest.mark.parametrize("command", ["plan", "serve", "frontend"])
def test_an_unreachable_hub_model(command: str, tmp_path: Path) -> None:
    done = run(command, "Qwen/Qwen2.5-0.5B-Instruct", tmp_path)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(lines) == 1, done.stderr
    assert "local model directory" in lines[0] and "HF_HUB_OFFLINE" in lines[0], lines[0]


@pytest.mark.parametrize("command", ["plan", "serve", "frontend"])
def test_a_hub_id_with_no_hub_in_reach_fails_at_once(command: str, tmp_path: Path) -> None:
    """No HF_HUB_OFFLINE, and the hub cannot be reached (here: its endpoint refuses connections, as a
    machine without network fails to resolve it): asked once, no five retries with backoff (23 s
    before), the one line says why."""
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
    env = {key: value for key, value in os.environ.items() if key not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf"))
    done = run(command, "Qwen/Qwen2.5-0.5B-Instruct", tmp_path, env)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert "Retry" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "cannot be reached" in lines[0] and "local model directory" in lines[0], done.stderr


@pytest.mark.parametrize("model", ["bundled://../../etc", "bundled://no-such-model"])
def test_a_bad_bundled_name(model: str, tmp_path: Path) -> None:
    """bundled:// is read in one place (bundled.resolve_model): a name out of the package, or one
    no bundled model has, is one line."""
    done = run("plan", model, tmp_path)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "bundled" in lines[0], done.stderr


def test_serve_help_shows_every_default_and_the_api_key() -> None:
    done = subprocess.run([sys.executable, "-m", "inferencemesh", "serve", "--help"], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env={**os.environ, "COLUMNS": "100"})
    assert done.returncode == 0, done.stderr
    options = done.stdout.split("\noptions:\n", 1)[1]
    blocks = [block for block in ("\n" + options).split("\n  -")[1:] if not block.startswith("h, --help")]
    assert len(blocks) > 20, done.stdout
    undocumented = [block.split()[0] for block in blocks if "(default" not in " ".join(block.split())]
    assert not undocumented, f"no default shown for {undocumented}"
    text = " ".join(done.stdout.split())
    assert "--api-key-env" in text and "INFERENCEMESH_API_KEY" in text and "Authorization: Bearer KEY" in text
    assert "(default: 8000)" in text and "(default: 2)" in text  # --port, --stages


def test_a_cached_hub_model_still_loads_with_no_hub_in_reach(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """The other side of failing fast: with the hub out of reach (no HF_HUB_OFFLINE), a model in the
    cache is found there at once, with nothing asked or retried, and offline mode ends with the load."""
    import huggingface_hub
    from test_stage_loader import populate_hub_cache
    from tiny_models import write_tiny_model

    from inferencemesh.checkpoint import hub
    from inferencemesh.modeling.loader import locate

    model = write_tiny_model(tmp_path / "m", "llama", num_layers=2, shards=1)
    cache = tmp_path / "cache"
    files = {p.name: p for p in model.iterdir()}
    populate_hub_cache(cache, "org/tiny", files, keep=set(files))
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{closed.getsockname()[1]}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "_hub_probe", None)
    started = time.monotonic()
    directory, facts = locate("org/tiny", 0, 2, cache_dir=str(cache))
    assert time.monotonic() - started < 10 and facts.num_layers == 2 and (directory / "config.json").exists()
    assert "Retry" not in caplog.text
    assert huggingface_hub.constants.HF_HUB_OFFLINE is False
