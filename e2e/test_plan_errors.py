"""A mesh that cannot fit is refused at planning time with a reason a user can act on, and no
pod is started to crash-loop (OOM-killed) instead."""

from __future__ import annotations

import re
import time

import pytest
from imesh_e2e import apply, conditions, delete_mesh, get_json, kubectl, mesh_doc, pods, wait_for

# Each stage of the bundled model plans ~350 MiB (fp32); 64Mi holds no layer range.
TOO_SMALL = "64Mi"


@pytest.mark.parametrize("where", ["stages.memory", "resources.limits.memory"])
def test_a_model_that_does_not_fit_is_refused_with_a_reason(where: str, settings: dict, mesh_namespace: str) -> None:
    ns, name = mesh_namespace, f"too-small-{where.split('.')[0]}"
    doc = mesh_doc(settings, name, small=True)
    if where == "stages.memory":  # the planner's own budget per stage
        doc["spec"]["stages"]["memory"] = [TOO_SMALL]
    else:  # the container's memory limit (and request): a stage pod would be OOM-killed loading its layers
        resources = doc["spec"]["stages"]["resources"]
        resources["requests"]["memory"] = TOO_SMALL
        resources["limits"] = {"memory": TOO_SMALL}
    apply(ns, doc)
    try:
        planned = wait_for(lambda: conditions(ns, name).get("Planned", {}).get("status") == "False"
                           and conditions(ns, name)["Planned"], 120, f"{name}: Planned=False")
        message = planned["message"]
        print(f"{where}: Planned=False {planned['reason']}: {message}")  # shown with pytest -rA
        assert planned["reason"] not in ("", "Planned", "InvalidChild"), planned  # refused by the plan, not the API
        # Actionable: says it is about memory and how much is needed or available.
        assert "memory" in message.lower() or "fit" in message.lower(), message
        assert re.search(r"\d", message), message
        status = get_json("inferencemesh", name, "-n", ns)["status"]
        assert status.get("phase") != "Ready"
        time.sleep(20)  # time enough for a wrongly started stage pod to be OOM-killed and restarted
        pods = get_json("pods", "-n", ns, "-l", f"inferencemesh.io/mesh={name}")["items"]
        restarts = {p["metadata"]["name"]: sum(c.get("restartCount", 0)
                                               for c in p["status"].get("containerStatuses", [])) for p in pods}
        assert not any(restarts.values()), f"pods crash-loop instead of a refused plan: {restarts}"
        assert not [p for p in pods if p["metadata"]["labels"].get("app.kubernetes.io/component") == "stage"], \
            f"stage pods started for a plan that does not fit: {[p['metadata']['name'] for p in pods]}"
    finally:
        delete_mesh(ns, name)


# A model the operator cannot find: the same one-line, actionable wording the CLI prints, in the
# mesh's status and in the operator's log, never a traceback. The cluster has no route to the hub.
UNFINDABLE = {
    "hub-id": ("example-org/no-such-model", "Unknown", "ModelUnavailable", "local model directory"),
    "missing-path": ("/models/no-such-dir", "False", "ModelUnreadable", "not a directory"),
}


@pytest.mark.parametrize("case", sorted(UNFINDABLE))
def test_a_model_that_cannot_be_found_is_reported_in_one_line(case: str, settings: dict, release: str,
                                                              mesh_namespace: str) -> None:
    model, status, reason, hint = UNFINDABLE[case]
    ns, name = mesh_namespace, f"unfindable-{case}"
    doc = mesh_doc(settings, name, small=True)
    doc["spec"]["model"] = {"name": model, "dtype": "float32"}
    apply(ns, doc)
    try:
        planned = wait_for(lambda: (conditions(ns, name).get("Planned") or {}).get("reason") == reason
                           and conditions(ns, name)["Planned"], 180, f"{name}: Planned {reason}")
        message = planned["message"]
        print(f"{case}: Planned={planned['status']} {reason}: {message}")  # shown with pytest -rA
        assert planned["status"] == status, planned
        assert hint in message and model in message, message
        assert "\n" not in message and "Traceback" not in message, message
        assert not pods(ns, f"inferencemesh.io/mesh={name}"), "no pod may start for a model nobody can find"
        operator_log = kubectl("logs", "-n", settings["operator_namespace"],
                               f"deployment/{release}-inferencemesh-operator", "--tail=2000")
        assert "Traceback" not in operator_log, operator_log[-3000:]
        assert f"{ns}/{name}: {reason}: {message}" in operator_log, operator_log[-3000:]
    finally:
        delete_mesh(ns, name)
