"""A real Prometheus scrapes a real `inferencemesh serve`, configured with exactly the scrape
configuration serve prints; the queries a dashboard needs (TTFT p99, tokens/s, a stage's idle
fraction) return numbers, and every metric the chart's Grafana dashboard queries exists."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from mesh_helpers import free_port_run
from openai import OpenAI

from inferencemesh.config import ServeConfig
from inferencemesh.programs.process import free_port
from inferencemesh.router.metrics import RouterMetrics

pytestmark = pytest.mark.slow

DASHBOARD = Path(__file__).resolve().parents[1] / "charts" / "inferencemesh" / "dashboards" / "inferencemesh.json"
SCRAPE_HEADER = "inferencemesh: Prometheus scrape configuration"
WINDOW = "1m"  # rate() windows: wide enough to hold the whole run's samples


def test_stage_metrics_ports_derive_from_the_endpoint_port() -> None:
    assert ServeConfig(port=8000).stage_metrics_ports(3) == [8100, 8101, 8102]
    assert ServeConfig(port=8000, stage_metrics_port=9400).stage_metrics_ports(2) == [9400, 9401]


def _printed_scrape_config(lines: list[str]) -> dict:
    """The YAML block serve printed after its header line (it ends at the next `inferencemesh:` line)."""
    text = "".join(lines)
    start = text.index(SCRAPE_HEADER)
    block = text[text.index("\n", start) + 1:]
    return yaml.safe_load(block[: block.index("inferencemesh:")])


@pytest.fixture(scope="module")
def mesh() -> Iterator[tuple[str, list[str], list[int]]]:
    port, metrics_base = free_port(), free_port_run(2)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "inferencemesh", "serve", "--port", str(port),
                             "--stage-metrics-port", str(metrics_base), "--max-sessions", "4",
                             "--max-context", "256"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while not any("OpenAI endpoint" in line for line in lines) or not _answers(f"{base}/ready"):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.3)
        # stage i exports on metrics_base + i; stage 0 is embedded: its series are on the frontend's page
        yield base, lines, [metrics_base + 1]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def prometheus(mesh, tmp_path_factory) -> Iterator[str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus not found: install Debian's `prometheus` package (apt-get install -y prometheus)")
    _, lines, _ = mesh
    work = tmp_path_factory.mktemp("prometheus")
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, **_printed_scrape_config(lines)}
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    check = subprocess.run(["promtool", "check", "config", str(work / "prometheus.yml")], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    log = (work / "prometheus.log").open("w")
    proc = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(f"{url}/-/ready"), 30, "Prometheus ready")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def query(url: str, promql: str) -> list[dict]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": promql}, timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "success", r.text
    return r.json()["data"]["result"]


def number(url: str, promql: str) -> float:
    """The single value of an instant query; fails on no series or NaN."""
    result = query(url, promql)
    assert len(result) == 1, (promql, result)
    value = float(result[0]["value"][1])
    assert not math.isnan(value), promql
    return value


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_prometheus_answers_the_dashboard_queries(mesh, prometheus: str) -> None:
    base, _, stage_ports = mesh
    targets = {f"127.0.0.1:{p}" for p in stage_ports} | {base.removeprefix("http://")}
    up = lambda: {s["metric"]["instance"] for s in query(prometheus, "up == 1")} == targets  # noqa: E731
    wait_for(up, 30, "every target up")

    client = OpenAI(base_url=f"{base}/v1", api_key="unused")
    model = client.models.list().data[0].id
    prompts = ["def fibonacci(n):\n", "import os\n", "class Stack:\n", "for i in range(10):\n"]
    threads = [threading.Thread(target=client.completions.create,
                                kwargs={"model": model, "prompt": p, "max_tokens": 24, "temperature": 0})
               for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    # One refused request: request_errors_total{status} has a series from the first error on.
    assert httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": "x", "n": 0}).status_code == 400
    generated = "inferencemesh_generation_tokens_total"
    wait_for(lambda: number(prometheus, f"sum(max_over_time({generated}[{WINDOW}]))") > 0, 20, "the tokens scraped")
    time.sleep(1.5)  # one more scrape after the last token: rate() needs the increase between samples

    results = {
        "TTFT p99 (s)": f"histogram_quantile(0.99, sum by (le) (rate(inferencemesh_time_to_first_token_seconds_bucket"
                        f"[{WINDOW}])))",
        "tokens/s": f"sum(rate({generated}[{WINDOW}]))",
        "stage 0 idle fraction": f'1 - sum(rate(inferencemesh_stage_busy_seconds_total{{stage="0"}}[{WINDOW}]))',
        "stage 1 idle fraction": f'1 - sum(rate(inferencemesh_stage_busy_seconds_total{{stage="1"}}[{WINDOW}]))',
        "stage 0 queue wait p99 (s)": f"histogram_quantile(0.99, sum by (le) "
                                      f'(rate(inferencemesh_stage_queue_wait_seconds_bucket{{stage="0"}}[{WINDOW}])))',
        "pipeline time per step (s)": f"sum(rate(inferencemesh_step_pipeline_seconds_sum[{WINDOW}])) / "
                                      f"sum(rate(inferencemesh_step_pipeline_seconds_count[{WINDOW}]))",
    }
    values = {name: number(prometheus, promql) for name, promql in results.items()}
    print("\n" + "\n".join(f"{name}: {values[name]:.6g}    {results[name]}" for name in results))
    assert 0 < values["TTFT p99 (s)"] < 60
    assert values["tokens/s"] > 0
    for stage in ("0", "1"):
        assert 0 <= values[f"stage {stage} idle fraction"] < 1  # it computed something, never more than all the time
    assert values["stage 0 queue wait p99 (s)"] >= 0 and values["pipeline time per step (s)"] > 0

    # Every metric the chart's dashboard queries is one Prometheus scraped.
    scraped = set(httpx.get(f"{prometheus}/api/v1/label/__name__/values", timeout=10).json()["data"])
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p.get("targets", [])]
    used = {name for expr in exprs for name in re.findall(r"\binferencemesh_[a-z0-9_]+", expr)}
    # A single pipeline runs no router: the router row's names are checked against what the
    # router's own registry exports (every family and sample name, counters' _total, histograms' _bucket).
    routed = {name for name in used if name.startswith("inferencemesh_router_")}
    assert used - routed and not (used - routed) - scraped, sorted((used - routed) - scraped)
    exported = {sample.name for family in RouterMetrics().registry.collect() for sample in family.samples}
    exported |= {f"{family.name}{suffix}" for family in RouterMetrics().registry.collect()
                 for suffix in ("", "_total", "_bucket", "_sum", "_count")}  # "": a labelled gauge has no sample yet
    assert not routed - exported, sorted(routed - exported)
