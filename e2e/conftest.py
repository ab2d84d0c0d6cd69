"""End-to-end tests against a real cluster named by KUBECONFIG (skipped without one).

They install the chart, apply examples/inferencemesh.yaml, wait for Ready, call the OpenAI
endpoint through the frontend Service and clean up. Settings (environment):
  KUBECONFIG                 the cluster (required)
  IMESH_E2E_OPERATOR_IMAGE   operator image, e.g. ghcr.io/inferencemesh/operator:0.1.0
  IMESH_E2E_STAGE_IMAGE      stage image for the mesh
  IMESH_E2E_FRONTEND_IMAGE   frontend image for the mesh
  IMESH_E2E_PULL_POLICY      imagePullPolicy for all three (e.g. Never for locally imported images)
  IMESH_E2E_NAMESPACE        namespace of the mesh (default imesh-e2e); the operator goes to <ns>-system
  IMESH_E2E_TIMEOUT          seconds to wait for Ready (default 900)
  IMESH_E2E_SERVER_SIDE      "false" to install with client-side apply (Kubernetes < 1.25)
  IMESH_E2E_CONTAINERD_ADDRESS  the node's containerd socket, where the tests run on the node
                             (tools/cluster/up.sh): enables the SIGKILL-a-container case
tools/cluster/up.sh prints all of these for its local cluster:
  eval "$(tools/cluster/up.sh | grep ^export)" && python -m pytest e2e -v

Most tests share one mesh (the `shared_mesh` fixture) to keep the run short; a test that changes
it puts it back. Tests marked `e2e_last` (deleting the mesh, uninstalling the chart) run last.

A mesh runs spec.replicas pipelines (a frontend and its own stage pods each, named <mesh>-p<k>-...)
behind its router; a change of what a pipeline runs starts a new pipeline (a new k) beside the old
one. So the tests find pods by labels and the pipeline status.pipelines calls Ready (imesh_e2e's
stage_pod, frontend_pod, ready_pipeline), never by fixed names, and a test that changed a mesh waits
for wait_settled (the old pipeline's pods gone too), not just Ready. test_replicas.py runs a mesh of
two pipelines of its own beside the shared one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from imesh_e2e import (
    PROMPTS,
    REPO,
    apply,
    delete_mesh,
    get_json,
    greedy,
    kubectl,
    local_serve,
    mesh_doc,
    wait_for,
    wait_settled,
)

SHARED_MESH = "e2e"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e_last: an e2e test that tears shared things down; runs last")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    ours = [item for item in items if here in Path(item.fspath).parents]  # only e2e's own tests
    if not os.environ.get("KUBECONFIG"):
        skip = pytest.mark.skip(reason="e2e tests need a cluster: set KUBECONFIG")
        for item in ours:
            item.add_marker(skip)
    last = [item for item in ours if item.get_closest_marker("e2e_last")]
    items[:] = [item for item in items if item not in last] + last


@pytest.fixture(scope="session")
def settings() -> dict:
    ns = os.environ.get("IMESH_E2E_NAMESPACE", "imesh-e2e")
    return {
        "namespace": ns,
        "operator_namespace": f"{ns}-system",
        "timeout": float(os.environ.get("IMESH_E2E_TIMEOUT", "900")),
        "operator_image": os.environ.get("IMESH_E2E_OPERATOR_IMAGE", ""),
        "stage_image": os.environ.get("IMESH_E2E_STAGE_IMAGE", ""),
        "frontend_image": os.environ.get("IMESH_E2E_FRONTEND_IMAGE", ""),
        "pull_policy": os.environ.get("IMESH_E2E_PULL_POLICY", ""),
        "server_side": os.environ.get("IMESH_E2E_SERVER_SIDE", "true").lower() != "false",
        "containerd_address": os.environ.get("IMESH_E2E_CONTAINERD_ADDRESS", ""),
    }


@pytest.fixture(scope="session")
def release(settings: dict) -> Iterator[str]:
    """`helm install` of charts/inferencemesh with the Helm Go SDK; uninstalled at the end."""
    import helm_python as helm
    from helm_python import _native

    values: dict = {"meshImages": {}}
    if settings["operator_image"]:
        repo, _, tag = settings["operator_image"].rpartition(":")
        values["image"] = {"repository": repo, "tag": tag}
    if settings["pull_policy"]:
        values.setdefault("image", {})["pullPolicy"] = settings["pull_policy"]
    for key in ("stage", "frontend"):
        if settings[f"{key}_image"]:
            values["meshImages"][key] = settings[f"{key}_image"]
    if not values["meshImages"]:
        del values["meshImages"]
    name, ns = "imesh-e2e", settings["operator_namespace"]
    with helm.Config(namespace=ns) as cfg:
        opts = {"namespace": ns, "create_namespace": True, "timeout_seconds": 300,
                "server_side_apply": settings["server_side"]}
        # Config.install has no server-side switch yet; the native call takes the same options.
        _native.call_string("helm_install", cfg._raw(), _native.HANDLE(0), _native.HANDLE(0),
                            str(REPO / "charts" / "inferencemesh"), name, json.dumps(values), json.dumps(opts))
        try:
            wait_for(lambda: get_json("deployment", f"{name}-inferencemesh-operator", "-n", ns)
                     .get("status", {}).get("readyReplicas") == 1, 300, "the operator Deployment to be ready")
            yield name
        finally:
            cfg.uninstall(name, timeout=300, ignore_not_found=True)


@pytest.fixture(scope="session")
def mesh_namespace(settings: dict, release: str) -> Iterator[str]:
    ns = settings["namespace"]
    kubectl("create", "namespace", ns, check=False)
    yield ns
    kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture(scope="session")
def shared_mesh(settings: dict, mesh_namespace: str) -> Iterator[dict]:
    """The example mesh (one pipeline; small CPU requests, so a re-plan's second pipeline fits beside
    the first), Ready; deleted at the end of the session."""
    doc = mesh_doc(settings, SHARED_MESH, small=True)
    apply(mesh_namespace, doc)
    try:
        wait_settled(mesh_namespace, SHARED_MESH, settings["timeout"])
        yield {"namespace": mesh_namespace, "name": SHARED_MESH, "doc": doc}
    finally:
        delete_mesh(mesh_namespace, SHARED_MESH)


@pytest.fixture(scope="session")
def reference(settings: dict) -> dict[str, str]:
    """Greedy completions of PROMPTS from `inferencemesh serve` run here (same model and dtype)."""
    from openai import OpenAI

    with local_serve(mesh_doc(settings)["spec"]["model"]["dtype"]) as url:
        client = OpenAI(base_url=url, api_key="unused", timeout=120)
        return {prompt: greedy(client, prompt) for prompt in PROMPTS}
