"""The user's path on a real cluster: install, apply the example, wait for Ready, call it, delete."""

from __future__ import annotations

import yaml
from imesh_e2e import CHILD_KINDS, get_json, kubectl, mesh_doc, port_forward, wait_for, wait_router_replicas


def ready(ns: str, name: str) -> bool:
    status = get_json("inferencemesh", name, "-n", ns).get("status") or {}
    return any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", []))


def test_example_serves_openai_through_its_service(settings: dict, mesh_namespace: str) -> None:
    from openai import OpenAI

    ns = mesh_namespace
    doc = mesh_doc(settings)
    assert doc["spec"]["replicas"] == 1 and "replicas" not in doc["spec"]["frontend"], doc["spec"]
    kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))
    name = doc["metadata"]["name"]
    try:
        wait_for(lambda: ready(ns, name), settings["timeout"], f"InferenceMesh {name} to be Ready", 5)
        status = get_json("inferencemesh", name, "-n", ns)["status"]
        assert status["phase"] == "Ready" and status["endpoint"].endswith("/v1")
        assert status["pipelinesSummary"] == "1/1" and [p["state"] for p in status["pipelines"]] == ["Ready"], status
        header, row = kubectl("get", "inferencemesh", name, "-n", ns).splitlines()
        cells = dict(zip(header.split(), row.split(), strict=True))
        assert cells["PIPELINES"] == "1/1" and cells["STAGES"] == "2/2" and cells["READY"] == "True", cells
        with port_forward(ns, f"svc/{name}-frontend", doc["spec"]["frontend"]["service"]["port"]) as base:
            wait_router_replicas(base, 1)
            client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120)
            models = [m.id for m in client.models.list().data]
            assert "imesh-code-target" in models
            reply = client.completions.create(model="imesh-code-target", prompt="def add(a, b):", max_tokens=16,
                                              temperature=0)
            assert reply.choices[0].text and reply.usage.completion_tokens > 0
            chat = client.chat.completions.create(model="imesh-code-target", max_tokens=16,
                                                  messages=[{"role": "user", "content": "Write a Python loop."}])
            assert chat.choices[0].message.content is not None
    finally:
        kubectl("delete", "inferencemesh", name, "-n", ns, "--wait=true", "--timeout=120s", check=False)
    wait_for(lambda: not get_json(CHILD_KINDS, "-n", ns, "-l", f"inferencemesh.io/mesh={name}")["items"], 180,
             "the children to be collected")
