"""Replicas of a pipeline on a real cluster (issue 24's "Done means"): a mesh of spec.replicas 2
pipelines, each a frontend and its own 2 stage pods of the bundled model, behind the router that
the endpoint Service <name>-frontend selects.

One mesh (the module's `replicated` fixture) serves every test here, in order: it is Ready with two
pipelines; a shared prefix sticks to one replica and a burst spreads over both; an HPA on the mesh is
accepted; a stage of pipeline 0 lost mid-stream is replayed while pipeline 1 does not notice; a
frontend SIGKILLed mid-stream fails its own streams visibly while the other pipeline's finish; a
scale-down drains a pipeline under load (frontend first, then its stages) and a scale-up serves
again; a crash-looping pipeline is marked Failed on its own and recovers on a budget reset; deleting
the mesh leaves nothing behind. A test that changes the mesh puts it back (2 settled pipelines).

Sizing for the 2-core test node (beside the shared mesh): CPU requests of 100m (mesh_doc small=True),
so the 6 pods (7 while the crash test's pipeline rolls) fit; nothing here re-plans, so no pipeline
surges. restartBudget {restarts: 2, windowSeconds: 600}: a crash loop exceeds it after 3 restarts,
about 70 s of kubelet back-off (10 + 20 + 40 s). frontend.drainTimeoutSeconds 120: a drained frontend
has time to finish the streams it holds on 2 busy cores. Aim: under 10 minutes after the mesh is up.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from imesh_e2e import (
    CHILD_KIND_NAMES,
    CHILD_KINDS,
    FRONTEND_PORT,
    LABEL_COMPONENT,
    LABEL_MESH,
    LABEL_PIPELINE,
    MODEL,
    OUTLASTING_TOKENS,
    PROMPTS,
    REPO,
    ConditionWatcher,
    MeshWatch,
    ReadyRecorder,
    apply,
    conditions,
    delete_mesh,
    frontend_pod,
    get_json,
    kubectl,
    mesh,
    mesh_doc,
    not_recovered,
    pipelines,
    pod_http,
    pod_ready,
    pods,
    port_forward,
    prefix,
    probe_failures,
    probe_seconds,
    router_replicas,
    running_pods,
    sigkill_container,
    stage_pod,
    wait_for,
    wait_router_replicas,
    wait_router_scorer,
    wait_settled,
)
from load_client import LoadClient
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from openai import OpenAI

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(1200)  # the first test also waits for the mesh (6 pods loading on 2 cores)

NAME = "e2e-rep"
REPLICAS = 2
BUDGET = 2  # restarts within the window before a pipeline is Failed
DRAIN_S = 120
CHART = REPO / "charts" / "inferencemesh"
SELECTOR = f"{LABEL_MESH}={NAME},{LABEL_COMPONENT}=frontend"  # status.selector: one frontend pod per pipeline


@pytest.fixture(scope="module")
def replicated(settings: dict, mesh_namespace: str) -> Iterator[dict]:
    ns = mesh_namespace
    doc = mesh_doc(settings, NAME, small=True)
    doc["spec"]["replicas"] = REPLICAS
    doc["spec"]["restartBudget"] = {"restarts": BUDGET, "windowSeconds": 600}
    doc["spec"]["frontend"]["drainTimeoutSeconds"] = DRAIN_S
    apply(ns, doc)
    try:
        wait_settled(ns, NAME, settings["timeout"])
        yield {"namespace": ns, "name": NAME, "doc": doc}
    finally:
        delete_mesh(ns, NAME)


# ---- helpers ------------------------------------------------------------------------------------

def endpoint(m: dict) -> tuple[str, int]:
    return f"svc/{m['name']}-frontend", m["doc"]["spec"]["frontend"]["service"]["port"]


def openai_client(base: str) -> OpenAI:
    from openai import OpenAI

    return OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=300, max_retries=0)


def replica(k: int) -> str:
    """The router's name for pipeline k's frontend (its Deployment's name)."""
    return f"{prefix(NAME, k)}-frontend"


def indexes(ns: str) -> list[int]:
    return sorted(e["index"] for e in pipelines(ns, NAME))


def router_metric(base: str, sample: str, **match: str) -> dict[str, float]:
    """One sample of the router's /metrics (its own path, through the Service) by replica label."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in match.items()):
                found[s.labels["replica"]] = found.get(s.labels["replica"], 0.0) + s.value
    return found


def routed(base: str) -> dict[str, float]:
    """Requests each replica answered with 2xx, as the router counts them."""
    return router_metric(base, "inferencemesh_router_requests_total", outcome="2xx")


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """What each replica's counter grew by, the replicas whose did not left out (a router keeps a
    replica's series after it left: a rollout's old pipelines stay at their counts)."""
    grown = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)}
    return {k: v for k, v in grown.items() if v}


def frontend_counter(ns: str, k: int, metric: str) -> float:
    """A counter of pipeline k's frontend's own /metrics (summed over its series)."""
    text = pod_http(ns, frontend_pod(ns, NAME, k)["metadata"]["name"], FRONTEND_PORT, "/metrics")
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == metric)


def complete_200(client: OpenAI, prompt: str, max_tokens: int = 8) -> str:
    """A completion whose HTTP status must be 200; its text."""
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                      temperature=0)
    assert raw.status_code == 200, raw.status_code
    return raw.parse().choices[0].text


def stream(client: OpenAI, prompt: str, max_tokens: int, on_token: Callable[[int], None] | None = None
           ) -> tuple[str, str | None]:
    """A streamed greedy completion: its text and finish_reason."""
    pieces, finish = [], None
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True):
        if chunk.choices:
            pieces.append(chunk.choices[0].text or "")
            finish = chunk.choices[0].finish_reason or finish
            if on_token:
                on_token(len(pieces))
    return "".join(pieces), finish


def owned(ns: str, kind: str) -> set[str]:
    return {o["metadata"]["name"] for o in get_json(kind, "-n", ns, "-l", f"{LABEL_MESH}={NAME}")["items"]}


def imesh_row(ns: str) -> str:
    return kubectl("get", "inferencemesh", NAME, "-n", ns).splitlines()[1]


# ---- Ready with two pipelines -------------------------------------------------------------------

def test_two_pipelines_are_ready_and_every_pod_runs(settings: dict, replicated: dict) -> None:
    ns = replicated["namespace"]
    status = wait_settled(ns, NAME, settings["timeout"])["status"]
    assert [(e["index"], e["state"], e["ready"]) for e in status["pipelines"]] == [(0, "Ready", True),
                                                                                  (1, "Ready", True)], status
    assert {e["name"] for e in status["pipelines"]} == {prefix(NAME, 0), prefix(NAME, 1)}
    assert len({e["revision"] for e in status["pipelines"]}) == 1, "both pipelines run one revision"
    assert status["replicas"] == 2 and status["pipelinesSummary"] == "2/2" and status["selector"] == SELECTOR
    assert status["stagesSummary"] == "2/2" and status["phase"] == "Ready"
    assert conditions(ns, NAME)["Degraded"]["status"] == "False"
    # Every pod Running and ready: per pipeline 2 stages and a frontend, and the router's 2 pods.
    everything = pods(ns, f"{LABEL_MESH}={NAME}")
    assert all(p["status"]["phase"] == "Running" and pod_ready(p) for p in everything), \
        [(p["metadata"]["name"], p["status"]["phase"]) for p in everything]
    layout = sorted((p["metadata"]["labels"][LABEL_COMPONENT], p["metadata"]["labels"].get(LABEL_PIPELINE, "-"),
                     p["metadata"]["labels"].get("inferencemesh.io/stage", "-")) for p in everything)
    assert layout == [("frontend", "0", "-"), ("frontend", "1", "-"), ("router", "-", "-"), ("router", "-", "-"),
                      ("stage", "0", "0"), ("stage", "0", "1"), ("stage", "1", "0"), ("stage", "1", "1")], layout
    # Their objects, by the names names.py gives them.
    per_pipeline = {f"{prefix(NAME, k)}-{part}" for k in (0, 1) for part in ("stage-0", "stage-1")}
    assert per_pipeline | {replica(0), replica(1), f"{NAME}-router"} == owned(ns, "deployments")
    services = {s["metadata"]["name"]: s for s in get_json("services", "-n", ns, "-l", f"{LABEL_MESH}={NAME}")["items"]}
    assert set(services) == per_pipeline | {f"{NAME}-frontend", f"{NAME}-pipelines"}, set(services)
    assert services[f"{NAME}-frontend"]["spec"]["selector"] == {LABEL_MESH: NAME, LABEL_COMPONENT: "router"}
    assert services[f"{NAME}-pipelines"]["spec"]["clusterIP"] == "None"
    secrets = owned(ns, "secrets")
    assert {f"{NAME}-ca"} | {f"{c}-tls" for c in per_pipeline | {replica(0), replica(1)}} <= secrets, secrets
    # `kubectl get imesh`: the PIPELINES column.
    header, row = kubectl("get", "inferencemesh", NAME, "-n", ns).splitlines()
    cells = dict(zip(header.split(), row.split(), strict=True))
    assert cells["PIPELINES"] == "2/2" and cells["STAGES"] == "2/2" and cells["READY"] == "True", cells
    # The /scale subresource, as `kubectl scale` and an HPA read it.
    scale = json.loads(kubectl("get", "--raw",
                               f"/apis/inferencemesh.io/v1alpha1/namespaces/{ns}/inferencemeshes/{NAME}/scale"))
    assert (scale["spec"]["replicas"], scale["status"]["replicas"], scale["status"]["selector"]) == (2, 2, SELECTOR)
    # The router knows both frontends.
    with port_forward(ns, *endpoint(replicated)) as base:
        assert set(wait_router_replicas(base, 2)) == {replica(0), replica(1)}


# ---- routing through the Service ----------------------------------------------------------------

# About 600 characters (well over a few 16-token KV blocks, which the router scores by, and over its
# 128-character fallback blocks): every request below starts so.
SHARED_PREFIX = "".join(f"def helper_{i}(value):\n    return value * {i} + {i}\n\n" for i in range(14))


def test_requests_sharing_a_long_prefix_land_on_one_replica(settings: dict, replicated: dict) -> None:
    """Sequential requests (no load to balance) that share a long prefix and differ at their ends all
    go to the replica the first went to: the router counts them there (and as prefix-affinity hits,
    scored by the KV blocks the replicas publish), and that replica's frontend reuses the prefix's
    cached blocks; the other sees none."""
    ns = replicated["namespace"]
    wait_settled(ns, NAME, settings["timeout"])
    prompts = [SHARED_PREFIX + f"def task_{j}(items):\n" for j in range(6)]
    hits_before = {k: frontend_counter(ns, k, "inferencemesh_prefix_cache_hits_total") for k in (0, 1)}
    with port_forward(ns, *endpoint(replicated)) as base:
        wait_router_replicas(base, 2)
        wait_router_scorer(base)
        client = openai_client(base)
        before = routed(base)
        affinity_before = router_metric(base, "inferencemesh_router_prefix_affinity_hits_total")
        for prompt in prompts:
            assert complete_200(client, prompt, max_tokens=4) is not None
        sent = delta(routed(base), before)
        affinity = delta(router_metric(base, "inferencemesh_router_prefix_affinity_hits_total"), affinity_before)
    chosen = [name for name, n in sent.items() if n > 0]
    assert len(chosen) == 1 and sent[chosen[0]] == len(prompts), f"the shared prefix went to {sent}"
    assert affinity.get(chosen[0], 0) >= len(prompts) - 1, affinity
    k = {replica(0): 0, replica(1): 1}[chosen[0]]
    hits = {i: frontend_counter(ns, i, "inferencemesh_prefix_cache_hits_total") - hits_before[i] for i in (0, 1)}
    assert hits[k] > 0 and hits[1 - k] == 0, f"prefix-cache hits per pipeline: {hits}"


def test_a_burst_of_32_concurrent_requests_spreads_over_both_replicas(settings: dict, replicated: dict) -> None:
    """32 requests at once, each its own prompt (no prefix in common, so load decides): every one is
    answered 200, and both replicas take a fair share."""
    ns = replicated["namespace"]
    wait_settled(ns, NAME, settings["timeout"])
    prompts = [f"# burst request {i}: {i * 7919 % 1000}\n{PROMPTS[i % len(PROMPTS)]}" for i in range(32)]
    with port_forward(ns, *endpoint(replicated)) as base:
        wait_router_replicas(base, 2)
        client = openai_client(base)
        before = routed(base)
        with ThreadPoolExecutor(max_workers=32) as pool:
            futures = [pool.submit(complete_200, client, prompt, 8) for prompt in prompts]
            errors = [repr(e) for e in (f.exception(timeout=600) for f in futures) if e is not None]
        sent = delta(routed(base), before)
    assert not errors, f"{len(errors)} of 32 failed: {errors[:3]}"
    assert sum(sent.values()) == 32, sent
    print(f"burst split: {sent}")  # shown with pytest -rA
    assert min(sent.get(replica(0), 0), sent.get(replica(1), 0)) >= 4, f"the burst was not spread: {sent}"


# ---- the HPA ------------------------------------------------------------------------------------

def test_an_hpa_on_the_mesh_is_accepted_by_the_hpa_controller(settings: dict, replicated: dict) -> None:
    """A HorizontalPodAutoscaler whose scaleTargetRef is the InferenceMesh, with a CPU target and
    minReplicas = maxReplicas = 2 (so it can never change the mesh). The real HPA controller reads the
    mesh's /scale subresource: AbleToScale=True (SucceededGetScale) and `kubectl describe hpa` counts
    "InferenceMesh pods: 2 current" (status.replicas, ready pipelines). `kubectl describe hpa` does not
    print the selector; the controller lists the pods to measure with it (status.selector, one frontend
    pod per pipeline), and would say InvalidSelector in ScalingActive if it could not use it. The test
    cluster has no metrics-server, so ScalingActive is expected False with FailedGetResourceMetric
    ("unable to get metrics for resource cpu ..."); its actual status and reason are printed."""
    ns = replicated["namespace"]
    wait_settled(ns, NAME, settings["timeout"])
    api = autoscaling_api()
    hpa = {"apiVersion": api, "kind": "HorizontalPodAutoscaler", "metadata": {"name": NAME},
           "spec": {"scaleTargetRef": {"apiVersion": "inferencemesh.io/v1alpha1", "kind": "InferenceMesh",
                                       "name": NAME},
                    "minReplicas": REPLICAS, "maxReplicas": REPLICAS,
                    "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {
                        "type": "Utilization", "averageUtilization": 80}}}]}}
    apply(ns, hpa)
    try:
        active = hpa_accepted(ns, api)
        assert active["reason"] in ("FailedGetResourceMetric", "ScalingDisabled") or active["status"] == "True", \
            f"ScalingActive {active}"
        assert mesh(ns, NAME)["spec"]["replicas"] == REPLICAS  # min = max: the HPA changed nothing
    finally:
        kubectl("delete", "hpa", NAME, "-n", ns, "--ignore-not-found", check=False)


def autoscaling_api() -> str:
    versions = kubectl("api-versions").split()
    api = next((v for v in ("autoscaling/v2", "autoscaling/v2beta2") if v in versions), None)
    assert api, f"neither autoscaling/v2 nor autoscaling/v2beta2 is served: {versions}"
    return api


def hpa_accepted(ns: str, api: str) -> dict:
    """Wait for the HPA controller's verdict on the HPA named NAME: AbleToScale=True and the mesh's
    2 ready pipelines counted; its ScalingActive condition, which must not be InvalidSelector."""
    def hpa_conditions() -> dict[str, dict]:
        obj = json.loads(kubectl("get", f"horizontalpodautoscalers.{api.split('/')[1]}.autoscaling", NAME,
                                 "-n", ns, "-o", "json"))
        return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}

    conds: dict[str, dict] = wait_for(  # type: ignore[assignment]
        lambda: (c := hpa_conditions()) and "AbleToScale" in c and "ScalingActive" in c and c, 180,
        "the HPA controller to report on the mesh")
    describe = kubectl("describe", "hpa", NAME, "-n", ns)
    print(f"{api} HPA on the InferenceMesh:\n{describe}")  # shown with pytest -rA
    able, active = conds["AbleToScale"], conds["ScalingActive"]
    assert able["status"] == "True", f"AbleToScale {able}\n{describe}"
    assert active["reason"] != "InvalidSelector", f"the HPA could not use status.selector: {active}"
    assert re.search(rf"Reference:\s+InferenceMesh/{NAME}", describe), describe
    assert re.search(r"InferenceMesh pods:\s+2 current", describe), describe
    return active


def test_a_helm_upgrade_adds_the_charts_hpa_for_the_mesh_and_another_removes_it(
        settings: dict, release: str, replicated: dict) -> None:
    """`helm upgrade` of the installed chart with autoscaling for this mesh (min = max = 2 pipelines):
    the chart's HPA, on the frontends' waiting requests, is accepted by the HPA controller (its Pods
    metric needs a metrics adapter this cluster lacks: ScalingActive False, FailedGetPodsMetric).
    Upgrading back to the release's own values removes it; the operator and the mesh are untouched."""
    import helm_python as helm

    ns = replicated["namespace"]
    wait_settled(ns, NAME, settings["timeout"])
    api = autoscaling_api()
    operator = get_json("deployment", f"{release}-inferencemesh-operator", "-n", settings["operator_namespace"])
    with helm.Config(namespace=settings["operator_namespace"]) as cfg:
        values = dict(cfg.get_values(release) or {})  # the user-supplied values, a plain dict
        scaled = {**values, "autoscaling": {"enabled": True, "kind": "hpa", "mesh": {"name": NAME, "namespace": ns},
                                            "minReplicas": REPLICAS, "maxReplicas": REPLICAS}}
        cfg.upgrade(CHART, release, scaled, namespace=settings["operator_namespace"], timeout=300)
        try:
            hpa = get_json(f"horizontalpodautoscalers.{api.split('/')[1]}.autoscaling", NAME, "-n", ns)
            assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "inferencemesh_num_requests_waiting"
            active = hpa_accepted(ns, api)
            assert active["status"] == "True" or active["reason"] in ("FailedGetPodsMetric", "ScalingDisabled"), \
                f"ScalingActive {active}"
            assert mesh(ns, NAME)["spec"]["replicas"] == REPLICAS
        finally:
            cfg.upgrade(CHART, release, values, namespace=settings["operator_namespace"], timeout=300)
    wait_for(lambda: not kubectl("get", "hpa", NAME, "-n", ns, "--ignore-not-found").strip(), 60,
             "the chart's HPA to go with the second upgrade")
    after = get_json("deployment", f"{release}-inferencemesh-operator", "-n", settings["operator_namespace"])
    assert after["metadata"]["uid"] == operator["metadata"]["uid"]
    assert after["spec"]["template"] == operator["spec"]["template"]  # the operator was not rolled
    assert mesh(ns, NAME)["spec"]["replicas"] == REPLICAS and conditions(ns, NAME)["Degraded"]["status"] != "True"


# ---- a lost stage in one pipeline ---------------------------------------------------------------

LONG_PROMPT, LONG_TOKENS = PROMPTS[0], OUTLASTING_TOKENS


class StatusWatcher(MeshWatch):
    """Every state each pipeline index showed in status.pipelines, from every version of the mesh."""

    def __init__(self, ns: str) -> None:
        super().__init__(ns, NAME, self._record)
        self.states: dict[int, set[str]] = {}

    def _record(self, obj: dict) -> None:
        for e in (obj.get("status") or {}).get("pipelines") or []:
            self.states.setdefault(e["index"], set()).add(e["state"])


def restarts_of(ns: str, k: int) -> dict[str, int]:
    return {p["metadata"]["name"]: sum(c.get("restartCount", 0) for c in p["status"].get("containerStatuses", []))
            for p in pods(ns, f"{LABEL_MESH}={NAME},{LABEL_PIPELINE}={k}")}


def test_a_stage_of_pipeline_0_lost_mid_stream_is_replayed_and_pipeline_1_is_unaffected(
        settings: dict, replicated: dict) -> None:
    """Two greedy streams at once, one on each pipeline (straight to each frontend pod, to pin them);
    stage 1 of pipeline 0 is deleted after pipeline 0's 4th token. Pipeline 0's frontend replays the
    request on the new stage pod and its stream ends as an undisturbed one; pipeline 1's stream, pods
    and state (Ready throughout) are untouched; the Service keeps answering meanwhile."""
    ns = replicated["namespace"]
    wait_settled(ns, NAME, settings["timeout"])
    victim = stage_pod(ns, NAME, 1, 0)["metadata"]["name"]
    others = restarts_of(ns, 1)
    started = time.time()
    front0, front1 = (frontend_pod(ns, NAME, k)["metadata"]["name"] for k in (0, 1))
    disrupted: list[float] = []

    def on_token(n: int) -> None:
        if n == 4 and not disrupted:
            kubectl("delete", "pod", victim, "-n", ns, "--wait=false")
            disrupted.append(time.monotonic())

    with port_forward(ns, f"pod/{front0}", FRONTEND_PORT) as base0, \
            port_forward(ns, f"pod/{front1}", FRONTEND_PORT) as base1, \
            port_forward(ns, *endpoint(replicated)) as base:
        client0, client1 = openai_client(base0), openai_client(base1)
        timed = time.monotonic()
        undisturbed, _ = stream(client0, LONG_PROMPT, LONG_TOKENS)
        undisturbed_s = time.monotonic() - timed
        with StatusWatcher(ns) as watch, ThreadPoolExecutor(max_workers=2) as pool:
            lost = pool.submit(stream, client0, LONG_PROMPT, LONG_TOKENS, on_token)
            other = pool.submit(stream, client1, LONG_PROMPT, LONG_TOKENS)
            wait_for(lambda: disrupted or lost.done(), 300, "pipeline 0's stream to reach its 4th token", 0.2)
            assert disrupted, f"pipeline 0's stream ended before the stage could be deleted: {lost.result()}"
            # Meanwhile, through the Service: the router sends to whichever pipeline can take it.
            time.sleep(3)
            assert complete_200(openai_client(base), PROMPTS[2], max_tokens=8) is not None
            replayed, _ = lost.result(timeout=600)
            unaffected, _ = other.result(timeout=600)
            wait_settled(ns, NAME, settings["timeout"])
    assert replayed == undisturbed, "pipeline 0's replayed stream differs from an undisturbed one"
    assert unaffected == undisturbed, "pipeline 1's stream differs from pipeline 0's undisturbed one"
    logs = kubectl("logs", "-n", ns, front0, f"--since={int(time.time() - started) + 5}s")
    assert "recovered in" in logs, not_recovered(logs, undisturbed_s)
    assert watch.states.get(1) == {"Ready"}, f"pipeline 1 was not Ready throughout: {watch.states}"
    assert restarts_of(ns, 1) == others, "pipeline 1's pods changed"
    assert stage_pod(ns, NAME, 1, 0)["metadata"]["name"] != victim


# ---- a frontend killed mid-stream ---------------------------------------------------------------

# 256 tokens: 4 undisturbed streams of 128 took 1.9 s here (speculation), and the victim's first
# stream must still run once the 4th has its first token.
KILL_STREAMS, KILL_TOKENS = 4, 256
KILL_PROMPTS = [f"# killed frontend, stream {i}\n{PROMPTS[i % len(PROMPTS)]}" for i in range(KILL_STREAMS)]


class Progress:
    """A stream's chunks so far (each one or more tokens), and whether it has its first (or ended)."""

    def __init__(self) -> None:
        self.chunks = 0
        self.first = threading.Event()

    def __call__(self, n: int) -> None:
        self.chunks = n
        self.first.set()


def stream_outcome(client: OpenAI, prompt: str, max_tokens: int, progress: Progress | None = None
                   ) -> tuple[str, str, str | None]:
    """A greedy stream of exactly max_tokens tokens (ignore_eos), as a client sees it:
    ("done", text, finish_reason) when the SDK's iteration ended normally, ("error", what it raised,
    None) when it raised (an SSE error event: openai.APIError; a broken connection: an httpx error)."""
    import httpx

    pieces: list[str] = []
    finish = None
    try:
        for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
            if chunk.choices:
                pieces.append(chunk.choices[0].text or "")
                finish = chunk.choices[0].finish_reason or finish
                if progress is not None:
                    progress(len(pieces))
    except (openai.APIError, httpx.HTTPError) as err:
        return "error", f"{type(err).__name__}: {err}", None
    finally:
        if progress is not None:
            progress.first.set()
    return "done", "".join(pieces), finish


def test_a_frontend_killed_mid_stream_fails_its_streams_visibly_and_the_other_pipeline_finishes(
        settings: dict, replicated: dict) -> None:
    """4 greedy streams of 256 tokens through the router (started one by one, so the router's load
    balance puts 2 on each pipeline; its per-replica `routed` count says where each went); once
    every one has its first token, the frontend container of one pipeline is SIGKILLed through
    containerd (a crash: no SIGTERM, no preStop, no drain). Each stream that was on it ends with an
    error the `openai` client raises (the router's SSE error event naming the replica, or a broken
    connection), never a normal end of a truncated answer; the other pipeline's streams finish and
    equal the undisturbed reference (the same prompts streamed before); a request sent during the
    outage is answered 200; the container is restarted in its pod (one restart, within the
    pipeline's budget), Ready and routed to again, and the same 4 streams through the router all
    equal the reference."""
    ns = replicated["namespace"]
    if not settings["containerd_address"]:
        pytest.skip("needs IMESH_E2E_CONTAINERD_ADDRESS (the tests run on the node, e.g. tools/cluster/up.sh)")
    wait_settled(ns, NAME, settings["timeout"])
    frontends = {replica(k): frontend_pod(ns, NAME, k) for k in indexes(ns)}
    with port_forward(ns, *endpoint(replicated)) as base:
        wait_router_replicas(base, 2)
        client = openai_client(base)
        reference_at = time.monotonic()
        with ThreadPoolExecutor(max_workers=KILL_STREAMS) as pool:
            reference = dict(zip(KILL_PROMPTS, pool.map(lambda p: stream_outcome(client, p, KILL_TOKENS),
                                                        KILL_PROMPTS), strict=True))
        reference_s = time.monotonic() - reference_at
        assert all(kind == "done" and finish == "length" for kind, _, finish in reference.values()), reference

        # The streams, one by one: each one's replica is the one whose `routed` count grew.
        placed: list[str] = []
        futures, progress = [], [Progress() for _ in KILL_PROMPTS]
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=KILL_STREAMS) as pool:
            for prompt, seen in zip(KILL_PROMPTS, progress, strict=True):
                before = {name: r["routed"] for name, r in router_replicas(base).items()}
                futures.append(pool.submit(stream_outcome, client, prompt, KILL_TOKENS, seen))
                assert seen.first.wait(120), f"a stream never started: {prompt!r}"
                grown = [name for name, r in router_replicas(base).items() if r["routed"] > before.get(name, 0)]
                assert len(grown) == 1, f"cannot tell where a stream went: {router_replicas(base)}"
                placed.append(grown[0])
            assert set(placed) == set(frontends), f"the streams did not reach both pipelines: {placed}"
            # The victim: a pipeline none of whose streams has ended yet (the lower index of two).
            running = {name for name in placed
                       if not any(f.done() for f, where in zip(futures, placed, strict=True) if where == name)}
            assert running, f"a stream of each pipeline ended before the kill (raise KILL_TOKENS): {placed}"
            victim = min(running, key=lambda name: int(frontends[name]["metadata"]["labels"][LABEL_PIPELINE]))
            pod = frontends[victim]
            sigkill_container(settings["containerd_address"], pod)
            killed_at = time.monotonic()
            at_kill = [seen.chunks for seen in progress]
            placing_s = killed_at - started
            # Meanwhile, a new request: answered by the other pipeline (the router marked the victim down).
            outage_answer = complete_200(client, KILL_PROMPTS[0], max_tokens=8)
            outage_s = time.monotonic() - killed_at
            results = [f.result(timeout=300) for f in futures]
        name = pod["metadata"]["name"]
        restarts = pod["status"]["containerStatuses"][0].get("restartCount", 0)
        wait_for(lambda: (p := get_json("pod", name, "-n", ns))["status"]["containerStatuses"][0]
                 .get("restartCount", 0) > restarts and pod_ready(p), 300, f"{name} restarted and Ready again", 0.5)
        ready_s = time.monotonic() - killed_at
        wait_for(lambda: router_replicas(base).get(victim, {}).get("up"), 120, f"the router to route to {victim} again",
                 0.5)
        routed_s = time.monotonic() - killed_at
        with ThreadPoolExecutor(max_workers=KILL_STREAMS) as pool:
            after = dict(zip(KILL_PROMPTS, pool.map(lambda p: stream_outcome(client, p, KILL_TOKENS), KILL_PROMPTS),
                             strict=True))
    outcomes = list(zip(placed, KILL_PROMPTS, results, strict=True))
    killed = [(prompt, r) for where, prompt, r in outcomes if where == victim]
    others = [(prompt, r) for where, prompt, r in outcomes if where != victim]
    cut = [r[1] for _, r in killed if r[0] == "error"]
    print(f"{KILL_STREAMS} undisturbed streams of {KILL_TOKENS} tokens took {reference_s:.1f} s; {victim} SIGKILLed "
          f"{placing_s:.1f} s after the first stream started, the streams on {placed} at chunks {at_kill}; "
          f"{len(cut)} of its {len(killed)} streams raised (first: {cut[:1]}), the others' ended "
          f"{[r[:1] + r[2:] for _, r in others]}; a request during the outage took {outage_s:.1f} s; the container "
          f"restarted and Ready after {ready_s:.1f} s, routed to again after {routed_s:.1f} s")  # shown with -rA
    for prompt, (kind, what, finish) in killed:
        if kind == "done":  # only a stream that had ended in the moment before the kill: whole, or it is the bug
            assert (finish, what) == ("length", reference[prompt][1]), \
                f"a stream through the killed frontend ended normally, truncated ({finish=}): {what!r}"
            continue
        # The router's SSE error event (the SDK raises APIError) names the replica; a broken
        # connection (an httpx error) is the other visible end.
        assert not what.startswith("APIError") or victim in what, what
    assert any(kind == "error" for _, (kind, _, _) in killed), f"no stream was cut by the kill: {killed}"
    for prompt, (kind, text, finish) in others:
        assert (kind, finish) == ("done", "length"), (kind, text)
        assert text == reference[prompt][1], f"{prompt!r}: {text!r} != {reference[prompt][1]!r}"
    assert outage_answer and reference[KILL_PROMPTS[0]][1].startswith(outage_answer), outage_answer
    assert all(after[p] == reference[p] for p in KILL_PROMPTS), {p: (after[p], reference[p]) for p in KILL_PROMPTS}
    wait_settled(ns, NAME, settings["timeout"])


# ---- scaling ------------------------------------------------------------------------------------

STREAMS, STREAM_TOKENS = 8, 96


class PodRecorder:
    """Polls a selector's pods in a thread: when each was first seen terminating and seen gone."""

    def __init__(self, ns: str, selector: str) -> None:
        self.ns, self.selector = ns, selector
        self.seen: dict[str, dict] = {}
        self.terminating: dict[str, float] = {}
        self.gone: dict[str, float] = {}
        self.polled = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                items = pods(self.ns, self.selector)
            except Exception:  # noqa: BLE001 - keep polling
                self._stop.wait(0.5)
                continue
            now = time.monotonic()
            names = set()
            for pod in items:
                name = pod["metadata"]["name"]
                names.add(name)
                self.seen.setdefault(name, pod)
                if pod["metadata"].get("deletionTimestamp"):
                    self.terminating.setdefault(name, now)
            for name in self.seen:
                if name not in names:
                    self.gone.setdefault(name, now)
            self.polled.set()
            self._stop.wait(0.5)

    def leaving(self, name: str) -> float:
        """When the pod was first seen going (terminating, or already gone)."""
        return self.terminating.get(name, self.gone.get(name, float("inf")))

    def __enter__(self) -> PodRecorder:
        self._thread.start()
        self.polled.wait(60)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def streams_during(base: str, client: OpenAI, count: int, label: str, action: Callable[[], object]
                   ) -> tuple[dict[str, float], list[tuple[str, str | None]], list[str]]:
    """`count` greedy streams through the router; once each has its first token, the router's
    requests in flight per replica are read and `action` runs; then every stream is awaited.
    Returns (in flight, each stream's (text, finish_reason), each failed stream's error)."""
    first_tokens = [threading.Event() for _ in range(count)]

    def one(i: int) -> tuple[str, str | None]:
        return stream(client, f"# stream {i} of {label}\n{PROMPTS[i % len(PROMPTS)]}", STREAM_TOKENS,
                      lambda n: first_tokens[i].set())

    with ThreadPoolExecutor(max_workers=count) as pool:
        futures = [pool.submit(one, i) for i in range(count)]
        wait_for(lambda: all(e.is_set() for e in first_tokens) or any(f.done() for f in futures), 300,
                 "every stream's first token", 0.2)
        in_flight = router_metric(base, "inferencemesh_router_requests_in_flight")
        action()
        results, errors = [], []
        for f in futures:
            try:
                results.append(f.result(timeout=DRAIN_S + 300))
            except Exception as err:  # noqa: BLE001 - counted
                errors.append(repr(err))
    return in_flight, results, errors


def kubectl_scale(ns: str, replicas: int) -> None:
    kubectl("scale", "inferencemesh", NAME, "-n", ns, f"--replicas={replicas}")


def test_scaling_down_under_load_drains_a_pipeline_frontend_first_and_scaling_up_serves(
        settings: dict, replicated: dict) -> None:
    """`kubectl scale imesh --replicas 1` while 8 streams run through the Service: pipeline 1 (the
    highest index) drains. Every stream completes without an error (its frontend finishes what it
    holds), its frontend pod goes first and its stage pods only after that pod is gone. Scaling back
    to 2 starts a new pipeline 1, which serves."""
    ns = replicated["namespace"]
    wait_settled(ns, NAME, settings["timeout"])
    old_front = frontend_pod(ns, NAME, 1)["metadata"]["name"]
    with port_forward(ns, *endpoint(replicated)) as base:
        wait_router_replicas(base, 2)
        client = openai_client(base)
        with PodRecorder(ns, f"{LABEL_MESH}={NAME},{LABEL_PIPELINE}=1") as recorder, StatusWatcher(ns) as watch:
            in_flight, results, errors = streams_during(base, client, STREAMS, "the scale test",
                                                        lambda: kubectl_scale(ns, 1))
            wait_settled(ns, NAME, settings["timeout"])
            wait_for(lambda: set(recorder.seen) <= set(recorder.gone), 120, "pipeline 1's pods to be seen gone", 1)
        assert in_flight.get(replica(1), 0) > 0, f"no stream was on pipeline 1 when it was scaled away: {in_flight}"
        assert not errors, f"{len(errors)} of {STREAMS} streams failed: {errors[:3]}"
        assert all(text and finish in ("length", "stop") for text, finish in results), results
        assert indexes(ns) == [0]
        assert "Draining" in watch.states.get(1, set()), f"pipeline 1 never showed Draining: {watch.states}"
        # Frontend first; the stages only once no frontend pod of the pipeline was left.
        role = {n: p["metadata"]["labels"][LABEL_COMPONENT] for n, p in recorder.seen.items()}
        fronts = [n for n, r in role.items() if r == "frontend"]
        stages = [n for n, r in role.items() if r == "stage"]
        assert fronts and len(stages) == 2, role
        order = {n: (round(recorder.leaving(n), 1), round(recorder.gone[n], 1)) for n in role}
        front_gone = max(recorder.gone[n] for n in fronts)
        stage_leaving = min(recorder.leaving(n) for n in stages)
        assert max(recorder.leaving(n) for n in fronts) < stage_leaving, f"(leaving, gone) per pod: {order}"
        assert stage_leaving >= front_gone, f"a stage pod went before its frontend pod was gone: {order}"

        # Back to 2: a new pipeline 1 (the lowest free index), Ready, and the router sends it requests.
        kubectl_scale(ns, 2)
        wait_settled(ns, NAME, settings["timeout"])
        assert indexes(ns) == [0, 1]
        assert frontend_pod(ns, NAME, 1)["metadata"]["name"] != old_front
        assert set(wait_router_replicas(base, 2)) == {replica(0), replica(1)}
        before = routed(base)
        for round_ in range(3):
            prompts = [f"# scaled back, round {round_}, request {i}\n{PROMPTS[i % len(PROMPTS)]}" for i in range(8)]
            with ThreadPoolExecutor(max_workers=8) as pool:
                list(pool.map(lambda p: complete_200(client, p, 8), prompts))
            if delta(routed(base), before).get(replica(1), 0) > 0:
                break
        assert delta(routed(base), before).get(replica(1), 0) > 0, f"the new pipeline 1 served nothing: {routed(base)}"


# ---- changes under load: a rollout, a router pod deleted ----------------------------------------

LOAD_PROMPTS = [f"# load {i}\n{PROMPTS[i % len(PROMPTS)]}" for i in range(6)]
LOAD_TOKENS = 16


def expected_answers(m: dict) -> dict[str, str]:
    """The greedy streamed answers the load client must see, asked through the router now."""
    with port_forward(m["namespace"], *endpoint(m)) as base:
        client = openai_client(base)
        answers = {p: stream(client, p, LOAD_TOKENS) for p in LOAD_PROMPTS}
    assert all(finish in ("length", "stop") for _, finish in answers.values()), answers
    return {p: text for p, (text, _) in answers.items()}


def load_client(settings: dict, m: dict, name: str, expected: dict[str, str], limit_s: float = 1200) -> LoadClient:
    """limit_s: the load pod stops by itself after this long (a test that streams for longer raises it)."""
    ns = m["namespace"]
    image = settings["frontend_image"] or frontend_pod(ns, NAME)["spec"]["containers"][0]["image"]
    return LoadClient(ns, name, image, settings["pull_policy"], mesh(ns, NAME)["status"]["endpoint"], expected,
                      max_tokens=LOAD_TOKENS, limit_s=limit_s)


def probe_timeouts(ns: str, component: str) -> dict[str, int]:
    """Kubelet probes of this mesh's `component` pods that timed out, per pod (Unhealthy events): a
    healthy pod's false negatives. A 503 from /ready while a stage loads or drains is a true answer,
    not counted."""
    mine = {p["metadata"]["name"] for p in pods(ns, f"{LABEL_MESH}={NAME},{LABEL_COMPONENT}={component}")}
    found: dict[str, int] = {}
    for event in get_json("events", "-n", ns, "--field-selector", "reason=Unhealthy")["items"]:
        name, message = event["involvedObject"]["name"], event.get("message") or ""
        if name in mine and ("deadline exceeded" in message or "Timeout" in message or "timed out" in message):
            found[name] = found.get(name, 0) + int(event.get("count") or 1)
    return found


def mesh_event_counts(ns: str) -> dict[str, tuple[str, int]]:
    """The mesh's own Events: name -> (reason, count)."""
    items = get_json("events", "-n", ns, "--field-selector",
                     f"involvedObject.kind=InferenceMesh,involvedObject.name={NAME}")["items"]
    return {e["metadata"]["name"]: (e.get("reason", ""), int(e.get("count") or 1)) for e in items}


def new_events(before: dict[str, tuple[str, int]], after: dict[str, tuple[str, int]]) -> dict[str, int]:
    """Reasons posted since `before`, with how often."""
    counts: dict[str, int] = {}
    for name, (reason, count) in after.items():
        extra = count - before.get(name, (reason, 0))[1]
        if extra > 0:
            counts[reason] = counts.get(reason, 0) + extra
    return counts


def test_a_spec_change_rolls_every_pipeline_under_load_without_a_failed_request(
        settings: dict, replicated: dict) -> None:
    """frontend.maxBatchTokens changed while 4 clients stream through the Service from inside the
    cluster: every pipeline is replaced by one of the new revision, one at a time (a new one serves
    before an old one drains), and not one request fails or answers differently. The status shows
    the rollout (Progressing True with the revision) and ends Available with both pipelines; the
    mesh's Events tell the story once (a start, a start and a drain per pipeline, a finish) and
    nothing flaps."""
    ns = replicated["namespace"]
    wait_settled(ns, NAME, settings["timeout"])
    old = {e["index"] for e in pipelines(ns, NAME)}
    expected = expected_answers(replicated)
    events_before = mesh_event_counts(ns)
    patch = {"spec": {"frontend": {"maxBatchTokens": 192}}}
    with load_client(settings, replicated, "imesh-e2e-rollout-load", expected) as load, \
            ConditionWatcher(ns, NAME) as watch:
        time.sleep(5)
        kubectl("patch", "inferencemesh", NAME, "-n", ns, "--type=merge", "-p", json.dumps(patch))
        wait_for(lambda: ("Progressing", "True") in watch.seen, 60, "the rollout to show as Progressing")
        status = wait_settled(ns, NAME, settings["timeout"])["status"]
        load.progress()
        time.sleep(5)
    print(f"rollout under load: {load.summary()}")  # shown with pytest -rA
    assert not load.result["failed"] and not load.result["mismatched"], load.summary()
    assert load.result["requests"] >= 50, load.summary()
    now = {e["index"] for e in status["pipelines"]}
    assert len(now) == REPLICAS and not now & old, f"not every pipeline was replaced: {old} -> {now}"
    available = conditions(ns, NAME)["Available"]
    assert available["status"] == "True" and f"{REPLICAS}/{REPLICAS}" in available["message"], available
    # never fewer serving than asked: Available stayed True throughout (maxUnavailable 0)
    assert ("Available", "False") not in watch.seen, watch.history[-20:]
    progressing = conditions(ns, NAME)["Progressing"]
    assert (progressing["status"], progressing["reason"]) == ("False", "Complete"), progressing
    events = wait_for(lambda: (e := new_events(events_before, mesh_event_counts(ns))).get("RolloutFinished") and e,
                      60, "the RolloutFinished event")
    assert events.get("RolloutStarted") == 1 and events.get("PipelineStarted") == REPLICAS, events  # type: ignore[union-attr]
    assert events.get("PipelineDrained") == REPLICAS, events  # type: ignore[union-attr]
    assert not {"Degraded", "Recovered", "NotReady"} & set(events), events  # type: ignore[arg-type]
    # The pipelines' probes held under this load: no stage's or frontend's timed out, and a stage's
    # costs milliseconds. (The routers' are printed: they timed out a few times in a run, while the
    # new pods loaded, with no request failing.)
    print(f"router probe timeouts: {probe_timeouts(ns, 'router')}")
    assert probe_timeouts(ns, "stage") == probe_timeouts(ns, "frontend") == {}, \
        (probe_timeouts(ns, "stage"), probe_timeouts(ns, "frontend"))
    took = probe_seconds(ns, stage_pod(ns, NAME, 1, min(now))["metadata"]["name"])
    print(f"a stage's /ready from inside its pod: median {sorted(took)[len(took) // 2] * 1000:.1f} ms, "
          f"max {max(took) * 1000:.1f} ms")
    assert max(took) < 1.0, took


def test_deleting_a_router_pod_under_load_fails_no_request(settings: dict, replicated: dict) -> None:
    """The router runs 2 pods by default: one deleted while 4 clients stream through the Service
    from inside the cluster, and not one request fails (the other pod serves; the deleted one
    finishes what it holds after its endpoint is gone)."""
    ns = replicated["namespace"]
    wait_settled(ns, NAME, settings["timeout"])
    routers = running_pods(ns, f"{LABEL_MESH}={NAME},{LABEL_COMPONENT}=router")
    assert len(routers) == 2 and all(pod_ready(p) for p in routers), [p["metadata"]["name"] for p in routers]
    expected = expected_answers(replicated)
    with load_client(settings, replicated, "imesh-e2e-router-load", expected) as load:
        time.sleep(5)
        kubectl("delete", "pod", routers[0]["metadata"]["name"], "-n", ns, "--wait=true", timeout=180)
        wait_for(lambda: sum(pod_ready(p) for p in running_pods(
            ns, f"{LABEL_MESH}={NAME},{LABEL_COMPONENT}=router")) == 2, 180, "a second router pod ready again")
        load.progress()
        time.sleep(5)
    print(f"router pod deleted under load: {load.summary()}")
    assert not load.result["failed"] and not load.result["mismatched"], load.summary()
    assert load.result["requests"] >= 20, load.summary()


# ---- a soak -------------------------------------------------------------------------------------

# Seconds of running, the first half idle, the second with 4 clients streaming through the router from
# inside the cluster. CI's run: 2 minutes; issue 37's soak: IMESH_E2E_SOAK_SECONDS=1200, its figures
# written to IMESH_E2E_SOAK_JSON.
SOAK_S = float(os.environ.get("IMESH_E2E_SOAK_SECONDS", "120"))


@pytest.mark.timeout(SOAK_S + 900)  # the run, and the mesh's start when this test runs alone
def test_idle_and_loaded_running_neither_flaps_nor_fails(settings: dict, replicated: dict) -> None:
    """Nothing changes, so nothing may move: no pod's Ready flips, no container restarts, the mesh
    stays Available and never Degraded, it posts no Degraded, Recovered or NotReady event, no probe of
    a stage or a frontend fails (a healthy pod's false negatives; the router's are reported), and
    not one request fails or answers differently."""
    ns = replicated["namespace"]
    wait_settled(ns, NAME, settings["timeout"])
    expected = expected_answers(replicated)
    selector = f"{LABEL_MESH}={NAME}"
    events_before, probes_before = mesh_event_counts(ns), probe_failures(ns, selector)
    started = time.monotonic()
    with ReadyRecorder(ns, selector) as ready, ConditionWatcher(ns, NAME) as watch:
        time.sleep(SOAK_S / 2)
        idle_flips = len(ready.flips)
        with load_client(settings, replicated, "imesh-e2e-soak-load", expected, limit_s=SOAK_S / 2 + 600) as load:
            loaded_until = time.monotonic() + SOAK_S / 2
            while time.monotonic() < loaded_until:
                time.sleep(min(60.0, max(0.0, loaded_until - time.monotonic())))
                load.progress()
    probes = {pod: {probe: n - probes_before.get(pod, {}).get(probe, 0) for probe, n in counts.items()}
              for pod, counts in probe_failures(ns, selector).items()}
    events = new_events(events_before, mesh_event_counts(ns))
    report = {"seconds": round(time.monotonic() - started), "polls": ready.polls,
              "ready_flips_idle": idle_flips, "ready_flips_loaded": len(ready.flips) - idle_flips,
              "flips": [(round(t - started), pod, now) for t, pod, now in ready.flips],
              "restarts": {pod: n for pod, n in ready.restarts.items() if n},
              "conditions_seen": sorted(watch.seen), "events": events,
              "failed_probes": {pod: c for pod, c in probes.items() if any(c.values())},
              "load": {k: load.result.get(k) for k in ("requests", "ok", "seconds")},
              "failed_requests": len(load.result["failed"]), "mismatched": len(load.result["mismatched"])}
    print(f"soak: {json.dumps(report)}")  # shown with pytest -rA
    if os.environ.get("IMESH_E2E_SOAK_JSON"):
        Path(os.environ["IMESH_E2E_SOAK_JSON"]).write_text(json.dumps(report, indent=1) + "\n")
    assert not ready.flips and not report["restarts"], report
    assert ("Available", "False") not in watch.seen and ("Degraded", "True") not in watch.seen, report
    assert not {"Degraded", "Recovered", "NotReady"} & set(events), report
    # The router's probes are reported, not held to zero: a missed one there is absorbed by its
    # failure threshold (3 of 5 s) and would show as a flip above if it were not.
    routers = {p["metadata"]["name"] for p in pods(ns, f"{selector},{LABEL_COMPONENT}=router")}
    assert not set(report["failed_probes"]) - routers, report  # type: ignore[arg-type]
    assert not load.result["failed"] and not load.result["mismatched"], load.summary()
    assert load.result["requests"] >= 10, load.summary()


# ---- a crash loop -------------------------------------------------------------------------------

BOGUS = "--bogus-flag"


def args_of(ns: str, deployment: str) -> list[str]:
    return get_json("deployment", deployment, "-n", ns)["spec"]["template"]["spec"]["containers"][0]["args"]


def test_a_crash_looping_pipeline_is_failed_alone_and_recovers_on_a_budget_reset(
        settings: dict, replicated: dict) -> None:
    """One stage Deployment of pipeline 1 is patched to start its container with an argument the
    program refuses. The operator leaves the patch be (it compares the hash annotation it wrote, which
    the patch keeps), so the pod crash-loops, each time writing its one-line error to its termination
    log. Beyond the restart budget, pipeline 1 is Failed with that line in its message, the Degraded
    condition says PipelineFailed, its frontend is scaled to 0 and its stage pods are kept; pipeline 0
    serves every request through the Service. Undoing the patch and a new value of the annotation
    inferencemesh.io/reset-restarts bring pipeline 1 back."""
    ns = replicated["namespace"]
    wait_settled(ns, NAME, settings["timeout"])
    good, bad = indexes(ns)  # 0 and 1
    target = f"{prefix(NAME, bad)}-stage-1"
    assert BOGUS not in args_of(ns, target)
    kubectl("patch", "deployment", target, "-n", ns, "--type=json", "-p", json.dumps(
        [{"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": BOGUS}]))
    try:
        failed: dict = wait_for(  # type: ignore[assignment]
            lambda: next((e for e in pipelines(ns, NAME) if e["index"] == bad and e["state"] == "Failed"), None),
            420, f"pipeline {bad} to be Failed (restart budget {BUDGET})", 2)
        print(f"pipeline {bad}: {failed['message']}")  # shown with pytest -rA
        # argparse's own line, which the CLI's parser writes to the termination log as it exits 2.
        assert f"unrecognized arguments: {BOGUS}" in failed["message"], failed
        assert failed["ready"] is False and failed["restarts"] > BUDGET, failed
        status = mesh(ns, NAME)["status"]
        degraded = {c["type"]: c for c in status["conditions"]}["Degraded"]
        assert degraded["status"] == "True" and degraded["reason"] == "PipelineFailed", degraded
        assert f"pipeline {bad} failed" in degraded["message"] and BOGUS in degraded["message"], degraded
        assert status["phase"] == "Degraded" and status["replicas"] == 1, status
        assert status["pipelinesSummary"] == "1/2 (1 failed)", status["pipelinesSummary"]
        assert "1/2 (1 failed)" in imesh_row(ns)
        assert next(e for e in status["pipelines"] if e["index"] == good)["state"] == "Ready", status["pipelines"]
        # Nothing routes to it: its frontend is scaled to 0 (and gone); its stage pods stay for debugging.
        wait_for(lambda: get_json("deployment", replica(bad), "-n", ns)["spec"]["replicas"] == 0, 60,
                 f"pipeline {bad}'s frontend to be scaled to 0")
        wait_for(lambda: not pods(ns, f"{LABEL_MESH}={NAME},{LABEL_COMPONENT}=frontend,{LABEL_PIPELINE}={bad}"),
                 DRAIN_S + 60, f"pipeline {bad}'s frontend pod to go")
        kept = pods(ns, f"{LABEL_MESH}={NAME},{LABEL_COMPONENT}=stage,{LABEL_PIPELINE}={bad}")
        assert len(kept) == 2, [p["metadata"]["name"] for p in kept]
        with port_forward(ns, *endpoint(replicated)) as base:
            assert set(wait_router_replicas(base, 1)) == {replica(good)}
            client = openai_client(base)
            before = routed(base)
            for i in range(4):
                assert complete_200(client, f"# while pipeline {bad} is failed: {i}\n{PROMPTS[i % 3]}") is not None
            assert delta(routed(base), before) == {replica(good): 4.0}, delta(routed(base), before)
    finally:
        args = args_of(ns, target)
        if BOGUS in args:
            at = args.index(BOGUS)
            kubectl("patch", "deployment", target, "-n", ns, "--type=json", "-p", json.dumps(
                [{"op": "test", "path": f"/spec/template/spec/containers/0/args/{at}", "value": BOGUS},
                 {"op": "remove", "path": f"/spec/template/spec/containers/0/args/{at}"}]))
        # The crashing pod gone first (Recreate), so its restarts do not count against the new budget.
        wait_for(lambda: all(BOGUS not in p["spec"]["containers"][0]["args"] for p in pods(
            ns, f"{LABEL_MESH}={NAME},{LABEL_PIPELINE}={bad},inferencemesh.io/stage=1")), 120,
            "the crash-looping pod to go")
        reset = str(int(time.time()))
        kubectl("annotate", "inferencemesh", NAME, "-n", ns, f"inferencemesh.io/reset-restarts={reset}", "--overwrite")
    status = wait_settled(ns, NAME, settings["timeout"])["status"]
    assert status.get("restartsReset") == reset, status.get("restartsReset")
    assert [e["state"] for e in status["pipelines"]] == ["Ready", "Ready"], status["pipelines"]
    assert conditions(ns, NAME)["Degraded"]["status"] == "False"
    with port_forward(ns, *endpoint(replicated)) as base:
        assert set(wait_router_replicas(base, 2)) == {replica(good), replica(bad)}


# ---- deletion -----------------------------------------------------------------------------------

def test_deleting_the_mesh_mid_stream_drains_then_leaves_nothing_behind(settings: dict, replicated: dict) -> None:
    """`kubectl delete imesh` while streams run on both pipelines: every stream completes, each
    frontend pod goes before its stages and the router start going (the garbage collector's order:
    they are also owned by the frontend pods), and then nothing of the mesh is left."""
    ns = replicated["namespace"]
    selector = f"{LABEL_MESH}={NAME}"
    wait_settled(ns, NAME, settings["timeout"])
    kinds = {c["kind"] for c in get_json(CHILD_KINDS, "-n", ns, "-l", selector)["items"]}
    assert CHILD_KIND_NAMES <= kinds, kinds
    streams = 4
    with port_forward(ns, *endpoint(replicated)) as base:  # to the router's pod, which outlives the Service
        wait_router_replicas(base, 2)
        client = openai_client(base)
        with PodRecorder(ns, selector) as recorder:
            in_flight, results, errors = streams_during(base, client, streams, "the deletion",
                                                        lambda: delete_mesh(ns, NAME))
            wait_for(lambda: set(recorder.seen) <= set(recorder.gone), 300, "every pod of the mesh to be gone", 1)
    assert sum(in_flight.values()) > 0, f"no stream was in flight when the mesh was deleted: {in_flight}"
    assert not errors, f"{len(errors)} of {streams} streams failed: {errors[:3]}"
    assert all(text and finish in ("length", "stop") for text, finish in results), results
    labels = {n: p["metadata"]["labels"] for n, p in recorder.seen.items()}
    order = {n: (round(recorder.leaving(n), 1), round(recorder.gone[n], 1)) for n in labels}
    fronts = {n for n, lab in labels.items() if lab[LABEL_COMPONENT] == "frontend"}
    assert len(fronts) == REPLICAS, labels
    for n, lab in labels.items():
        if lab[LABEL_COMPONENT] == "stage":
            mine = [f for f in fronts if labels[f].get(LABEL_PIPELINE) == lab.get(LABEL_PIPELINE)]
            assert recorder.leaving(n) >= max(recorder.gone[f] for f in mine), f"{n} went before its frontend: {order}"
        elif lab[LABEL_COMPONENT] == "router":
            assert recorder.leaving(n) >= max(recorder.gone[f] for f in fronts), f"{n} went before a frontend: {order}"
    wait_for(lambda: not get_json(CHILD_KINDS, "-n", ns, "-l", selector)["items"], 240,
             "every object of the mesh to be collected")
    assert not kubectl("get", "inferencemesh", NAME, "-n", ns, "--ignore-not-found").strip()
