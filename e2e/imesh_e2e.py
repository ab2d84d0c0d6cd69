"""Small helpers for the e2e tests: kubectl, polling, ports, port-forwards, mesh manifests, a local
`inferencemesh serve` to compare with, and an OpenAI client pod inside the cluster."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import yaml

from inferencemesh.programs.stage import GRACEFUL_STOP_S

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "inferencemesh.yaml"
MODEL = "imesh-code-target"
LABEL_MESH = "inferencemesh.io/mesh"
LABEL_PIPELINE = "inferencemesh.io/pipeline"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_STAGE = "inferencemesh.io/stage"
FRONTEND_PORT = 8000  # the frontend's and the router's container port
# Every kind of child a mesh has (its router brings a ServiceAccount, a Role and a RoleBinding;
# the router and the pipelines have disruption budgets), for `kubectl get` and as kinds.
CHILD_KINDS = ("deployments,replicasets,pods,services,configmaps,networkpolicies,secrets,serviceaccounts,roles,"
               "rolebindings,poddisruptionbudgets")
CHILD_KIND_NAMES = {"Deployment", "ReplicaSet", "Pod", "Service", "ConfigMap", "NetworkPolicy", "Secret",
                    "ServiceAccount", "Role", "RoleBinding", "PodDisruptionBudget"}
# Greedy prompts for the exactness checks: code, prose-ish, a repetitive one (n-gram friendly).
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main():", "for i in range(10):\n    print(i)\n"]
# A greedy stream long enough that a stage deleted at its 4th token is lost mid-stream, not after the
# stream ended within the stage's graceful stop (GRACEFUL_STOP_S): 1000 tokens of PROMPTS[0] take
# about 5 s at 2 stages on an idle 2-core machine (256 ended within the grace on CI once), and a
# replay after a stage lost mid-way equals the undisturbed stream (checked locally, SIGKILL at 600 and 1000).
OUTLASTING_TOKENS = 1000


def not_recovered(logs: str, undisturbed_s: float) -> str:
    """What a test says when the frontend's log shows no replay: the log's tail, and whether the stream
    may simply have ended within the stage's graceful stop."""
    return (f"no replay in the frontend's log; the undisturbed stream took {undisturbed_s:.1f}s against a "
            f"{GRACEFUL_STOP_S:.0f}s graceful stop of the deleted stage:\n{logs[-2000:]}")


def kubectl(*args: str, input: str | None = None, check: bool = True, timeout: float = 120) -> str:
    proc = subprocess.run(["kubectl", *args], input=input, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed: {proc.stderr}")
    return proc.stdout


def get_json(*args: str) -> dict:
    return json.loads(kubectl("get", *args, "-o", "json"))


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 2.0) -> object:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except Exception as exc:  # noqa: BLE001 - keep polling
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float, what: str) -> None:
    def accepting() -> bool:
        with socket.socket() as s:
            s.settimeout(1)
            return s.connect_ex(("127.0.0.1", port)) == 0
    wait_for(accepting, timeout, what, 0.5)


# ---- the mesh resource ---------------------------------------------------------------------

def mesh_doc(settings: dict, name: str | None = None, *, small: bool = False) -> dict:
    """examples/inferencemesh.yaml with the images (and pull policy) e2e was given.

    small: CPU requests of 100m instead of the example's 500m, so a 2-core test node also fits the
    mesh beside another mesh, and a re-plan's surge: a new revision starts a whole new pipeline
    beside the old one (spec.rollout.maxSurge 1), twice the pods for a while (the example's requests
    fill such a node). The example runs spec.replicas 1 (one pipeline); the router needs no request."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    if name:
        doc["metadata"]["name"] = name
    images = doc["spec"].setdefault("images", {})
    if settings["stage_image"]:
        images["stage"] = settings["stage_image"]
    if settings["frontend_image"]:
        images["frontend"] = settings["frontend_image"]
    if settings["pull_policy"]:
        images["pullPolicy"] = settings["pull_policy"]
    if small:
        for part in ("stages", "frontend"):
            doc["spec"][part].setdefault("resources", {}).setdefault("requests", {})["cpu"] = "100m"
    return doc


def apply(ns: str, doc: dict) -> None:
    kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))


def mesh(ns: str, name: str) -> dict:
    return get_json("inferencemesh", name, "-n", ns)


def conditions(ns: str, name: str) -> dict[str, dict]:
    status = mesh(ns, name).get("status") or {}
    return {c["type"]: c for c in status.get("conditions", [])}


def is_ready(ns: str, name: str) -> bool:
    obj = mesh(ns, name)
    status = obj.get("status") or {}
    conds = {c["type"]: c for c in status.get("conditions", [])}
    return (conds.get("Ready", {}).get("status") == "True"
            and status.get("observedGeneration") == obj["metadata"]["generation"])


def wait_ready(ns: str, name: str, timeout: float) -> dict:
    wait_for(lambda: is_ready(ns, name), timeout, f"InferenceMesh {ns}/{name} to be Ready", 3)
    return mesh(ns, name)


def pod_ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions", []))


def pipelines(ns: str, name: str) -> list[dict]:
    """status.pipelines: one entry per pipeline (index, name, revision, state, ready, message, restarts)."""
    return (mesh(ns, name).get("status") or {}).get("pipelines") or []


def settled(ns: str, name: str) -> bool:
    """Ready, with exactly spec.replicas pipelines, each Ready, and no pod left of any other pipeline
    (a re-plan's old pipeline drains after the new one is Ready: Ready alone does not wait for that);
    every pod of the mesh ready and none terminating."""
    obj = mesh(ns, name)
    status = obj.get("status") or {}
    conds = {c["type"]: c for c in status.get("conditions", [])}
    if (conds.get("Ready", {}).get("status") != "True"
            or status.get("observedGeneration") != obj["metadata"]["generation"]):
        return False
    entries = status.get("pipelines") or []
    if len(entries) != obj["spec"].get("replicas", 1) or any(e.get("state") != "Ready" for e in entries):
        return False
    indexes = {str(e["index"]) for e in entries}
    for pod in pods(ns, f"{LABEL_MESH}={name}"):
        labels = pod["metadata"].get("labels") or {}
        if pod["metadata"].get("deletionTimestamp") or not pod_ready(pod):
            return False
        if labels.get(LABEL_COMPONENT) in ("stage", "frontend") and labels.get(LABEL_PIPELINE) not in indexes:
            return False
    return True


def wait_settled(ns: str, name: str, timeout: float) -> dict:
    """wait_ready, and the pipelines settled (settled()): what a test that changed the mesh waits for."""
    wait_for(lambda: settled(ns, name), timeout,
             f"InferenceMesh {ns}/{name} to be Ready with spec.replicas Ready pipelines and no other pods", 3)
    return mesh(ns, name)


def ready_pipeline(ns: str, name: str) -> int:
    """The index of the mesh's Ready pipeline (the lowest, when several are)."""
    ready = sorted(e["index"] for e in pipelines(ns, name) if e.get("state") == "Ready")
    assert ready, f"no Ready pipeline in {ns}/{name}: {pipelines(ns, name)}"
    return ready[0]


def prefix(name: str, pipeline: int) -> str:
    """Pipeline `pipeline`'s object-name prefix: <name>-p<k> (<name>-p<k>-stage-<i>, <name>-p<k>-frontend)."""
    return f"{name}-p{pipeline}"


def pods(ns: str, selector: str) -> list[dict]:
    return get_json("pods", "-n", ns, "-l", selector)["items"]


def running_pods(ns: str, selector: str) -> list[dict]:
    return [p for p in pods(ns, selector) if not p["metadata"].get("deletionTimestamp")]


def stage_pod(ns: str, base: str, index: int, pipeline: int | None = None) -> dict:
    """Stage `index`'s pod of `pipeline` (default: the mesh's Ready pipeline, from its status)."""
    k = ready_pipeline(ns, base) if pipeline is None else pipeline
    (pod,) = running_pods(ns, f"{LABEL_MESH}={base},{LABEL_COMPONENT}=stage,{LABEL_PIPELINE}={k},{LABEL_STAGE}={index}")
    return pod


def frontend_pod(ns: str, base: str, pipeline: int | None = None) -> dict:
    """The frontend pod of `pipeline` (default: the mesh's Ready pipeline), a ready one first."""
    k = ready_pipeline(ns, base) if pipeline is None else pipeline
    found = running_pods(ns, f"{LABEL_MESH}={base},{LABEL_COMPONENT}=frontend,{LABEL_PIPELINE}={k}")
    assert found, f"no frontend pod of pipeline {k} of {ns}/{base}"
    return sorted(found, key=lambda p: not pod_ready(p))[0]


def router_pod(ns: str, base: str) -> dict:
    found = running_pods(ns, f"{LABEL_MESH}={base},{LABEL_COMPONENT}=router")
    assert found, f"no router pod of {ns}/{base}"
    return sorted(found, key=lambda p: not pod_ready(p))[0]


# ---- probes and the node ------------------------------------------------------------------

def probe_failures(ns: str, selector: str) -> dict[str, dict[str, int]]:
    """Failed kubelet probes per pod of `selector`, by probe ("Readiness", "Liveness", "Startup"),
    from the kubelet's Unhealthy events (their count: repeats are folded into one event). With the
    pods' age and each probe's period, the false-negative rate of a healthy pod's probe."""
    found: dict[str, dict[str, int]] = {p["metadata"]["name"]: {} for p in pods(ns, selector)}
    for event in get_json("events", "-n", ns, "--field-selector", "reason=Unhealthy")["items"]:
        counts = found.get(event["involvedObject"]["name"])
        if counts is None:
            continue
        probe = (event.get("message") or "").split(" ", 1)[0]  # "Readiness probe failed: ..."
        counts[probe] = counts.get(probe, 0) + int(event.get("count") or 1)
    return found


# Inside the pod, as the kubelet asks: a connection and one GET per probe, whatever the answer.
PROBE_TIMING = r"""
import sys, time, urllib.error, urllib.request
url, n, took = sys.argv[1], int(sys.argv[2]), []
for _ in range(n):
    start = time.perf_counter()
    try:
        urllib.request.urlopen(url, timeout=10).read()
    except urllib.error.HTTPError:
        pass
    took.append(time.perf_counter() - start)
print(" ".join(f"{t:.6f}" for t in took))
"""


def probe_seconds(ns: str, pod: str, path: str = "/ready", port: int = 9090, n: int = 20) -> list[float]:
    """What one probe of `pod` costs (a stage's probes: its HTTP port 9090), asked n times from
    inside the pod; seconds each."""
    proc = exec_python(ns, pod, PROBE_TIMING, f"http://127.0.0.1:{port}{path}", str(n), timeout=60 + 10 * n)
    assert proc.returncode == 0, proc.stderr
    return [float(t) for t in proc.stdout.split()]


def sigkill_container(containerd_address: str, pod: dict) -> None:
    """SIGKILL the pod's (only) container through the node's containerd, as a crash would end it:
    no SIGTERM, no preStop hook, no grace; the kubelet then restarts it in the same pod. Needs the
    tests to run on the node (IMESH_E2E_CONTAINERD_ADDRESS, which tools/cluster/up.sh sets)."""
    (status,) = pod["status"]["containerStatuses"]
    subprocess.run(["ctr", "--address", containerd_address, "-n", "k8s.io", "tasks", "kill", "-s", "SIGKILL",
                    status["containerID"].split("://", 1)[1]], check=True, capture_output=True, timeout=30)


def cluster_routes_missing() -> list[str]:
    """The cluster ranges (tools/cluster/lib.sh) that lack their unreachable route on this machine:
    [] while a cluster tools/cluster/up.sh brought up runs; both after tools/cluster/down.sh."""
    script = f"source {REPO / 'tools' / 'cluster' / 'lib.sh'} && missing_unreachable_routes"
    env = {**os.environ, "IMESH_CLUSTER_SNAPSHOTTER": os.environ.get("IMESH_CLUSTER_SNAPSHOTTER", "native")}
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30, env=env, check=True)
    return proc.stdout.split()


def router_replicas(base_url: str) -> dict[str, dict]:
    """The router's GET /router/replicas (through the endpoint Service): replica name -> its entry
    (name: the frontend Deployment's, e.g. <mesh>-p0-frontend)."""
    with urllib.request.urlopen(f"{base_url}/router/replicas", timeout=30) as reply:
        return {r["name"]: r for r in json.load(reply)["replicas"]}


def wait_router_replicas(base_url: str, count: int, timeout: float = 60) -> dict[str, dict]:
    """Until the router routes to exactly `count` replicas (it follows the frontends' readiness
    through EndpointSlices, a moment after the mesh's status does)."""
    found = wait_for(lambda: (r := router_replicas(base_url)) and len(r) == count and r, timeout,
                     f"the router to know {count} replicas")
    return found  # type: ignore[return-value]


def wait_router_scorer(base_url: str, scorer: str = "blocks", timeout: float = 120) -> None:
    """Until the router scores prompts by `scorer` (GET /router/replicas): it routes by characters
    until it has loaded the tokenizer the replicas name, and a request routed then records no
    blocks for the next."""
    def current() -> str:
        with urllib.request.urlopen(f"{base_url}/router/replicas", timeout=30) as reply:
            return str(json.load(reply).get("scorer"))

    wait_for(lambda: current() == scorer, timeout, f"the router to score by {scorer}")


def delete_mesh(ns: str, name: str) -> None:
    kubectl("delete", "inferencemesh", name, "-n", ns, "--ignore-not-found", "--wait=true", "--timeout=120s",
            check=False)


# ---- reaching services ---------------------------------------------------------------------

@contextlib.contextmanager
def port_forward(ns: str, target: str, remote_port: int) -> Iterator[str]:
    """`kubectl port-forward` to TARGET (svc/NAME or pod/NAME); yields http://127.0.0.1:PORT."""
    port = free_port()
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(["kubectl", "port-forward", "-n", ns, target, f"{port}:{remote_port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        try:
            wait_port(port, 30, f"kubectl port-forward {target}")
        except AssertionError as err:
            log.seek(0)
            raise AssertionError(f"port-forward {target} did not open: {log.read().decode(errors='replace')}") from err
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def pod_http(ns: str, pod: str, port: int, path: str) -> str:
    """GET http://POD:PORT/PATH through the API server's pod proxy."""
    return kubectl("get", "--raw", f"/api/v1/namespaces/{ns}/pods/{pod}:{port}/proxy/{path.lstrip('/')}")


def exec_python(ns: str, pod: str, code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["kubectl", "exec", "-n", ns, pod, "--", "python", "-c", code, *args],
                          capture_output=True, text=True, timeout=timeout)


# A client inside the cluster, standard library only (the images carry no `openai` package):
# /v1/models, a completion, a chat completion and a streamed chat completion against the
# frontend's Service DNS name. Prints one JSON document.
CLIENT_SCRIPT = r"""
import json, sys, urllib.request
base, model = sys.argv[1], sys.argv[2]
def post(path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=180)
out = {"models": json.load(urllib.request.urlopen(base + "/models", timeout=60))}
out["completion"] = json.load(post("/completions", {"model": model, "prompt": "def add(a, b):",
                                                     "max_tokens": 16, "temperature": 0}))
chat = {"model": model, "max_tokens": 16, "temperature": 0,
        "messages": [{"role": "user", "content": "Write a Python loop."}]}
out["chat"] = json.load(post("/chat/completions", chat))
chunks = []
with post("/chat/completions", dict(chat, stream=True)) as reply:
    for raw in reply:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[len("data: "):]))
        elif line == "data: [DONE]":
            out["done"] = True
out["stream"] = chunks
print(json.dumps(out))
"""


def run_client_pod(ns: str, name: str, image: str, pull_policy: str, url: str, timeout: float = 300, *,
                   command: list[str] | None = None) -> dict:
    """Run CLIENT_SCRIPT (or `command`, which prints one JSON line last) in a pod of its own (not
    part of the mesh); return its JSON output."""
    command = command or ["python", "-c", CLIENT_SCRIPT, url, MODEL]
    container = {"name": "client", "image": image, "command": command,
                 "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}
    if pull_policy:
        container["imagePullPolicy"] = pull_policy
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": "imesh-e2e-client"}},
           "spec": {"restartPolicy": "Never", "containers": [container],
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 10001}}}
    kubectl("delete", "pod", name, "-n", ns, "--ignore-not-found", "--wait=true")
    apply(ns, pod)
    try:
        phase = wait_for(lambda: get_json("pod", name, "-n", ns)["status"].get("phase") in ("Succeeded", "Failed")
                         and get_json("pod", name, "-n", ns)["status"]["phase"], timeout, f"client pod {name}")
        logs = kubectl("logs", "-n", ns, name)
        assert phase == "Succeeded", f"client pod {phase}:\n{logs}"
        return json.loads(logs.strip().splitlines()[-1])
    finally:
        kubectl("delete", "pod", name, "-n", ns, "--ignore-not-found", "--wait=false", check=False)


# ---- the local reference -------------------------------------------------------------------

@contextlib.contextmanager
def local_serve(dtype: str, stages: int = 2, timeout: float = 300, model: str | None = None) -> Iterator[str]:
    """`inferencemesh serve` of the bundled model (or `model`) on loopback; yields its /v1 base URL."""
    port, stage_port = free_port(), free_port()
    log = tempfile.NamedTemporaryFile(prefix="imesh-e2e-serve-", suffix=".log", delete=False)
    exe = shutil.which("inferencemesh")
    cmd = [exe] if exe else [sys.executable, "-m", "inferencemesh"]
    cmd += ["serve", "--stages", str(stages), "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
            "--base-stage-port", str(stage_port), *(["--model", model] if model else [])]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"inferencemesh serve exited {proc.returncode}: {Path(log.name).read_text()[-3000:]}")
        try:
            return urllib.request.urlopen(base + "/ready", timeout=5).status == 200
        except OSError:
            return False

    try:
        wait_for(ready, timeout, "local inferencemesh serve to be ready", 1)
        yield base + "/v1"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # its own session: the launcher and its stages
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
        os.unlink(log.name)


def greedy(client, prompt: str, max_tokens: int = 48) -> str:  # noqa: ANN001 - an openai.OpenAI
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return reply.choices[0].text


# ---- watching a mesh while something happens -----------------------------------------------

class ReadyRecorder:
    """Polls a selector's pods in a thread: every change of a pod's Ready condition (a pod being
    deleted aside) and the container restarts since the first poll, per pod."""

    def __init__(self, ns: str, selector: str, interval: float = 3.0) -> None:
        self.ns, self.selector, self.interval = ns, selector, interval
        self.flips: list[tuple[float, str, bool]] = []  # (monotonic time, pod, Ready now)
        self.restarts: dict[str, int] = {}
        self.polls = 0
        self._ready: dict[str, bool] = {}
        self._first_restarts: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                for pod in pods(self.ns, self.selector):
                    if pod["metadata"].get("deletionTimestamp"):
                        continue
                    name, ready = pod["metadata"]["name"], pod_ready(pod)
                    if name in self._ready and self._ready[name] != ready:
                        self.flips.append((time.monotonic(), name, ready))
                    self._ready[name] = ready
                    restarts = sum(c.get("restartCount", 0) for c in pod["status"].get("containerStatuses", []))
                    self._first_restarts.setdefault(name, restarts)
                    self.restarts[name] = restarts - self._first_restarts[name]
                self.polls += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> ReadyRecorder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


class MeshWatch:
    """Every version of a mesh the API server serves, from `kubectl get --watch` in a thread, each
    given to on_version (polling at an interval missed a condition that lasted less than it: a stage
    SIGKILLed and back within a poll). A watch the server ends is started again."""

    def __init__(self, ns: str, name: str, on_version: Callable[[dict], None]) -> None:
        self.ns, self.name, self.on_version = ns, name, on_version
        self._stop = threading.Event()
        self._proc: subprocess.Popen | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._proc = subprocess.Popen(["kubectl", "get", "inferencemesh", self.name, "-n", self.ns, "-o", "json",
                                           "--watch"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            assert self._proc.stdout is not None
            if self._stop.is_set():  # __exit__ came before this watch started: it read no process to end
                self._proc.terminate()
            lines: list[str] = []
            for line in self._proc.stdout:  # pretty JSON objects, one after another: each ends in "}" at column 0
                lines.append(line)
                if line.rstrip("\n") == "}":
                    with contextlib.suppress(ValueError):
                        self.on_version(json.loads("".join(lines)))
                    lines = []
            self._proc.wait()
            self._stop.wait(1)

    def __enter__(self) -> MeshWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._proc is not None:
            self._proc.terminate()
        self._thread.join(10)


class ConditionWatcher(MeshWatch):
    """Every (type, status) of a mesh's conditions seen, and their history, from every version of it."""

    def __init__(self, ns: str, name: str) -> None:
        super().__init__(ns, name, self._record)
        self.seen: set[tuple[str, str]] = set()
        self.history: list[tuple[float, dict[str, str]]] = []

    def _record(self, obj: dict) -> None:
        conds = {c["type"]: c["status"] for c in (obj.get("status") or {}).get("conditions", [])}
        self.seen |= set(conds.items())
        self.history.append((time.monotonic(), conds))
