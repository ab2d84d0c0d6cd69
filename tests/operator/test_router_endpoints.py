"""The router's replicas from a Service's EndpointSlices, against a real kube-apiserver (1.20 here:
discovery.k8s.io/v1beta1 only): the router, running as its program runs it, follows slices that
are created, turn not ready and are deleted."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from imesh_k8s import ControlPlane, wait_for

from inferencemesh.config import RouterConfig
from inferencemesh.programs.router import router_server

pytestmark = [pytest.mark.k8s, pytest.mark.slow]
NS = "router-tests"
SERVICE = "mesh-frontends"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def endpoint_slice(name: str, endpoints: list[tuple[str, str, bool]], port: int | None = 8000) -> dict:
    """An EndpointSlice of SERVICE: (address, pod name, ready) each; a port named http (or none)."""
    return {
        "apiVersion": "discovery.k8s.io/v1beta1", "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": SERVICE}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}] if port else [],
        "endpoints": [{"addresses": [address], "conditions": {"ready": ready},
                       "targetRef": {"kind": "Pod", "name": pod, "namespace": NS}}
                      for address, pod, ready in endpoints],
    }


@pytest.fixture(scope="module")
def routed(cluster: ControlPlane) -> Iterator[tuple[str, object]]:
    """A router watching SERVICE's slices in NS (credentials: the cluster's kubeconfig, $KUBECONFIG)."""
    cluster.kubectl("create", "namespace", NS)
    port = _free_port()
    config = RouterConfig(host="127.0.0.1", port=port, frontends_service=SERVICE, namespace=NS, frontend_port=9000)
    server = router_server(config, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30, "the router")
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(10)


def replicas(base: str) -> dict[str, str]:
    return {r["name"]: r["url"] for r in httpx.get(f"{base}/router/replicas", timeout=5).json()["replicas"]}


def becomes(base: str, expected: dict[str, str], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while (seen := replicas(base)) != expected:
        assert time.monotonic() < deadline, f"the router has {seen}, not {expected}"
        time.sleep(0.1)


def test_the_router_follows_endpoint_slices(cluster: ControlPlane, routed: tuple[str, object]) -> None:
    base, server = routed
    assert httpx.get(f"{base}/ready").status_code == 503  # nothing yet
    cluster.apply(endpoint_slice("mesh-frontends-a", [("10.1.0.5", "mesh-p0-frontend-7d9f8c6b5-x2x9z", True),
                                                      ("10.1.0.6", "mesh-p1-frontend-5c8d7f9b4-abcde", True)]), NS)
    becomes(base, {"mesh-p0-frontend": "http://10.1.0.5:8000", "mesh-p1-frontend": "http://10.1.0.6:8000"})
    assert httpx.get(f"{base}/ready").status_code == 200
    app = server.config.loaded_app  # type: ignore[attr-defined]
    app = getattr(app, "app", app)
    assert app.source.api_version == "discovery.k8s.io/v1beta1"

    # p1 turns not ready: it leaves, p0 keeps its place
    cluster.apply(endpoint_slice("mesh-frontends-a", [("10.1.0.5", "mesh-p0-frontend-7d9f8c6b5-x2x9z", True),
                                                      ("10.1.0.6", "mesh-p1-frontend-5c8d7f9b4-abcde", False)]), NS)
    becomes(base, {"mesh-p0-frontend": "http://10.1.0.5:8000"})

    # a second slice without a port named http: the configured --frontend-port
    cluster.apply(endpoint_slice("mesh-frontends-b", [("10.1.0.7", "mesh-p2-frontend-6f7c9d8b5-zz9zz", True)],
                                 port=None), NS)
    becomes(base, {"mesh-p0-frontend": "http://10.1.0.5:8000", "mesh-p2-frontend": "http://10.1.0.7:9000"})

    # a slice of another Service is not ours
    other = endpoint_slice("other-x", [("10.1.0.9", "other-frontend-6f7c9d8b5-qq9qq", True)])
    other["metadata"]["labels"]["kubernetes.io/service-name"] = "other"
    cluster.apply(other, NS)

    cluster.kubectl("delete", "endpointslices.discovery.k8s.io", "mesh-frontends-a", "-n", NS)
    becomes(base, {"mesh-p2-frontend": "http://10.1.0.7:9000"})
    metrics = httpx.get(f"{base}/metrics").text
    assert 'replica="mesh-p0-frontend"' not in metrics and "inferencemesh_router_ready_replicas 1.0" in metrics

    cluster.kubectl("delete", "endpointslices.discovery.k8s.io", "mesh-frontends-b", "-n", NS)
    becomes(base, {})
    ready = httpx.get(f"{base}/ready")
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "no_replica"
