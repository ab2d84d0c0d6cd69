"""A thin, dict-in/dict-out layer over the Kubernetes REST API (the official client's ApiClient).

Objects stay plain JSON dicts end to end, exactly as render.py produces and the API returns them,
with no model-class round trips that could drop or rename fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kubernetes import client, config
from kubernetes.client.rest import ApiException

# kind -> (API prefix, plural)
RESOURCES: dict[str, tuple[str, str]] = {
    "ConfigMap": ("/api/v1", "configmaps"),
    "Service": ("/api/v1", "services"),
    "Pod": ("/api/v1", "pods"),
    "Event": ("/api/v1", "events"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "InferenceMesh": ("/apis/inferencemesh.io/v1alpha1", "inferencemeshes"),
}


@dataclass(frozen=True)
class Write:
    verb: str  # create | replace | delete | patch-status | event
    kind: str
    name: str


def load_api_client() -> client.ApiClient:
    """In a pod: its service account; elsewhere: KUBECONFIG / ~/.kube/config."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


class Kube:
    def __init__(self, api: client.ApiClient, timeout: float = 30.0) -> None:
        self.api = api
        self.timeout = timeout

    def _path(self, kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
        prefix, plural = RESOURCES[kind]
        path = f"{prefix}/namespaces/{namespace}/{plural}"
        if name is not None:
            path += f"/{name}"
        if sub:
            path += f"/{sub}"
        return path

    def _call(self, method: str, path: str, *, body: Any = None, query: list | None = None,
              content_type: str = "application/json") -> dict:
        request = self.api.param_serialize(
            method=method, resource_path=path, query_params=query or [], body=body,
            header_params={"Accept": "application/json", "Content-Type": content_type},
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(*request, _request_timeout=self.timeout)
        data = response.read()
        if not 200 <= response.status < 300:
            raise ApiException(http_resp=response)
        return json.loads(data) if data else {}

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        try:
            return self._call("GET", self._path(kind, namespace, name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str, selector: str | None = None) -> list[dict]:
        query = [("labelSelector", selector)] if selector else []
        return self._call("GET", self._path(kind, namespace), query=query).get("items", [])

    def create(self, obj: dict) -> dict:
        meta = obj["metadata"]
        return self._call("POST", self._path(obj["kind"], meta["namespace"]), body=obj)

    def replace(self, obj: dict) -> dict:
        meta = obj["metadata"]
        return self._call("PUT", self._path(obj["kind"], meta["namespace"], meta["name"]), body=obj)

    def delete(self, kind: str, namespace: str, name: str) -> None:
        try:
            self._call("DELETE", self._path(kind, namespace, name),
                       body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"})
        except ApiException as exc:
            if exc.status != 404:
                raise

    def patch_status(self, kind: str, namespace: str, name: str, patch: dict) -> dict:
        return self._call("PATCH", self._path(kind, namespace, name, "status"), body=patch,
                          content_type="application/merge-patch+json")

    def server_minor_version(self) -> int:
        """The API server's minor version (e.g. 20 for v1.20.2); 0 when unreadable."""
        try:
            info = self._call("GET", "/version")
            return int("".join(ch for ch in str(info.get("minor", "0")) if ch.isdigit()) or 0)
        except (ApiException, ValueError, OSError):
            return 0
