"""Fixtures for the operator tests; the machinery is in imesh_k8s.py. Cluster fixtures are session-scoped:
one control plane, one chart install, one operator process for the whole run."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from imesh_k8s import (
    CHART,
    OPERATOR_NAMESPACE,
    RELEASE,
    ControlPlane,
    OperatorProcess,
    helm_install,
    make_tiny_llama,
    start_control_plane,
    start_operator,
    stop_operator,
    stop_processes,
    wait_for,
)

from inferencemesh.bundled import DEFAULT_MODEL, bundled_path


@pytest.fixture(scope="session")
def make_model() -> Callable[..., Path]:
    return make_tiny_llama


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def bundled_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stand-in for the installed package's bundled/ with a tiny imesh-code-target, used only while
    the real bundled model is absent (the operator looks in $INFERENCEMESH_BUNDLED_DIR first only
    if the name exists there, so a real bundled model always wins when this is empty)."""
    root = tmp_path_factory.mktemp("bundled")
    try:
        bundled_path(DEFAULT_MODEL)
    except FileNotFoundError:
        make_tiny_llama(root / "imesh-code-target", layers=6, package_draft="../imesh-code-draft")
    return root


@pytest.fixture(scope="session")
def cluster() -> Iterator[ControlPlane]:
    workdir = Path(tempfile.mkdtemp(prefix="imesh-k8s-"))
    cp = start_control_plane(workdir)
    old = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(cp.kubeconfig)
    try:
        yield cp
    finally:
        if old is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = old
        stop_processes(cp.procs)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def chart_release(cluster: ControlPlane) -> dict:
    """`helm install` of charts/inferencemesh (CRD, RBAC, operator Deployment) via the Helm Go SDK."""
    import helm_python as helm

    cluster.kubectl("create", "namespace", OPERATOR_NAMESPACE)
    with helm.Config(kubeconfig_path=str(cluster.kubeconfig), namespace=OPERATOR_NAMESPACE) as cfg:
        release = helm_install(cfg, CHART, RELEASE, {}, OPERATOR_NAMESPACE)
    wait_for(lambda: cluster.kubectl("get", "crd", "inferencemeshes.inferencemesh.io", check=False).returncode == 0,
             30, "the CRD from the chart")
    cluster.kubectl("wait", "--for=condition=Established", "crd/inferencemeshes.inferencemesh.io", "--timeout=60s")
    return release


@pytest.fixture(scope="session")
def operator_kubeconfig(cluster: ControlPlane, chart_release: dict) -> Path:
    """Credentials of the chart's ServiceAccount: the operator runs with exactly the chart's RBAC."""
    sa = cluster.get_json("serviceaccount", "-n", OPERATOR_NAMESPACE, "-l", "app.kubernetes.io/component=operator")
    name = sa["items"][0]["metadata"]["name"]
    token = cluster.kubectl("create", "token", name, "-n", OPERATOR_NAMESPACE, "--duration=2h").stdout.strip()
    return cluster.write_kubeconfig(cluster.workdir / "operator.kubeconfig", token, name)


@pytest.fixture(scope="session")
def operator(cluster: ControlPlane, operator_kubeconfig: Path, bundled_dir: Path) -> Iterator[OperatorProcess]:
    op = start_operator(cluster, operator_kubeconfig, cluster.workdir, {"INFERENCEMESH_BUNDLED_DIR": str(bundled_dir)})
    try:
        yield op
    finally:
        stop_operator(op)
        print("---- operator log (tail) ----\n" + op.log(40))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failed test that ran with the operator gets the operator's log in its report: the log
    lives in the control plane's temporary directory, which is gone when the session ends."""
    outcome = yield
    report = outcome.get_result()
    op = getattr(item, "funcargs", {}).get("operator")
    if report.failed and report.when == "call" and isinstance(op, OperatorProcess):
        report.sections.append(("operator log (tail)", op.log(80)))
