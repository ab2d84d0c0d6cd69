"""Helpers for the operator tests: tiny checkpoints, a real control plane, the operator process.

The control plane is BRIEF §5 steps 1-5: etcd + kube-apiserver (RBAC, a static admin token,
service-account keys) + kube-controller-manager (garbage collector, Deployment and ReplicaSet
controllers) on free loopback ports. There is no scheduler and no node: pods stay Pending, and
tests play kubelet by patching pod status (pod_status, Kubelet). Binaries come from `bash tools/k8s/ensure_binaries.sh`;
without them the cluster tests fail (never skip) and say so.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import save_file

REPO = Path(__file__).resolve().parents[2]
K8S_BIN = Path(os.environ.get("IMESH_K8S_BIN", "/var/cache/inferencemesh/k8s/bin"))
CHART = REPO / "charts" / "inferencemesh"
OPERATOR_NAMESPACE = "imesh-system"
RELEASE = "imesh"


def make_tiny_llama(path: Path, *, layers: int = 4, hidden: int = 64, vocab: int = 256, intermediate: int = 128,
                    heads: int = 4, kv_heads: int = 2, package_draft: str | None = None) -> Path:
    """A Llama-shaped safetensors checkpoint (zeros): enough for config + header based planning."""
    path.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": layers,
        "hidden_size": hidden, "intermediate_size": intermediate, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config))
    f32 = np.float32
    tensors = {"model.embed_tokens.weight": np.zeros((vocab, hidden), f32),
               "model.norm.weight": np.zeros((hidden,), f32),
               "lm_head.weight": np.zeros((vocab, hidden), f32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": np.zeros((heads * head_dim, hidden), f32),
            p + "self_attn.k_proj.weight": np.zeros((kv_heads * head_dim, hidden), f32),
            p + "self_attn.v_proj.weight": np.zeros((kv_heads * head_dim, hidden), f32),
            p + "self_attn.o_proj.weight": np.zeros((hidden, heads * head_dim), f32),
            p + "mlp.gate_proj.weight": np.zeros((intermediate, hidden), f32),
            p + "mlp.up_proj.weight": np.zeros((intermediate, hidden), f32),
            p + "mlp.down_proj.weight": np.zeros((hidden, intermediate), f32),
            p + "input_layernorm.weight": np.zeros((hidden,), f32),
            p + "post_attention_layernorm.weight": np.zeros((hidden,), f32),
        }
    save_file(tensors, str(path / "model.safetensors"))
    if package_draft:
        package = {"name": path.name, "generation": {"speculative_decoding": {
            "default": "tiny-draft",
            "strategies": {"tiny-draft": {"type": "draft-model", "draft_model": package_draft}}}}}
        (path / "model-package.json").write_text(json.dumps(package))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.5) -> object:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except Exception as exc:  # noqa: BLE001 - keep polling, report the last failure
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "<no log>"


@dataclass
class ControlPlane:
    workdir: Path
    server: str
    kubeconfig: Path
    procs: dict[str, subprocess.Popen]

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                kubeconfig: Path | None = None) -> subprocess.CompletedProcess:
        cmd = ["kubectl", "--kubeconfig", str(kubeconfig or self.kubeconfig), *args]
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=60)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr}")
        return proc

    def get_json(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def apply(self, obj: dict | str, namespace: str = "default") -> None:
        text = obj if isinstance(obj, str) else yaml.safe_dump(obj)
        self.kubectl("apply", "-n", namespace, "-f", "-", input=text)

    def log(self, name: str) -> str:
        return _tail(self.workdir / f"{name}.log")

    def write_kubeconfig(self, path: Path, token: str, user: str) -> Path:
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "local",
            "clusters": [{"name": "local", "cluster": {
                "server": self.server, "certificate-authority": str(self.workdir / "certs" / "apiserver.crt")}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "local", "context": {"cluster": "local", "user": user, "namespace": "default"}}],
        }))
        return path


def _binaries() -> dict[str, str]:
    found = {
        "etcd": shutil.which("etcd") or "",
        "kube-apiserver": str(K8S_BIN / "kube-apiserver") if (K8S_BIN / "kube-apiserver").exists() else "",
        "kube-controller-manager": (str(K8S_BIN / "kube-controller-manager")
                                    if (K8S_BIN / "kube-controller-manager").exists() else ""),
        "kubectl": shutil.which("kubectl") or "",
    }
    missing = [name for name, path in found.items() if not path]
    if missing:
        pytest.fail(
            f"the Kubernetes control-plane binaries are missing: {', '.join(missing)} "
            f"(looked in {K8S_BIN} and PATH). Build and cache them with: bash tools/k8s/ensure_binaries.sh",
            pytrace=False,
        )
    return found


def _start(name: str, cmd: list[str], workdir: Path) -> subprocess.Popen:
    log = open(workdir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_processes(procs: dict[str, subprocess.Popen]) -> None:
    for proc in reversed(list(procs.values())):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs.values():
        try:
            proc.wait(timeout=5)  # a throwaway control plane: no need for a graceful stop
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def start_control_plane(workdir: Path) -> ControlPlane:
    bins = _binaries()
    certs = workdir / "certs"
    certs.mkdir(parents=True)
    subprocess.run(["openssl", "genrsa", "-out", str(workdir / "sa.key"), "2048"], check=True, capture_output=True)
    subprocess.run(["openssl", "rsa", "-in", str(workdir / "sa.key"), "-pubout", "-out", str(workdir / "sa.pub")],
                   check=True, capture_output=True)
    token = os.urandom(16).hex()
    (workdir / "tokens.csv").write_text(f'{token},admin,admin,"system:masters"\n')
    etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["etcd"] = _start("etcd", [
            bins["etcd"], "--name", "default", "--data-dir", str(workdir / "etcd"),
            "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"default=http://127.0.0.1:{peer_port}",
            "--quota-backend-bytes", str(2 * 1024**3),
        ], workdir)
        procs["kube-apiserver"] = _start("kube-apiserver", [
            bins["kube-apiserver"], f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={api_port}",
            f"--cert-dir={certs}", f"--token-auth-file={workdir / 'tokens.csv'}",
            "--authorization-mode=RBAC", "--allow-privileged=true",
            f"--service-account-key-file={workdir / 'sa.pub'}",
            f"--service-account-signing-key-file={workdir / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--api-audiences=https://kubernetes.default.svc.cluster.local",
            "--service-cluster-ip-range=10.96.0.0/16", "--insecure-port=0",
        ], workdir)
        server = f"https://127.0.0.1:{api_port}"
        cp = ControlPlane(workdir, server, workdir / "admin.kubeconfig", procs)
        wait_for(lambda: (certs / "apiserver.crt").exists(), 60, "the apiserver's serving certificate")
        cp.write_kubeconfig(cp.kubeconfig, token, "admin")

        def api_ready() -> bool:
            if procs["kube-apiserver"].poll() is not None:
                raise AssertionError("kube-apiserver exited:\n" + cp.log("kube-apiserver"))
            return cp.kubectl("get", "--raw", "/readyz", check=False).returncode == 0

        wait_for(api_ready, 120, "kube-apiserver /readyz")
        procs["kube-controller-manager"] = _start("kube-controller-manager", [
            bins["kube-controller-manager"], f"--kubeconfig={cp.kubeconfig}", "--leader-elect=false",
            f"--service-account-private-key-file={workdir / 'sa.key'}", f"--root-ca-file={certs / 'apiserver.crt'}",
            "--use-service-account-credentials=false", "--port=0", "--secure-port=0",
            "--controllers=*,-nodeipam,-nodelifecycle,-cloud-node-lifecycle,-route,-service",
            "--concurrent-gc-syncs=5", "--namespace-sync-period=10s",
        ], workdir)
        wait_for(lambda: cp.kubectl("get", "serviceaccount", "default", check=False).returncode == 0,
                 120, "the default ServiceAccount (kube-controller-manager running)")
        return cp
    except BaseException:
        stop_processes(procs)
        raise


@dataclass
class OperatorProcess:
    proc: subprocess.Popen
    liveness: str
    metrics: str
    log_path: Path
    kubeconfig: Path

    def log(self, n: int = 60) -> str:
        return _tail(self.log_path, n)

    def metric(self, name: str, labels: str = "") -> float:
        """The sum of a Prometheus sample family, optionally only samples whose labels contain `labels`."""
        text = urllib.request.urlopen(self.metrics, timeout=5).read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and (line[len(name)] in " {") and labels in line:
                total += float(line.rsplit(" ", 1)[1])
        return total


def start_operator(cluster: ControlPlane, kubeconfig: Path, workdir: Path, env: dict[str, str],
                   namespaces: tuple[str, ...] = ()) -> OperatorProcess:
    live_port, metrics_port = free_port(), free_port()
    log_path = workdir / f"operator-{live_port}.log"
    cmd = [sys.executable, "-m", "inferencemesh", "operator", "--standalone",
           "--liveness", f"http://127.0.0.1:{live_port}/healthz", "--metrics-port", str(metrics_port)]
    for ns in namespaces:
        cmd += ["--namespace", ns]
    # As in its image (Dockerfile, target operator): no torch, no transformers. A sitecustomize
    # makes importing them fail, so a path of the operator that needs them fails here too.
    image_like = workdir / "operator-python"
    image_like.mkdir(exist_ok=True)
    (image_like / "sitecustomize.py").write_text(
        "import sys\nfor _name in ('torch', 'transformers'):\n    sys.modules[_name] = None  # not in the image\n")
    python_path = os.pathsep.join(p for p in (str(image_like), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {**os.environ, "KUBECONFIG": str(kubeconfig), "HF_HUB_OFFLINE": "1",
                "INFERENCEMESH_RESYNC_SECONDS": "30", "PYTHONPATH": python_path, **env}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    op = OperatorProcess(proc, f"http://127.0.0.1:{live_port}/healthz", f"http://127.0.0.1:{metrics_port}/metrics",
                         log_path, kubeconfig)

    def alive() -> bool:
        if proc.poll() is not None:
            raise AssertionError("the operator exited:\n" + op.log())
        return urllib.request.urlopen(op.liveness, timeout=2).status == 200

    try:
        wait_for(alive, 60, "the operator's liveness endpoint")
    except AssertionError as exc:
        stop_operator(op)
        raise AssertionError(f"{exc}\n---- operator log ----\n{op.log()}") from None
    return op


def stop_operator(op: OperatorProcess) -> None:
    if op.proc.poll() is None:
        os.killpg(op.proc.pid, signal.SIGTERM)
        try:
            op.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(op.proc.pid, signal.SIGKILL)
            op.proc.wait()


def helm_install(cfg: object, chart: Path, name: str, values: dict, namespace: str, *,
                 create_namespace: bool = False, timeout: int = 120) -> dict:
    """`helm install --server-side=false`: Helm 4 applies CRDs server-side by default, and API servers
    older than 1.25 (this one is 1.20) refuse the CRD's x-kubernetes-validations under server-side
    apply ("field not declared in schema") while a plain create just drops them. helm-python-sdk's
    Config.install has no keyword for it yet, so this passes the option to the same native call."""
    from helm_python import _native

    opts = {"namespace": namespace, "timeout_seconds": timeout, "server_side_apply": False}
    if create_namespace:
        opts["create_namespace"] = True
    payload = _native.call_string(
        "helm_install", cfg._raw(), _native.HANDLE(0), _native.HANDLE(0), str(chart), name,  # type: ignore[attr-defined]
        json.dumps(values), json.dumps(opts))
    return json.loads(payload)


# ---- playing kubelet ----------------------------------------------------------------------------

def _now() -> str:
    import datetime

    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod_status(pod: dict, *, ready: bool, waiting: str | None = None, restarts: int = 0,
               terminated_message: str | None = None, exit_code: int = 1) -> dict:
    """What a kubelet would report for the pod's single container; terminated_message: its last run
    ended with this termination message (as a crash loop's lastState.terminated)."""
    now = _now()
    container = pod["spec"]["containers"][0]["name"]
    state = {"waiting": {"reason": waiting}} if waiting else {"running": {"startedAt": now}}
    flag = "True" if ready else "False"
    status: dict = {"name": container, "ready": ready, "restartCount": restarts, "image": "img", "imageID": "",
                    "started": ready, "state": state}
    if terminated_message is not None:
        status["lastState"] = {"terminated": {"exitCode": exit_code, "reason": "Error", "message": terminated_message,
                                              "startedAt": now, "finishedAt": now}}
    return {"status": {
        "phase": "Running",
        "conditions": [{"type": t, "status": s, "lastTransitionTime": now} for t, s in
                       (("PodScheduled", "True"), ("Initialized", "True"), ("ContainersReady", flag), ("Ready", flag))],
        "containerStatuses": [status],
    }}


def patch_pod_status(cluster: ControlPlane, pod: dict, namespace: str, **kwargs: object) -> None:
    cluster.kubectl("patch", "pod", pod["metadata"]["name"], "-n", namespace, "--subresource=status", "--type=merge",
                    "-p", json.dumps(pod_status(pod, **kwargs)))  # type: ignore[arg-type]


def _is_ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


class Kubelet:
    """A stand-in for the kubelets of a namespace: every `interval` it reports each pod matching
    `selector` as running and ready, except pods being deleted and those whose name starts with a
    prefix in `hold` (a test reports those itself: a crash loop, a pipeline kept unready). Used as a
    context manager; a background thread."""

    def __init__(self, cluster: ControlPlane, namespace: str, selector: str, interval: float = 0.5) -> None:
        import threading

        self.cluster, self.namespace, self.selector, self.interval = cluster, namespace, selector, interval
        self.hold: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Kubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def tick(self) -> None:
        proc = self.cluster.kubectl("get", "pods", "-n", self.namespace, "-l", self.selector, "-o", "json",
                                    check=False)
        if proc.returncode != 0:
            return
        for pod in json.loads(proc.stdout)["items"]:
            name = pod["metadata"]["name"]
            if pod["metadata"].get("deletionTimestamp") or _is_ready(pod) or \
                    any(name.startswith(prefix) for prefix in set(self.hold)):
                continue
            self.cluster.kubectl("patch", "pod", name, "-n", self.namespace, "--subresource=status",
                                 "--type=merge", "-p", json.dumps(pod_status(pod, ready=True)), check=False)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # noqa: BLE001,S110 - a pod gone between list and patch: next tick
                pass
            self._stop.wait(self.interval)
