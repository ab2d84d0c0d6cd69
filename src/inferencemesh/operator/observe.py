"""What exists of a mesh: its children observed, grouped by pipeline, and each pipeline against
its restart budget.

Both the rollout decision (pipelines.decide, through reconcile.py) and the status (status.py)
read the world through this module: a pipeline is ready, draining, failing or Failed here, once.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass

from inferencemesh.operator.names import (
    LABEL_COMPONENT,
    LABEL_PIPELINE,
    LABEL_REVISION,
    LABEL_STAGE,
    RESET_RESTARTS_ANNOTATION,
    base_name,
    router_name,
)
from inferencemesh.operator.spec import MeshSpec

FAILING_WAIT_REASONS = {
    "CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "CreateContainerConfigError",
    "CreateContainerError", "InvalidImageName", "RunContainerError",
}


def deployment_ready(dep: dict | None) -> bool:
    """Up to date and every desired replica ready (0 desired counts as not ready: nothing serves)."""
    if not dep:
        return False
    want = int(dep.get("spec", {}).get("replicas", 1))
    st = dep.get("status") or {}
    return (
        want > 0
        and int(st.get("observedGeneration", 0)) >= int(dep["metadata"].get("generation", 0))
        and int(st.get("updatedReplicas", 0)) >= want
        and int(st.get("readyReplicas", 0)) >= want
    )


def not_ready_reason(pod: dict, probe_messages: dict[str, str] | None = None) -> str:
    """Why a pod is not ready, as its kubelet says: the last readiness probe failure (an Unhealthy
    event's message, from `probe_messages` by pod name), a waiting container's reason, a container
    that ended, an unschedulable pod; else its Ready condition's message or its phase."""
    st = pod.get("status") or {}
    name = pod["metadata"]["name"]
    problem = pod_problem(pod)
    if problem:
        return problem
    if probe_messages and probe_messages.get(name):
        return f"pod {name}: {probe_messages[name][:MESSAGE_HEAD]}"
    for cs in st.get("containerStatuses") or []:
        state = cs.get("state") or {}
        if state.get("waiting"):
            waiting = state["waiting"]
            text = str(waiting.get("reason") or "waiting")
            text += f": {waiting['message']}" if waiting.get("message") else ""
            return f"pod {name} container {cs.get('name', '?')}: {text[:MESSAGE_HEAD]}"
        if state.get("terminated"):
            return f"pod {name} container {cs.get('name', '?')} exited {state['terminated'].get('exitCode', '?')}"
    conditions = {c.get("type"): c for c in st.get("conditions") or []}
    scheduled = conditions.get("PodScheduled") or {}
    if scheduled.get("status") == "False":
        return f"pod {name} unschedulable: {scheduled.get('message') or scheduled.get('reason')}"
    ready = conditions.get("Ready") or {}
    if ready.get("status") == "False" and (ready.get("message") or ready.get("reason")):
        return f"pod {name} not ready: {ready.get('message') or ready.get('reason')}"
    return f"pod {name} is {st.get('phase', 'Pending')}" + (" and not ready" if st.get("phase") == "Running" else "")


def pod_is_ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def pod_problem(pod: dict) -> str | None:
    """Why a pod is failing, or None: what Degraded reports."""
    st = pod.get("status") or {}
    name = pod["metadata"]["name"]
    if st.get("phase") == "Failed":
        return f"pod {name} failed: {st.get('reason') or st.get('message') or 'Failed'}"
    for cs in st.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in FAILING_WAIT_REASONS:
            return f"pod {name}: {waiting['reason']} (restarts {cs.get('restartCount', 0)})"
        last = (cs.get("lastState") or {}).get("terminated") or {}
        if last.get("reason") == "OOMKilled" and not cs.get("ready"):
            return f"pod {name}: OOMKilled (restarts {cs.get('restartCount', 0)})"
    return None


@dataclass(frozen=True)
class PipelineObserved:
    """One pipeline's children as they exist."""

    index: int
    revision: str
    deployments: dict[str, dict]  # by name
    frontend_pods: list[dict]
    stage_pods: dict[str, list[dict]]  # by stage index (the label's text)

    def _frontend_deployment(self) -> dict | None:
        return next((d for d in self.deployments.values() if _component(d) == "frontend"), None)

    @property
    def has_frontend(self) -> bool:
        """Its frontend Deployment exists and is not being deleted (not drained)."""
        dep = self._frontend_deployment()
        return dep is not None and not dep["metadata"].get("deletionTimestamp")

    @property
    def frontend_ready(self) -> bool:
        return deployment_ready(self._frontend_deployment())

    @property
    def serving(self) -> bool:
        """Its frontend is ready: whose /ready needs every stage SERVING, so the router routes to it.
        What a rollout counts (a stage pod's own probe blinking does not stop it serving)."""
        return self.has_frontend and self.frontend_ready

    @property
    def created(self) -> str:
        """When its frontend Deployment was created ("" when it has none)."""
        dep = self._frontend_deployment()
        return str(dep["metadata"].get("creationTimestamp") or "") if dep else ""

    def not_serving_for(self, now: str) -> float:
        """Seconds since its frontend last stopped serving (0 while it serves): since its frontend pod's
        Ready condition last turned False (the kubelet keeps that time), else since the pod was created;
        without a pod, since its Deployment turned unavailable (else was created); unknown times count
        as now (a pipeline is never presumed dead)."""
        if self.serving:
            return 0.0
        live = [p for p in self.frontend_pods if not p["metadata"].get("deletionTimestamp")]
        times = []
        for pod in live:
            ready = next((c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"),
                         None)
            times.append(str((ready or {}).get("lastTransitionTime") or pod["metadata"].get("creationTimestamp") or ""))
        if not live:  # between pods (evicted, replaced): since the Deployment stopped being available
            dep = self._frontend_deployment() or {"metadata": {}}
            available = next((c for c in (dep.get("status") or {}).get("conditions") or []
                              if c.get("type") == "Available" and c.get("status") == "False"), None)
            times.append(str((available or {}).get("lastTransitionTime") or self.created))
        seconds = [seconds_between(t, now) for t in times if t]
        return max(0.0, min((s for s in seconds if s != float("inf")), default=0.0))

    @property
    def ready(self) -> bool:
        """Serving: its frontend is ready (whose /ready needs every stage SERVING) and so is every stage pod."""
        return self.frontend_ready and all(deployment_ready(d) for d in self.deployments.values())

    @property
    def pods(self) -> list[dict]:
        return self.frontend_pods + [p for pods in self.stage_pods.values() for p in pods]

    @property
    def restarts(self) -> int:
        return sum(int(cs.get("restartCount", 0)) for pod in self.pods
                   for cs in (pod.get("status") or {}).get("containerStatuses") or [])

    def crash_report(self) -> str:
        """The head of the termination message of the container that restarted most (the latest
        such crash on a tie), naming its pod ("" if no container has ended)."""
        crashes = []
        for pod in self.pods:
            for cs in (pod.get("status") or {}).get("containerStatuses") or []:
                ended = (cs.get("lastState") or {}).get("terminated") or (cs.get("state") or {}).get("terminated")
                if ended:
                    crashes.append((int(cs.get("restartCount", 0)), str(ended.get("finishedAt") or ""),
                                    pod["metadata"]["name"], ended))
        if not crashes:
            return ""
        _, _, name, ended = max(crashes, key=lambda c: c[:3])
        text = (ended.get("message") or "").strip()
        head = text.splitlines()[0][:MESSAGE_HEAD] if text else ended.get("reason") or "terminated"
        return f"pod {name} exited {ended.get('exitCode', '?')}: {head}"


MESSAGE_HEAD = 240  # characters of a termination message quoted in the status


def _component(obj: dict) -> str:
    return (obj["metadata"].get("labels") or {}).get(LABEL_COMPONENT, "")


def pipeline_of(obj: dict) -> int | None:
    """The pipeline a stage or frontend child belongs to (its pipeline label); None for others."""
    labels = obj["metadata"].get("labels") or {}
    if labels.get(LABEL_COMPONENT) not in ("stage", "frontend"):
        return None
    text = labels.get(LABEL_PIPELINE)
    return int(text) if text is not None and text.isdigit() else None


def observe_pipelines(deployments: list[dict], pods: list[dict]) -> dict[int, PipelineObserved]:
    """The mesh's pipelines, from its Deployments and pods (a pipeline exists while any of them does)."""
    found: dict[int, PipelineObserved] = {}

    def entry(obj: dict) -> PipelineObserved | None:
        index = pipeline_of(obj)
        if index is None:
            return None
        if index not in found:
            revision = (obj["metadata"].get("labels") or {}).get(LABEL_REVISION, "")
            found[index] = PipelineObserved(index, revision, {}, [], {})
        return found[index]

    for dep in deployments:
        pipeline = entry(dep)
        if pipeline is not None:
            pipeline.deployments[dep["metadata"]["name"]] = dep
            if _component(dep) == "frontend" or not pipeline.revision:
                found[pipeline.index] = dataclasses.replace(
                    pipeline, revision=(dep["metadata"].get("labels") or {}).get(LABEL_REVISION, pipeline.revision))
    for pod in pods:
        pipeline = entry(pod)
        if pipeline is None:
            continue
        if _component(pod) == "frontend":
            pipeline.frontend_pods.append(pod)
        else:
            pipeline.stage_pods.setdefault((pod["metadata"].get("labels") or {}).get(LABEL_STAGE, ""), []).append(pod)
    return found


@dataclass(frozen=True)
class RestartWindow:
    """A pipeline's restart budget: the window's start and its pods' restart count then."""

    start: str
    restarts_at_start: int
    failed: bool


def restart_window(previous: dict | None, restarts: int, now: str, window_seconds: int, budget: int,
                   reset: bool) -> RestartWindow:
    """Where a pipeline stands against its budget (previous: its status.pipelines entry).

    Windows are consecutive (a window ends window_seconds after it started and the next begins at
    the count then): restarts straddling two windows may each stay within budget. Failed is kept
    until `reset` (a spec change or the reset annotation): the pipeline stays for debugging.
    """
    if previous is None or reset or "windowStart" not in previous:
        return RestartWindow(now, restarts, False)
    start, at_start = str(previous["windowStart"]), int(previous.get("windowRestarts", 0))
    if previous.get("state") == "Failed":
        return RestartWindow(start, at_start, True)
    if restarts < at_start:  # a pod was replaced: its count started again
        at_start = restarts
    if seconds_between(start, now) > window_seconds:
        return RestartWindow(now, restarts, False)
    return RestartWindow(start, at_start, restarts - at_start > budget)


def seconds_between(earlier: str, later: str) -> float:
    parse = lambda t: datetime.datetime.strptime(t, "%Y-%m-%dT%H:%M:%SZ")  # noqa: E731 - one use
    try:
        return (parse(later) - parse(earlier)).total_seconds()
    except ValueError:
        return float("inf")


@dataclass(frozen=True)
class Observed:
    """A mesh's children as they are: its pipelines, its router and what fails among its pods."""

    base: str
    namespace: str
    pipelines: dict[int, PipelineObserved]
    router: dict | None  # the router's Deployment
    problems: list[str]  # pod_problem of every pod of the mesh

    @classmethod
    def of(cls, mesh: dict, deployments: dict[str, dict], pods: list[dict]) -> Observed:
        """deployments: the mesh's own, by name; pods: every pod carrying the mesh label."""
        meta = mesh["metadata"]
        base = base_name(meta["name"])
        problems = [p for p in (pod_problem(pod) for pod in pods) if p]
        return cls(base, meta["namespace"], observe_pipelines(list(deployments.values()), pods),
                   deployments.get(router_name(base)), problems)


def pipeline_windows(mesh: dict, spec: MeshSpec, obs: Observed, now: str) -> dict[int, RestartWindow]:
    """Each pipeline against its restart budget. It starts afresh on a spec change (a new generation)
    and when the mesh's RESET_RESTARTS_ANNOTATION takes a new value."""
    old_status = mesh.get("status") or {}
    previous = {int(p.get("index", -2)): p for p in old_status.get("pipelines") or [] if isinstance(p, dict)}
    reset = (int(old_status.get("observedGeneration", -1)) != int(mesh["metadata"].get("generation", 0))
             or reset_value(mesh) != old_status.get("restartsReset", ""))
    budget = spec.restart_budget
    return {index: restart_window(previous.get(index), p.restarts, now, budget.window_seconds, budget.restarts, reset)
            for index, p in obs.pipelines.items()}


def reset_value(mesh: dict) -> str:
    """The mesh's RESET_RESTARTS_ANNOTATION ("" when absent)."""
    return str((mesh["metadata"].get("annotations") or {}).get(RESET_RESTARTS_ANNOTATION, ""))
