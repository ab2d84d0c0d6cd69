"""The user's path on a real cluster: install, apply the example, wait for Ready, call it, delete."""

from __future__ import annotations

import subprocess
import time

import yaml
from imesh_e2e import free_port, get_json, kubectl, mesh_doc, wait_for


def ready(ns: str, name: str) -> bool:
    status = get_json("inferencemesh", name, "-n", ns).get("status") or {}
    return any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", []))


def test_example_serves_openai_through_its_service(settings: dict, mesh_namespace: str) -> None:
    from openai import OpenAI

    ns = mesh_namespace
    doc = mesh_doc(settings)
    kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))
    name = doc["metadata"]["name"]
    try:
        wait_for(lambda: ready(ns, name), settings["timeout"], f"InferenceMesh {name} to be Ready", 5)
        status = get_json("inferencemesh", name, "-n", ns)["status"]
        assert status["phase"] == "Ready" and status["endpoint"].endswith("/v1")
        port = free_port()
        forward = subprocess.Popen(["kubectl", "port-forward", "-n", ns, f"svc/{name}-frontend",
                                    f"{port}:{doc['spec']['frontend']['service']['port']}"],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            time.sleep(3)
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
            models = [m.id for m in client.models.list().data]
            assert "imesh-code-target" in models
            reply = client.completions.create(model="imesh-code-target", prompt="def add(a, b):", max_tokens=16,
                                              temperature=0)
            assert reply.choices[0].text and reply.usage.completion_tokens > 0
            chat = client.chat.completions.create(model="imesh-code-target", max_tokens=16,
                                                  messages=[{"role": "user", "content": "Write a Python loop."}])
            assert chat.choices[0].message.content is not None
        finally:
            forward.terminate()
            forward.wait(10)
    finally:
        kubectl("delete", "inferencemesh", name, "-n", ns, "--wait=true", "--timeout=120s", check=False)
    wait_for(lambda: not get_json("deployments,replicasets,pods,services,configmaps,networkpolicies", "-n", ns,
                                  "-l", f"inferencemesh.io/mesh={name}")["items"], 180, "the children to be collected")

