"""Stage traffic is authenticated by default: the operator issues each mesh's CA and a certificate per
stage and per frontend, the stages accept only this mesh's certificates, the frontend serves over
mutual TLS with the operator's certificates, and the certificates rotate (a shortened lifetime).

The probes run inside the mesh's own frontend pod (`kubectl exec`), where the stage Services resolve
and the pod's certificate is mounted. Certificates are per pipeline component: <name>-p<k>-stage-<i>-tls
and <name>-p<k>-frontend-tls, k the Ready pipeline (status.pipelines); the CA is the mesh's, <name>-ca.

"Another mesh" is a real second InferenceMesh that runs nothing: one pipeline (spec.replicas 1) whose
only stage is embedded in its frontend, and whose frontend and router pods may only go to a node that
does not exist (nodeSelector), so they stay Pending. The operator issues certificates for the
components of the pipelines it runs, whether their pods are scheduled or not, so that pipeline's
frontend certificate exists. (With spec.replicas 0 no pipeline exists and the operator issues only
the mesh's CA, <name>-ca: no leaf certificate to attack with, hence replicas 1 here.)
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import pytest
from imesh_e2e import (
    LABEL_COMPONENT,
    LABEL_MESH,
    LABEL_PIPELINE,
    PROMPTS,
    apply,
    delete_mesh,
    exec_python,
    frontend_pod,
    get_json,
    greedy,
    kubectl,
    mesh_doc,
    pods,
    port_forward,
    prefix,
    ready_pipeline,
    running_pods,
    wait_for,
    wait_ready,
    wait_settled,
)

openai = pytest.importorskip("openai")
TLS_MOUNT = "/etc/inferencemesh/tls"
OTHER_MESH = "e2e-other"
NOWHERE = {"inferencemesh.io/e2e-no-such-node": "true"}  # a nodeSelector no node matches

# Run in a mesh pod: try one stage with no TLS, with the pod's own certificate, and with another
# certificate and key (argv: address, server name, base64 cert, base64 key, base64 trust roots or "-"
# for the pod's own). Prints {"plaintext": bool, "own": bool, "other": bool} (True: let in, SERVING).
PROBE = r"""
import base64, json, sys
from inferencemesh.protocol.health import check
from inferencemesh.tls import TlsMaterial
address, name, cert, key, roots = sys.argv[1:6]
own = TlsMaterial.from_dir("/etc/inferencemesh/tls")
other = TlsMaterial(base64.b64decode(cert), base64.b64decode(key), own.ca if roots == "-" else base64.b64decode(roots))
print(json.dumps({"plaintext": check(address), "own": check(address, tls=own, server_name=name),
                  "other": check(address, tls=other, server_name=name)}))
"""


def secret_data(ns: str, name: str) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in get_json("secret", name, "-n", ns)["data"].items()}


TLS_HASH = "inferencemesh.io/tls-hash"  # the pod template's annotation: a renewal changes it, and so rolls the pods


def tls_hashes(ns: str, name: str) -> dict[str, str]:
    """Each Deployment of the mesh that mounts a certificate (stages and frontends; the router mounts
    none) -> the certificate hash on its pod template."""
    items = get_json("deployments", "-n", ns, "-l", f"inferencemesh.io/mesh={name}")["items"]
    found = {d["metadata"]["name"]: (d["spec"]["template"]["metadata"].get("annotations") or {})
             .get(TLS_HASH) for d in items}
    return {k: v for k, v in found.items() if v}


def probe(ns: str, pod: str, address: str, cert: bytes, key: bytes, roots: bytes | None) -> dict[str, bool]:
    enc = lambda b: base64.b64encode(b).decode()  # noqa: E731
    proc = exec_python(ns, pod, PROBE, address, address.rsplit(":", 1)[0], enc(cert), enc(key),
                       enc(roots) if roots else "-")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def other_mesh(settings: dict, shared_mesh: dict) -> Iterator[dict[str, bytes]]:
    """A second mesh's frontend certificate (tls.crt, tls.key, ca.crt), issued by the operator for
    its pipeline 0 (a new mesh's first pipeline), whose pods never run (see the module's docstring)."""
    ns = shared_mesh["namespace"]
    doc = mesh_doc(settings, OTHER_MESH, small=True)
    doc["spec"]["replicas"] = 1
    doc["spec"]["stages"]["count"] = 1
    doc["spec"]["frontend"].update(embedFirstStage=True, nodeSelector=NOWHERE)
    doc["spec"]["router"] = {"nodeSelector": NOWHERE}
    apply(ns, doc)
    try:
        certificate = wait_for(lambda: secret_data(ns, f"{prefix(OTHER_MESH, 0)}-frontend-tls"), 120,
                               "the other mesh's certificate")
        # the leaf's trust bundle starts with the other mesh's own signing CA
        assert certificate["ca.crt"].startswith(secret_data(ns, f"{OTHER_MESH}-ca")["ca.crt"])  # type: ignore[index]
        running = [p["metadata"]["name"] for p in pods(ns, f"inferencemesh.io/mesh={OTHER_MESH}")
                   if (p.get("status") or {}).get("phase") not in (None, "Pending")]
        assert not running, f"the other mesh should run nothing: {running}"
        yield certificate  # type: ignore[misc]
    finally:
        delete_mesh(ns, OTHER_MESH)


def test_stages_refuse_plaintext_and_another_meshs_certificate(settings: dict, shared_mesh: dict,
                                                               other_mesh: dict[str, bytes]) -> None:
    ns, name = shared_mesh["namespace"], shared_mesh["name"]
    wait_settled(ns, name, settings["timeout"])  # an earlier test may have left it rolling
    k = ready_pipeline(ns, name)
    ours = secret_data(ns, f"{name}-ca")
    assert other_mesh["ca.crt"] != ours["ca.crt"]  # each mesh has a CA of its own
    pod = frontend_pod(ns, name, k)["metadata"]["name"]
    for stage in (0, 1):
        address = f"{prefix(name, k)}-stage-{stage}.{ns}.svc:50051"
        # the other mesh's certificate, trusting this mesh's CA (as an attacker who read the CA would)
        seen = probe(ns, pod, address, other_mesh["tls.crt"], other_mesh["tls.key"], None)
        assert seen == {"plaintext": False, "own": True, "other": False}, (address, seen)
        # the other mesh's certificate with its own CA: neither end trusts the other
        seen = probe(ns, pod, address, other_mesh["tls.crt"], other_mesh["tls.key"], other_mesh["ca.crt"])
        assert seen["other"] is False, (address, seen)


def test_the_frontend_serves_over_mtls_with_the_operators_certificates(settings: dict, shared_mesh: dict) -> None:
    ns, name = shared_mesh["namespace"], shared_mesh["name"]
    wait_settled(ns, name, settings["timeout"])
    k = ready_pipeline(ns, name)
    component = f"{prefix(name, k)}-frontend"
    frontend = get_json("deployment", component, "-n", ns)["spec"]["template"]
    volumes = {v["name"]: v for v in frontend["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == f"{component}-tls"
    args = frontend["spec"]["containers"][0]["args"]
    assert args[args.index("--tls-dir") + 1] == TLS_MOUNT
    # the running pod holds exactly the operator's certificate
    pod = frontend_pod(ns, name, k)["metadata"]["name"]
    mounted = exec_python(ns, pod, "import sys; sys.stdout.write(open(sys.argv[1]).read())", f"{TLS_MOUNT}/tls.crt")
    assert mounted.stdout.encode() == secret_data(ns, f"{component}-tls")["tls.crt"], mounted.stderr
    # and answers through stages that let in nothing but this mesh's certificates (previous test)
    with port_forward(ns, f"svc/{name}-frontend", shared_mesh["doc"]["spec"]["frontend"]["service"]["port"]) as base:
        from openai import OpenAI

        client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=300, max_retries=0)
        assert greedy(client, PROMPTS[0], max_tokens=8)


# One renewal and its rollout, then one more back to the default lifetime. The scheduled renewal
# (two thirds into a lifetime, no event waking the operator) and its pod-template roll are proven
# against a real kube-apiserver in tests/operator/test_cluster_certificates.py; here the pods must
# really roll onto the new certificates in place and serve through them. (Two renewals took about
# 11 minutes of the suite on the 2-core CI machine.)
@pytest.mark.timeout(900)
def test_certificates_rotate_with_a_shortened_lifetime(settings: dict, shared_mesh: dict) -> None:
    ns, name = shared_mesh["namespace"], shared_mesh["name"]
    lifetime = 180  # seconds: the old certificates outlive the policy, so they are renewed at once
    wait_settled(ns, name, settings["timeout"])
    # A renewal rolls the pods in place: the certificate is no part of a pipeline's revision, so
    # the same pipeline (and its component names) serves throughout.
    k = ready_pipeline(ns, name)
    components = [f"{prefix(name, k)}-stage-0", f"{prefix(name, k)}-stage-1", f"{prefix(name, k)}-frontend"]
    before = {c: secret_data(ns, f"{c}-tls")["tls.crt"] for c in components}
    hashes = tls_hashes(ns, name)
    patch = {"spec": {"security": {"certificateLifetime": f"{lifetime}s"}}}
    kubectl("patch", "inferencemesh", name, "-n", ns, "--type=merge", "-p", json.dumps(patch))
    try:
        wait_for(lambda: all(secret_data(ns, f"{c}-tls")["tls.crt"] != before[c] for c in components),
                 lifetime, "the renewal")
        wait_for(lambda: all(tls_hashes(ns, name)[c] != hashes[c] for c in components), 60,
                 "the pod templates to roll onto the renewal")
        hashes = tls_hashes(ns, name)
        wait_ready(ns, name, settings["timeout"])
        assert ready_pipeline(ns, name) == k, "a certificate renewal started a new pipeline"
        # The mesh is Ready before its Deployments finish rolling, and under a 180 s lifetime the
        # certificates renew again every few minutes: the pod read is one of the template's current
        # roll, its certificate the Secret's current one, both read afresh each poll.
        assert wait_for(lambda: rolled_frontend_holds_its_certificate(ns, name, k, components[2]), 300,
                        "a frontend pod of the current template holding the current certificate")
        with port_forward(ns, f"svc/{name}-frontend",
                          shared_mesh["doc"]["spec"]["frontend"]["service"]["port"]) as base:
            from openai import OpenAI

            client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=300, max_retries=3)
            assert greedy(client, PROMPTS[0], max_tokens=8)
    finally:
        # back to the default lifetime: one more renewal and rollout, then the shared mesh is as it was.
        # Waited for by the certificates' own validity: a scheduled renewal under the short lifetime
        # also changes the hashes, and the later tests must not meet a roll.
        kubectl("patch", "inferencemesh", name, "-n", ns, "--type=json",
                "-p", '[{"op": "remove", "path": "/spec/security/certificateLifetime"}]')
        wait_for(lambda: all(validity(secret_data(ns, f"{c}-tls")["tls.crt"]) > 10 * lifetime for c in components),
                 300, "the default lifetime's certificates")
        wait_for(lambda: all(tls_hashes(ns, name)[c] != hashes[c] for c in components), 60,
                 "the pod templates to roll onto them")
        wait_ready(ns, name, settings["timeout"])


def rolled_frontend_holds_its_certificate(ns: str, name: str, pipeline: int, component: str) -> str | None:
    """A running frontend pod of `pipeline` whose template is the Deployment's current one and whose
    mounted certificate is the Secret's current one (its name), or None."""
    current = tls_hashes(ns, name)[component]
    for pod in running_pods(ns, f"{LABEL_MESH}={name},{LABEL_COMPONENT}=frontend,{LABEL_PIPELINE}={pipeline}"):
        if (pod["metadata"].get("annotations") or {}).get(TLS_HASH) != current:
            continue
        mounted = exec_python(ns, pod["metadata"]["name"], "import sys; sys.stdout.write(open(sys.argv[1]).read())",
                              f"{TLS_MOUNT}/tls.crt")
        if mounted.returncode == 0 and mounted.stdout.encode() == secret_data(ns, f"{component}-tls")["tls.crt"]:
            return str(pod["metadata"]["name"])
    return None


def validity(cert_pem: bytes) -> float:
    """Seconds from a certificate's notBefore to its notAfter."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cert_pem)
    return (cert.not_valid_after_utc - cert.not_valid_before_utc).total_seconds()
