"""The mesh's own certificates against a real kube-apiserver + controllers, with the operator running
under the chart's RBAC (see conftest.py): Secrets issued and owned, pods mounting them, renewal when
the lifetime is shortened, bring-your-own winning, garbage collection."""

from __future__ import annotations

import base64
import datetime
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.verification import PolicyBuilder, Store
from imesh_k8s import ControlPlane, OperatorProcess, wait_for

from inferencemesh.certificates import expires_at

pytestmark = [pytest.mark.k8s, pytest.mark.slow]
NS = "mesh-certs"
NAME = "sec"
COMPONENTS = ("sec-p0-stage-0", "sec-p0-stage-1", "sec-p0-frontend")


@pytest.fixture(scope="module")
def ns(cluster: ControlPlane, operator: OperatorProcess) -> str:
    cluster.kubectl("create", "namespace", NS)
    return NS


def secrets(cluster: ControlPlane) -> dict[str, dict]:
    items = cluster.get_json("secrets", "-n", NS, "-l", f"inferencemesh.io/mesh={NAME}")["items"]
    return {s["metadata"]["name"]: s for s in items}


def decoded(secret: dict) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in secret["data"].items()}


def template(cluster: ControlPlane, deployment: str) -> dict:
    return cluster.get_json("deployment", deployment, "-n", NS)["spec"]["template"]


def tls_hash(cluster: ControlPlane, deployment: str) -> str:
    return template(cluster, deployment)["metadata"]["annotations"]["inferencemesh.io/tls-hash"]


def test_the_operator_issues_owned_certificates_that_the_pods_mount(cluster: ControlPlane, ns: str,
                                                                    tiny_model: Path) -> None:
    cluster.apply({"apiVersion": "inferencemesh.io/v1alpha1", "kind": "InferenceMesh", "metadata": {"name": NAME},
                   "spec": {"model": {"name": str(tiny_model)}, "stages": {"count": 2}}}, ns)
    wanted = {"sec-ca", *(f"{c}-tls" for c in COMPONENTS)}
    found = wait_for(lambda: (s := secrets(cluster)) and set(s) == wanted and s, 60, "the mesh's Secrets")
    uid = cluster.get_json("inferencemesh", NAME, "-n", ns)["metadata"]["uid"]
    for secret in found.values():  # type: ignore[union-attr]
        (ref,) = secret["metadata"]["ownerReferences"]
        assert ref["uid"] == uid and ref["kind"] == "InferenceMesh" and ref["controller"]
    ca = decoded(found["sec-ca"])  # type: ignore[index]
    for component in COMPONENTS:
        leaf = decoded(found[f"{component}-tls"])  # type: ignore[index]
        assert found[f"{component}-tls"]["type"] == "kubernetes.io/tls"  # type: ignore[index]
        assert leaf["ca.crt"] == ca["ca.crt"]  # every pod trusts the mesh's CA, and only it
        verifier = PolicyBuilder().store(Store(x509.load_pem_x509_certificates(leaf["ca.crt"]))) \
            .build_server_verifier(x509.DNSName(f"{component}.{ns}.svc"))
        verifier.verify(x509.load_pem_x509_certificate(leaf["tls.crt"]), [])

    # the pods (made by the real ReplicaSet controller) mount their own component's Secret and pass --tls-dir
    def pods_of(component: str) -> list[dict]:
        return [p for p in cluster.get_json("pods", "-n", ns, "-l", f"inferencemesh.io/mesh={NAME}")["items"]
                if p["metadata"]["name"].startswith(component + "-")]

    for component in COMPONENTS:
        pods = wait_for(lambda c=component: pods_of(c), 60, f"a pod of {component}")
        pod = pods[0]  # type: ignore[index]
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == f"{component}-tls"
        args = pod["spec"]["containers"][0]["args"]
        assert args[args.index("--tls-dir") + 1] == "/etc/inferencemesh/tls"
        assert pod["metadata"]["annotations"]["inferencemesh.io/tls-hash"]


def test_a_shortened_lifetime_renews_the_certificates_and_rolls_the_pods(cluster: ControlPlane, ns: str) -> None:
    before = {name: decoded(s) for name, s in secrets(cluster).items()}
    hashes = {c: tls_hash(cluster, c) for c in COMPONENTS}
    cluster.kubectl("patch", "inferencemesh", NAME, "-n", ns, "--type=merge",
                    "-p", '{"spec":{"security":{"certificateLifetime":"60s"}}}')

    def renewed(since: dict[str, dict[str, bytes]]) -> dict[str, dict[str, bytes]] | bool:
        now = {name: decoded(s) for name, s in secrets(cluster).items()}
        done = all(now[f"{c}-tls"]["tls.crt"] != since[f"{c}-tls"]["tls.crt"] for c in COMPONENTS)
        return now if done else False

    first = wait_for(lambda: renewed(before), 60, "certificates reissued for the 60s lifetime")
    moment = datetime.datetime.now(datetime.UTC)
    for c in COMPONENTS:
        assert expires_at(first[f"{c}-tls"]["tls.crt"]) - moment <= datetime.timedelta(seconds=60)  # type: ignore[index]
    wait_for(lambda: all(tls_hash(cluster, c) != hashes[c] for c in COMPONENTS), 60, "the pod templates to roll")
    # no event wakes the operator now: it comes back by itself at two thirds of the lifetime (40 s)
    wait_for(lambda: renewed(first), 90, "a second renewal, two thirds into the 60s lifetime", 2)  # type: ignore[arg-type]


def mounted(cluster: ControlPlane) -> dict[str, str]:
    """Each of the mesh's Deployments whose pods mount a TLS Secret, with that Secret."""
    deps = cluster.get_json("deployments", "-n", NS, "-l", f"inferencemesh.io/mesh={NAME}")["items"]
    return {d["metadata"]["name"]: v["secret"]["secretName"] for d in deps
            for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"}


def test_bring_your_own_secret_wins(cluster: ControlPlane, ns: str) -> None:
    # other Secrets are another revision of the pipeline: it is replaced (its pods never got ready here)
    cluster.kubectl("patch", "inferencemesh", NAME, "-n", ns, "--type=merge",
                    "-p", '{"spec":{"security":{"mtlsSecretName":"mine"}}}')
    wait_for(lambda: not secrets(cluster), 60, "the operator's Secrets to go")
    wait_for(lambda: (m := mounted(cluster)) and len(m) == 3 and set(m.values()) == {"mine"}, 60,
             "a pipeline mounting the user's Secret, and only that")
    cluster.kubectl("patch", "inferencemesh", NAME, "-n", ns, "--type=json",
                    "-p", '[{"op": "remove", "path": "/spec/security/mtlsSecretName"}]')
    wait_for(lambda: len(secrets(cluster)) == 4, 60, "the operator's Secrets back")
    wait_for(lambda: (m := mounted(cluster)) and len(m) == 3 and all(s == f"{d}-tls" for d, s in m.items()), 60,
             "each pod mounting its own Secret again")


def test_deleting_the_mesh_collects_its_secrets(cluster: ControlPlane, ns: str) -> None:
    cluster.kubectl("delete", "inferencemesh", NAME, "-n", ns, "--wait=false")
    # the garbage collector's first sweep after a new CRD can take ~30 s
    wait_for(lambda: not secrets(cluster), 150, "the mesh's Secrets to be collected", 2)
