"""The chart's monitoring: ServiceMonitors only where the Prometheus Operator's API exists, what
they select (the Services the operator renders), and the Grafana dashboard ConfigMap."""

from __future__ import annotations

import datetime
import json
import re
import shutil
import subprocess
from pathlib import Path

import helm_python as helm
import pytest
import yaml
from helm_python import _native

from inferencemesh.operator import names as N
from inferencemesh.operator import render as R
from inferencemesh.operator import render_pod as P
from inferencemesh.operator.issuing import settle
from inferencemesh.operator.planning import Plan, SpeculativeChoice
from inferencemesh.operator.spec import parse_spec
from inferencemesh.planner import StagePlan

CHART = Path(__file__).resolve().parents[2] / "charts" / "inferencemesh"
DASHBOARD = CHART / "dashboards" / "inferencemesh.json"
MONITORING = "monitoring.coreos.com/v1"
MESH = {"apiVersion": "inferencemesh.io/v1alpha1", "kind": "InferenceMesh",
        "metadata": {"name": "code", "namespace": "ml", "uid": "uid-1"}}


def render(values: dict | None = None, api_versions: tuple[str, ...] = ()) -> dict[str, str]:
    """`helm template [--api-versions ...]` through the Helm Go SDK. helm-python's Chart.render
    has no api_versions argument; the native call it wraps takes the option."""
    opts = {"name": "imesh", "namespace": "imesh-system", "is_install": True, "api_versions": list(api_versions)}
    chart = helm.Chart.load(str(CHART))
    return json.loads(_native.call_string("helm_render", chart._raw(), json.dumps(values or {}), json.dumps(opts)))


def docs(out: dict[str, str], kind: str) -> list[dict]:
    return [d for path, text in out.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text)
            if d and d["kind"] == kind]


def test_service_monitors_render_only_where_the_prometheus_operator_api_exists() -> None:
    enabled = {"serviceMonitor": {"enabled": True}}
    assert not docs(render(api_versions=(MONITORING,)), "ServiceMonitor")  # off by default
    without = render(enabled)
    assert not docs(without, "ServiceMonitor")  # enabling it on a plain cluster cannot fail the install
    assert "no monitoring.coreos.com/v1 API" in without["inferencemesh/templates/NOTES.txt"]
    monitors = docs(render(enabled, api_versions=(MONITORING,)), "ServiceMonitor")
    assert sorted(m["metadata"]["name"] for m in monitors) == ["imesh-inferencemesh-operator",
                                                              "imesh-inferencemesh-operator-meshes"]
    assert len(docs(render({"serviceMonitor": {"enabled": True, "meshes": False}}, (MONITORING,)),
                    "ServiceMonitor")) == 1


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_the_meshes_monitor_reaches_every_pod_the_operator_renders() -> None:
    """Every stage and frontend pod the operator renders has a Service that the meshes
    ServiceMonitor selects, with the named port it scrapes: no PodMonitor is needed."""
    (monitor,) = [m for m in docs(render({"serviceMonitor": {"enabled": True}}, (MONITORING,)), "ServiceMonitor")
                  if m["metadata"]["name"].endswith("-meshes")]
    selector = monitor["spec"]["selector"]["matchLabels"]
    scraped_ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    plan = Plan(tuple(StagePlan(i, a, b, 1, 1, 1, None) for i, (a, b) in enumerate([(0, 4), (4, 8)])), "local",
                SpeculativeChoice("ngram", "AutoNgram", "x"))
    prefix = N.pipeline_prefix(N.base_name(MESH["metadata"]["name"]), 0)
    certificates = settle(None, {}, R.certificate_subjects(MESH["metadata"]["namespace"],
                                                           R.pipeline_components(plan, prefix)),
                          "inferencemesh m", datetime.timedelta(days=1))
    objs = R.render_children(MESH, parse_spec({"model": {"name": "bundled://imesh-code-target"}}), plan,
                             P.RenderOptions(), certificates)
    services = [o for o in objs if o["kind"] == "Service"]
    deployments = [o for o in objs if o["kind"] == "Deployment"]
    assert len(deployments) == 4  # two stages, the frontend and the router
    for deployment in deployments:
        pod = deployment["spec"]["template"]
        (port,) = {p["name"] for p in pod["spec"]["containers"][0]["ports"]} & scraped_ports
        reaching = [s for s in services if _selects(s["spec"]["selector"], pod["metadata"]["labels"])
                    and _selects(selector, s["metadata"]["labels"]) and port in {p["name"] for p in s["spec"]["ports"]}]
        assert len(reaching) == 1, deployment["metadata"]["name"]
    # The operator's own metrics Service is the other monitor's; the meshes monitor must not scrape it twice.
    (operator_service,) = docs(render(), "Service")
    assert not _selects(selector, operator_service["metadata"]["labels"])


def test_dashboard_configmap_for_the_grafana_sidecar() -> None:
    (cm,) = docs(render(), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["inferencemesh.json"]) == json.loads(DASHBOARD.read_text())
    # The sidecar's own label (a null drops the default one, as Helm merges values), namespace and folder.
    (moved,) = docs(render({"grafanaDashboard": {"namespace": "monitoring",
                                                 "labels": {"grafana_dashboard": None, "dash": "yes"},
                                                 "annotations": {"grafana_folder": "LLM"}}}), "ConfigMap")
    assert moved["metadata"]["namespace"] == "monitoring" and moved["metadata"]["labels"]["dash"] == "yes"
    assert "grafana_dashboard" not in moved["metadata"]["labels"]
    assert moved["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert not docs(render({"grafanaDashboard": {"enabled": False}}), "ConfigMap")


def dashboard_queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def test_dashboard_has_the_panels_and_valid_promql(tmp_path: Path) -> None:
    text = " ".join(dashboard_queries())
    for metric in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                   "generation_tokens_total", "num_requests_waiting", "spec_decode_num_accepted_tokens_total",
                   "stage_compute_seconds", "stage_queue_wait_seconds_bucket", "stage_busy_seconds_total"):
        assert "inferencemesh_" + metric in text, metric
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found: install Debian's `prometheus` package (apt-get install -y prometheus)")
    # Grafana's variables, as Grafana substitutes them; then Prometheus' own parser checks each query.
    rules = [{"record": f"dashboard:query{i}", "expr": re.sub(r"\$__rate_interval", "1m", expr).replace("$model", ".*")}
             for i, expr in enumerate(dashboard_queries())]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
