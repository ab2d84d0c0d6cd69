"""The Events a mesh gets, as pure functions of what changed: (reason, Normal|Warning, message).

Three kinds, none of which can flap with a probe's blink:
- **Transitions of the status** that are facts, not moods: a plan (or its failure), a replan, a
  rollout starting, finishing or stopping at its deadline, a pipeline exhausting its restart budget.
- **Actions the reconciler takes:** a pipeline started (a scale-up, or a rollout's step), a pipeline
  drained (a scale-down, a replaced or dead old pipeline), from the decision it acts on.
- **Ready and Degraded, announced once they have lasted** SETTLE_SECONDS (a failing pod or a Failed
  pipeline at once: a crash is no blink). What was announced last is kept per mesh (Announcer),
  seeded from the status after an operator restart; conditions themselves follow the world at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kubernetes.client.rest import ApiException

from inferencemesh.operator.kube import Kube
from inferencemesh.operator.observe import Observed, pod_is_ready, seconds_between
from inferencemesh.operator.pipelines import Decision

log = logging.getLogger("inferencemesh.operator")
SETTLE_SECONDS = 20.0  # a Ready or Degraded change announced once it has lasted this long
AT_ONCE = ("PipelineFailed", "PodsFailing")  # Degraded reasons announced without waiting
Event = tuple[str, str, str]


def _conds(status: dict) -> dict[str, dict]:
    return {c["type"]: c for c in status.get("conditions") or [] if isinstance(c, dict) and "type" in c}


def transition_events(old: dict, new: dict) -> list[Event]:
    """Events for the facts that changed between two statuses (Ready and Degraded: Announcer)."""
    before, after = _conds(old), _conds(new)
    events: list[Event] = []
    b, a = before.get("Planned", {}), after.get("Planned", {})
    if (a.get("status"), a.get("reason")) != (b.get("status"), b.get("reason")):
        status, reason, message = a.get("status"), a.get("reason", ""), a.get("message", "")
        if status == "True":
            events.append(("Planned", "Normal", message))
        elif status == "False":
            events.append((reason or "PlanFailed", "Warning", message))
        elif status == "Unknown" and reason:  # e.g. the hub is unreachable: retried
            events.append((reason, "Warning", message))
    if old.get("planHash") and new.get("planHash") and old["planHash"] != new["planHash"]:
        events.append(("Replanned", "Normal", after.get("Planned", {}).get("message", "")))
    events += _rollout_events(before.get("Progressing", {}), after.get("Progressing", {}))
    was = {e.get("index"): e.get("state") for e in old.get("pipelines") or [] if isinstance(e, dict)}
    for entry in new.get("pipelines") or []:
        if entry.get("state") == "Failed" and was.get(entry.get("index")) != "Failed":
            events.append(("RestartBudgetExhausted", "Warning",
                           f"pipeline {entry.get('index')}: {entry.get('message', '')}"))
    return events


def _rollout_events(b: dict, a: dict) -> list[Event]:
    was, now, message = b.get("reason"), a.get("reason"), a.get("message", "")
    if now == was or not now:
        return []
    if now == "RollingOut":
        return [("RolloutStarted" if was != "ProgressDeadlineExceeded" else "RolloutResumed", "Normal", message)]
    if now == "ProgressDeadlineExceeded":
        return [("ProgressDeadlineExceeded", "Warning", message)]
    if now == "Complete" and was in ("RollingOut", "ProgressDeadlineExceeded"):
        return [("RolloutFinished", "Normal", message)]
    return []


def action_events(obs: Observed, decision: Decision, revision: str, replicas: int) -> list[Event]:
    """The pipelines a decision starts and drains now (each once: a drained pipeline has no frontend
    next time, a started one exists)."""
    events: list[Event] = []
    old_revisions = sorted({p.revision for i, p in obs.pipelines.items() if p.revision != revision and p.has_frontend})
    rolling = bool(decision.old) or any(i in decision.drain for i in obs.pipelines
                                        if obs.pipelines[i].revision != revision and obs.pipelines[i].has_frontend)
    for i in sorted(decision.keep):
        if i in obs.pipelines:
            continue
        if rolling:
            events.append(("PipelineStarted", "Normal", f"pipeline {i} started: revision {revision} replacing "
                                                        f"{', '.join(old_revisions)}"))
        else:
            events.append(("ScaledUp", "Normal", f"pipeline {i} started (revision {revision}): {replicas} wanted"))
    for i in decision.drain:
        p = obs.pipelines.get(i)
        if p is None or not p.has_frontend:
            continue  # drained before
        if p.revision == revision:
            events.append(("ScaledDown", "Normal", f"pipeline {i} draining: {replicas} wanted"))
        elif replicas == 0:
            events.append(("ScaledDown", "Normal", f"pipeline {i} (revision {p.revision}) draining: 0 wanted"))
        else:
            why = "serving" if p.serving else "not serving"
            events.append(("PipelineDrained", "Normal",
                           f"pipeline {i} (revision {p.revision}, {why}) draining: replaced by revision {revision}"))
    return events


def probe_failures(kube: Kube, namespace: str, pods: list[dict]) -> dict[str, str]:
    """The last readiness probe failure of each pod that is not ready, from its kubelet's Unhealthy
    Events (best effort: {} where the operator may not list Events)."""
    waiting = {p["metadata"]["name"] for p in pods
               if not pod_is_ready(p) and not p["metadata"].get("deletionTimestamp")}
    if not waiting:
        return {}
    try:
        events = kube.list("Event", namespace)
    except ApiException as exc:
        log.debug("no probe messages: Events not listed (%s)", exc.status)
        return {}
    found: dict[str, tuple[str, str]] = {}
    for ev in events:
        obj = ev.get("involvedObject") or {}
        message = str(ev.get("message") or "")
        if ev.get("reason") != "Unhealthy" or obj.get("kind") != "Pod" or obj.get("name") not in waiting \
                or not message.startswith("Readiness probe"):
            continue
        when = str(ev.get("lastTimestamp") or ev.get("eventTime") or "")
        if obj["name"] not in found or when >= found[obj["name"]][0]:
            found[obj["name"]] = (when, message.strip())
    return {name: message for name, (_, message) in found.items()}


def _state(status: dict) -> str:
    conds = _conds(status)
    if conds.get("Degraded", {}).get("status") == "True":
        return "Degraded"
    if conds.get("Ready", {}).get("status") == "True":
        return "Ready"
    return ""


@dataclass
class Announcer:
    """Ready and Degraded Events, once the state has lasted: the state each mesh was last announced in."""

    said: dict[str, str] = field(default_factory=dict)

    def events(self, key: str, old: dict, new: dict, now: str) -> tuple[list[Event], float | None]:
        """The Events due for mesh `key` going from status `old` to `new`, and in how many seconds to
        look again for one that is not due yet (None: nothing pending)."""
        if key not in self.said:
            self.said[key] = _state(old)  # after a restart: what the status showed was announced
        state, said = _state(new), self.said[key]
        if not state or state == said:
            return [], None
        conds = _conds(new)
        cond = conds[state]
        lasted = seconds_between(str(cond.get("lastTransitionTime", "")), now)
        if state == "Ready" and said == "Degraded":  # settled since Degraded cleared, whatever Ready did
            lasted = min(lasted, seconds_between(str(conds.get("Degraded", {}).get("lastTransitionTime", "")), now))
        if state == "Degraded" and cond.get("reason") not in AT_ONCE and lasted < SETTLE_SECONDS:
            return [], SETTLE_SECONDS - lasted + 0.5
        if state == "Ready" and said == "Degraded" and lasted < SETTLE_SECONDS:
            return [], SETTLE_SECONDS - lasted + 0.5
        self.said[key] = state
        message = str(cond.get("message", ""))
        if state == "Degraded":
            return [("Degraded", "Warning", message)], None
        return [("Recovered" if said == "Degraded" else "Ready", "Normal", message)], None

    def forget(self, key: str) -> None:
        self.said.pop(key, None)
