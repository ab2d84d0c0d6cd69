"""A batch of hostile but schema-valid InferenceMeshes: the operator must not crash, hang or loop."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from imesh_k8s import ControlPlane, OperatorProcess, wait_for

from inferencemesh.operator.names import base_name

pytestmark = [pytest.mark.k8s, pytest.mark.slow]
NS = "hostile"
LONG_NAME = ".".join(["x" * 60] * 4) + ".y"  # 245 characters, a valid DNS subdomain


def hostile_specs(tiny: str) -> dict[str, tuple[dict, str, str | None]]:
    """name -> (spec, expected Planned status, expected reason or None)."""
    model = {"name": tiny}
    return {
        LONG_NAME: ({"model": model}, "True", "Planned"),
        "9lives": ({"model": model, "speculative": {"strategy": "none"}}, "True", "Planned"),
        "unicode-name": ({"model": {**model, "servedModelName": "模型 🚀 \"quoted\" $(rm -rf /)"}}, "True", "Planned"),
        "sixty-four-stages": ({"model": model, "stages": {"count": 64}}, "False", "PlanFailed"),
        "huge-layout": ({"model": {"name": "m", "layout": {"numLayers": 256, "layerBytes": 10**15,
                                                           "kvBytesPerToken": 10**12}},
                         "stages": {"count": 64, "memory": ["80Gi"]}}, "False", "PlanFailed"),
        "auto-one-byte": ({"model": model, "stages": {"count": "auto", "memory": ["1"]}}, "False", "PlanFailed"),
        "zero-memory": ({"model": model, "stages": {"count": 2, "memory": ["0"]}}, "False", "PlanFailed"),
        "max-context": ({"model": model, "contextLength": 1048576, "maxSessions": 4096, "kvCacheTokens": 2**30,
                         "stages": {"count": 2, "memory": ["80Gi"]}}, "False", "PlanFailed"),
        "bundled-escape": ({"model": {"name": "bundled://../../etc/passwd"}}, "False", "ModelUnreadable"),
        "proc-dir": ({"model": {"name": "/proc/self"}}, "False", "ModelUnreadable"),
        "dev-zero": ({"model": {"name": "/dev/zero"}}, "False", "ModelUnreadable"),
        "not-a-hub-id": ({"model": {"name": "a/b/c"}}, "False", "ModelUnreadable"),
        "hub-offline": ({"model": {"name": "org/does-not-exist"}}, "Unknown", "ModelUnavailable"),
        "bad-resources": ({"model": model, "stages": {"resources": {"limits": {"cpu": "lots"}}}},
                          "False", "InvalidChild"),
        "bad-toleration": ({"model": model, "stages": {"tolerations": [{"operator": "Bogus"}]}},
                           "False", "InvalidChild"),
        "bad-affinity": ({"model": model, "stages": {"affinity": {"nodeAffinity": "not-an-object"}}},
                         "False", "InvalidChild"),
        "bad-node-selector": ({"model": model, "frontend": {"nodeSelector": {"gpu": "a b/c"}}},
                              "False", "InvalidChild"),
        "no-pipelines": ({"model": model, "replicas": 0}, "True", "Planned"),
    }


def test_hostile_specs_settle_without_crash_or_loop(cluster: ControlPlane, operator: OperatorProcess,
                                                    tiny_model: Path) -> None:
    cluster.kubectl("create", "namespace", NS)
    specs = hostile_specs(str(tiny_model))
    docs = [{"apiVersion": "inferencemesh.io/v1alpha1", "kind": "InferenceMesh", "metadata": {"name": name},
             "spec": spec} for name, (spec, _, _) in specs.items()]
    cluster.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump_all(docs))

    def settled() -> bool:
        items = cluster.get_json("inferencemesh", "-n", NS)["items"]
        done = {i["metadata"]["name"]: i for i in items
                if (i.get("status") or {}).get("observedGeneration") == i["metadata"]["generation"]}
        return len(done) == len(specs) and done  # type: ignore[return-value]

    meshes = wait_for(settled, 120, "every hostile mesh to get a status", 1)
    for name, (_, planned, reason) in specs.items():
        st = meshes[name]["status"]  # type: ignore[index]
        planned_cond = next(c for c in st["conditions"] if c["type"] == "Planned")
        assert (planned_cond["status"], planned_cond["reason"]) == (planned, reason), (name, planned_cond)
        assert planned_cond["message"]
    assert operator.proc.poll() is None, operator.log()

    # folded names: valid children for a 245-character and a digit-first mesh name
    for name in (LONG_NAME, "9lives"):
        base = base_name(name)
        deps = cluster.get_json("deployments", "-n", NS, "-l", f"inferencemesh.io/mesh={base}")["items"]
        assert sorted(d["metadata"]["name"] for d in deps) == sorted(
            [f"{base}-p0-frontend", f"{base}-p0-stage-0", f"{base}-p0-stage-1", f"{base}-router"])

    # no hot loop: over a quiet window the operator barely reconciles (resync is 30 s here)
    time.sleep(3)
    first = operator.metric("inferencemesh_operator_reconciles_total")
    time.sleep(8)
    assert operator.metric("inferencemesh_operator_reconciles_total") - first <= len(specs), operator.log()
    versions = {i["metadata"]["name"]: i["metadata"]["resourceVersion"]
                for i in cluster.get_json("inferencemesh", "-n", NS)["items"]}
    time.sleep(2)
    assert versions == {i["metadata"]["name"]: i["metadata"]["resourceVersion"]
                        for i in cluster.get_json("inferencemesh", "-n", NS)["items"]}

    # and it still serves a sane request promptly
    sane = {"apiVersion": "inferencemesh.io/v1alpha1", "kind": "InferenceMesh", "metadata": {"name": "sane"},
            "spec": {"model": {"name": str(tiny_model)}}}
    cluster.apply(sane, NS)
    def sane_planned() -> bool:
        status = cluster.get_json("inferencemesh", "sane", "-n", NS).get("status") or {}
        return any(c["type"] == "Planned" and c["status"] == "True" for c in status.get("conditions", []))

    wait_for(sane_planned, 30, "the sane mesh to be planned")
    assert urllib.request.urlopen(operator.liveness, timeout=5).status == 200
    cluster.kubectl("delete", "namespace", NS, "--wait=false")

