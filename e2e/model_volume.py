"""A model of the user's own on the test node, as a user brings it: a checkpoint folder on a
PersistentVolume (hostPath on the node), pre-bound to a claim in the mesh's namespace, which an
InferenceMesh names in spec.model.pvc with the checkpoint's byte layout (spec.model.layout, since
the operator never mounts a claim itself).

Used by the e2e tests that serve something other than the bundled model (test_moe, test_quantized).
They must run on the cluster's node (tools/cluster/up.sh's cluster sets IMESH_E2E_CONTAINERD_ADDRESS):
the test writes the volume's files itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from imesh_e2e import REPO, apply, get_json, kubectl, wait_for

BUNDLED = REPO / "src" / "inferencemesh" / "bundled" / "imesh-code-target"
# The frontend loads the tokenizer (tokenizer.json + tokenizer_config.json) and the chat template
# from the model directory; model-package.json is left out on purpose: the bundled one declares
# the bundled Llama draft, which has nothing to do with another model.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@contextlib.contextmanager
def node_folder(settings: dict, label: str) -> Iterator[Path]:
    """A fresh folder on the node's disk that the pods (uid 10001) can traverse; removed after."""
    if not settings["containerd_address"]:
        pytest.skip("writes a hostPath volume: run on the cluster's node (tools/cluster/up.sh sets "
                    "IMESH_E2E_CONTAINERD_ADDRESS)")
    # /var/tmp: on the node's disk, and every user may traverse it.
    root = Path(tempfile.mkdtemp(prefix=f"imesh-e2e-{label}-", dir="/var/tmp"))
    os.chmod(root, 0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def add_tokenizer_and_open(path: Path) -> None:
    """The bundled tokenizer beside a checkpoint, and every file world-readable: the pods run as
    uid 10001 on a read-only mount."""
    for name in TOKENIZER_FILES:
        shutil.copy(BUNDLED / name, path / name)
    os.chmod(path, 0o755)
    for child in path.iterdir():
        os.chmod(child, 0o644)


@contextlib.contextmanager
def claim_on(ns: str, label: str, folder: Path) -> Iterator[str]:
    """A PersistentVolume on `folder`, pre-bound to a claim in `ns`; yields the claim's name.

    A storage class of its own that no provisioner serves: the claim binds to this volume and to
    nothing a default class might make. Retain: deleting the claim leaves the files to the caller."""
    pv, pvc, storage_class = f"imesh-e2e-{label}-{ns}", f"{label}-models", f"imesh-e2e-{label}"
    size = {"storage": "1Gi"}
    apply(ns, {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
               "spec": {"capacity": size, "accessModes": ["ReadWriteOnce"], "storageClassName": storage_class,
                        "persistentVolumeReclaimPolicy": "Retain",
                        "hostPath": {"path": str(folder), "type": "Directory"},
                        "claimRef": {"namespace": ns, "name": pvc}}})
    try:
        apply(ns, {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": pvc},
                   "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": storage_class, "volumeName": pv,
                            "resources": {"requests": size}}})
        try:
            wait_for(lambda: get_json("pvc", pvc, "-n", ns)["status"].get("phase") == "Bound", 120,
                     f"claim {pvc} to bind to {pv}")
            yield pvc
        finally:
            # The pvc-protection finalizer holds the claim until the mesh's pods are gone.
            kubectl("delete", "pvc", pvc, "-n", ns, "--ignore-not-found", "--wait=true", "--timeout=180s",
                    check=False)
    finally:
        kubectl("delete", "pv", pv, "--ignore-not-found", "--wait=true", "--timeout=60s", check=False)


def layout_of(path: Path, dtype: str = "float32") -> dict:
    """spec.model.layout for the checkpoint on CPU stages, as a user gets it: `inferencemesh plan
    --layout` (the operator reads it back as the planner inputs it would make from the checkpoint;
    the CRD takes one size for every layer, the largest)."""
    out = subprocess.run([sys.executable, "-m", "inferencemesh", "plan", "--model", str(path), "--layout", "--json",
                          "--dtype", dtype, "--device", "cpu"], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    return json.loads(out)["layout"]


# Greedy completions of each prompt (argv[4:]) from inside the cluster, standard library only.
CLIENT = r"""
import json, sys, urllib.request
base, model, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
out = {}
for prompt in sys.argv[4:]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    req = urllib.request.Request(base + "/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    reply = json.load(urllib.request.urlopen(req, timeout=180))
    choice = reply["choices"][0]
    out[prompt] = {"text": choice["text"], "tokens": reply["usage"]["completion_tokens"],
                   "finish_reason": choice["finish_reason"]}
print(json.dumps(out))
"""
