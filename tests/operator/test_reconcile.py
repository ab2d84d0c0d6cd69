"""One reconcile against an in-memory stand-in for the API: what an invalid spec leads to.
(The full create/replace/delete cycle runs against a real API server in test_cluster.py.)"""

from __future__ import annotations

import pytest

from inferencemesh.operator.reconcile import Reconciler
from inferencemesh.operator.spec import MSG_RANGES_OVERLAP


class FakeKube:
    """The one mesh, no children; records status patches and created objects (Events)."""

    def __init__(self, spec: dict) -> None:
        self.mesh = {"apiVersion": "inferencemesh.io/v1alpha1", "kind": "InferenceMesh",
                     "metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": 1}, "spec": spec}
        self.patches: list[dict] = []
        self.created: list[dict] = []

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        return self.mesh if kind == "InferenceMesh" else None

    def list(self, kind: str, namespace: str, selector: str | None = None) -> list[dict]:
        return []

    def create(self, obj: dict) -> dict:
        self.created.append(obj)
        return obj

    def patch_status(self, kind: str, namespace: str, name: str, patch: dict) -> dict:
        self.patches.append(patch)
        self.mesh = {**self.mesh, "status": patch["status"]}
        return self.mesh


@pytest.mark.parametrize(("spec", "message"), [
    # a spec the model refuses (only possible for an object the API server did not check against this CRD)
    ({"model": {"name": "m", "dtype": "float8"}}, "spec.model.dtype: Input should be 'auto', 'float32'"),
    ({}, "spec.model: Field required"),
    # a CEL rule that API servers older than 1.25 do not enforce
    ({"model": {"name": "m"}, "stages": {"count": 2, "ranges": [{"start": 0, "end": 3}, {"start": 2, "end": 4}]}},
     MSG_RANGES_OVERLAP),
])
def test_an_invalid_spec_ends_planned_false_with_the_reason(spec: dict, message: str) -> None:
    kube = FakeKube(spec)
    result = Reconciler(kube).reconcile("ns", "m")  # type: ignore[arg-type]
    assert result.phase == "Failed" and result.retry_after is None  # terminal: no retry until the spec changes
    (patch,) = kube.patches
    planned = next(c for c in patch["status"]["conditions"] if c["type"] == "Planned")
    assert (planned["status"], planned["reason"]) == ("False", "InvalidSpec") and message in planned["message"]
    (event,) = kube.created
    assert (event["kind"], event["type"], event["reason"]) == ("Event", "Warning", "InvalidSpec")
    again = Reconciler(kube).reconcile("ns", "m")  # type: ignore[arg-type]
    assert again.writes == []  # an unchanged world: nothing more to write
