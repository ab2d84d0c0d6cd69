"""Dict-in, dict-out access to the Kubernetes API through the official client's DynamicClient.

Objects stay plain JSON dicts end to end, exactly as render.py produces and the API returns them,
with no model-class round trips that could drop or rename fields. The DynamicClient finds each
kind's REST path by discovery; errors are its ApiException subclasses (with .status and .body).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import NotFoundError, ResourceNotFoundError
from kubernetes.dynamic.resource import Resource

# The kinds the operator touches, by apiVersion (discovery needs both to pick one resource).
API_VERSIONS = {
    "ConfigMap": "v1",
    "Secret": "v1",
    "Service": "v1",
    "Pod": "v1",
    "Event": "v1",
    "ServiceAccount": "v1",
    "Deployment": "apps/v1",
    "Role": "rbac.authorization.k8s.io/v1",
    "RoleBinding": "rbac.authorization.k8s.io/v1",
    "NetworkPolicy": "networking.k8s.io/v1",
    "PodDisruptionBudget": "policy/v1",
    "InferenceMesh": "inferencemesh.io/v1alpha1",
}
# Where a server predates API_VERSIONS' version of a kind: the older one it serves instead, with the
# same fields for what the renderer writes (policy/v1 PodDisruptionBudgets came with Kubernetes 1.21).
OLDER_VERSIONS = {"PodDisruptionBudget": ("policy/v1beta1",)}


@dataclass(frozen=True)
class Write:
    verb: str  # create | replace | delete | patch-status | event
    kind: str
    name: str


def _as_dict(_client: DynamicClient, data: dict) -> dict:
    """The DynamicClient's response serializer: keep the decoded JSON as it is."""
    return data


class Kube:
    """Safe to share between threads (reconciles of different meshes run in parallel)."""

    def __init__(self, api: client.ApiClient, timeout: float = 30.0) -> None:
        self.dynamic = DynamicClient(api)  # discovers the server's API groups now (network)
        self.timeout = timeout
        self._discovery = threading.Lock()  # the client's lazy discovery cache is not thread-safe
        self._versions: dict[str, str] = {}  # kind -> the version this server serves (once found)

    def _resource(self, kind: str) -> Resource:
        with self._discovery:
            known = self._versions.get(kind)
            if known is not None:
                return self.dynamic.resources.get(api_version=known, kind=kind)
            # A miss re-reads the whole discovery: ask each version once, then remember the answer.
            versions = [API_VERSIONS[kind], *OLDER_VERSIONS.get(kind, ())]
            while True:
                version = versions.pop(0)
                try:
                    resource = self.dynamic.resources.get(api_version=version, kind=kind)
                except ResourceNotFoundError:
                    if not versions:
                        raise
                    continue
                self._versions[kind] = version
                return resource

    def _body(self, obj: dict) -> tuple[Resource, dict]:
        """The object's resource, and the object in the version the server serves it in."""
        resource = self._resource(obj["kind"])
        if obj.get("apiVersion") != resource.group_version:
            obj = {**obj, "apiVersion": resource.group_version}
        return resource, obj

    def _call(self, verb: str, resource: Resource, **kwargs: Any) -> dict:
        method = getattr(self.dynamic, verb)
        return method(resource, serializer=_as_dict, _request_timeout=self.timeout, **kwargs)

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        try:
            return self._call("get", self._resource(kind), name=name, namespace=namespace)
        except NotFoundError:
            return None

    def list(self, kind: str, namespace: str, selector: str | None = None) -> list[dict]:
        """List items carry no kind of their own."""
        found = self._call("get", self._resource(kind), namespace=namespace, label_selector=selector)
        return found.get("items") or []

    def create(self, obj: dict) -> dict:
        resource, body = self._body(obj)
        return self._call("create", resource, body=body, namespace=obj["metadata"]["namespace"])

    def replace(self, obj: dict) -> dict:
        """PUT: the whole object, guarded by the metadata.resourceVersion it carries."""
        resource, body = self._body(obj)
        return self._call("replace", resource, body=body, namespace=obj["metadata"]["namespace"])

    def delete(self, kind: str, namespace: str, name: str) -> None:
        try:
            self._call("delete", self._resource(kind), name=name, namespace=namespace,
                       propagation_policy="Background")
        except NotFoundError:
            pass

    def patch(self, kind: str, namespace: str, name: str, patch: dict) -> dict:
        """A JSON merge patch of the object (a metadata.resourceVersion in it is a precondition)."""
        return self._call("patch", self._resource(kind), body=patch, name=name, namespace=namespace,
                          content_type="application/merge-patch+json")

    def patch_status(self, kind: str, namespace: str, name: str, patch: dict) -> dict:
        """A JSON merge patch of the status subresource."""
        status = self._resource(kind).subresources["status"]
        return self._call("patch", status, body=patch, name=name, namespace=namespace,
                          content_type="application/merge-patch+json")

    def server_minor_version(self) -> int:
        """The API server's minor version (e.g. 20 for v1.20.2); 0 when unreadable. Asked afresh:
        the client's discovery cache (a file in the temp dir) may predate an upgrade of the server."""
        try:
            info = self.dynamic.request("get", "/version", serializer=_as_dict, _request_timeout=self.timeout)
            return int("".join(ch for ch in str(info.get("minor", "")) if ch.isdigit()) or 0)
        except (ApiException, ValueError, OSError):
            return 0
