"""Pure status computation: plan outcome + observed children -> the InferenceMesh status.

Conditions (each with reason and message), over the pipelines of the current revision unless said:
  Planned        True once layer ranges exist; False for an impossible spec (terminal until edited);
                 Unknown while the model cannot be read yet (retried).
  StagesReady    every stage Deployment of every pipeline has its up-to-date pod ready (a first stage
                 embedded in the frontend is ready when the frontend is: it has no Deployment of its own);
                 a stage that is not says why (its readiness probe's last failure, a waiting container).
  FrontendReady  every pipeline's frontend is ready (its /ready needs every stage SERVING) and so is
                 the router.
  Available      serving capacity against spec.replicas: pipelines of any revision whose frontend
                 serves ("2/2 pipelines serving").
  Progressing    the rollout: True while it replaces or starts pipelines ("rolling to revision abc: 1/2
                 pipelines replaced"), False with ProgressDeadlineExceeded when a new pipeline has not
                 served PROGRESS_DEADLINE_SECONDS after it started (and why), False/Complete when done.
  Ready          Planned and StagesReady and FrontendReady, with spec.replicas pipelines serving.
  Degraded       a pipeline Failed (its pods restarted beyond the budget: the head of the crash's
                 termination message), a pod of the mesh is failing (crash loop, image pull, OOM,
                 failed), or fewer pipelines serve than spec.replicas beyond those starting for the
                 first time (a pipeline that served and stopped, a start past its deadline).
status.pipelines has one entry per pipeline (Ready: serving; Progressing: never served yet; Degraded:
served and stopped, or failing pods; Failed, Outdated, Draining) with its restart window;
status.replicas and status.selector serve the /scale subresource. lastTransitionTime only moves when
a condition's status changes, so recomputing an unchanged world yields an identical status and the
operator writes nothing. Conditions follow the world at once; the Events that announce a change
wait until it has lasted (events.py).

Each condition is decided by one function (planned_condition, stages_condition, frontend_condition,
ready_condition, degraded_condition; rollout.py: available_condition, progressing_condition) from the
plan outcome and the children as observe.py sees them; compute_status puts them together.
"""

from __future__ import annotations

from dataclasses import dataclass

from inferencemesh.operator.names import (
    endpoint_url,
    frontend_name,
    frontends_selector,
    pipeline_prefix,
    selector_text,
    stage_address,
    stage_name,
)
from inferencemesh.operator.observe import (
    Observed,
    PipelineObserved,
    RestartWindow,
    deployment_ready,
    not_ready_reason,
    pod_is_ready,
    pod_problem,
    reset_value,
)
from inferencemesh.operator.pipelines import Decision
from inferencemesh.operator.planning import Plan
from inferencemesh.operator.rollout import (
    Capacity,
    Verdict,
    available_condition,
    capacity,
    capacity_problem,
    progressing_condition,
    served_before,
    why_not_serving,
)
from inferencemesh.operator.spec import MeshSpec
from inferencemesh.speculation import SpeculativeChoice

CONDITION_TYPES = ("Planned", "StagesReady", "FrontendReady", "Available", "Progressing", "Ready", "Degraded")


@dataclass(frozen=True)
class PlanOutcome:
    plan: Plan | None = None
    planned_status: str = "True"  # "True" | "False" | "Unknown"
    reason: str = "Planned"
    message: str = ""


def _pending_reason(pods: list[dict], probe_messages: dict[str, str] | None = None) -> str:
    """Why the pods of a component are not ready: the newest one that is not, in its kubelet's words."""
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")] or pods
    waiting = [p for p in live if not pod_is_ready(p)] or live
    pod = _newest(waiting)
    return not_ready_reason(pod, probe_messages) if pod else "no pod yet"


def _newest(pods: list[dict]) -> dict | None:
    return max(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "", default=None)


def _condition(ctype: str, verdict: Verdict, generation: int, previous: dict[str, dict], now: str) -> dict:
    """A condition object; its lastTransitionTime moves only when its status does."""
    old = previous.get(ctype)
    changed = old is None or old.get("status") != verdict.status
    return {
        "type": ctype,
        "status": verdict.status,
        "reason": verdict.reason,
        "message": verdict.message,
        "lastTransitionTime": now if changed or old is None else old.get("lastTransitionTime", now),
        "observedGeneration": generation,
    }


def stage_entries(obs: Observed, plan: Plan, current: list[PipelineObserved],
                  probe_messages: dict[str, str] | None = None) -> tuple[list[dict], list[str]]:
    """status.stages for a plan (ready: in every current pipeline; pod and address: the first one's),
    and a short account of each stage that is not ready somewhere."""
    entries, not_ready = [], []
    for s in plan.stages:
        embedded = plan.embedded_first_stage and s.index == 0
        readies, pods = [], []
        for pipeline in current:
            # The embedded first stage lives and is ready in the frontend's pod (whose /ready needs it SERVING).
            mine = pipeline.frontend_pods if embedded else pipeline.stage_pods.get(str(s.index), [])
            name = frontend_name(pipeline_prefix(obs.base, pipeline.index)) if embedded else \
                stage_name(pipeline_prefix(obs.base, pipeline.index), s.index)
            ready = deployment_ready(pipeline.deployments.get(name))
            readies.append(ready)
            pods.append(mine)
            if not ready:
                where = "in the frontend: " if embedded else ""
                not_ready.append(f"pipeline {pipeline.index} stage {s.index} ({where}"
                                 f"{_pending_reason(mine, probe_messages)})")
        first = current[0] if current else None
        newest = _newest(pods[0]) if pods else None
        entry = {
            "index": s.index, "layerStart": s.layer_start, "layerEnd": s.layer_end,
            "layers": f"{s.layer_start}:{s.layer_end}", "plannedBytes": s.total_bytes,
            **({"memoryBytes": s.memory_bytes} if s.memory_bytes else {}),
            "ready": bool(readies) and all(readies),
            # No pod: leave the key out. An empty string here made kube-apiserver 1.20's merge patch
            # store null and refuse the whole status (seen, and reproduced, in the cluster tests).
            **({"pod": newest["metadata"]["name"]} if newest else {}),
        }
        if embedded:
            entry["embedded"] = True
        elif first is not None:
            entry["address"] = stage_address(pipeline_prefix(obs.base, first.index), obs.namespace, s.index)
        entries.append(entry)
    return entries, not_ready


def planned_condition(outcome: PlanOutcome) -> Verdict:
    return Verdict(outcome.planned_status, outcome.reason, outcome.message)


def stages_condition(outcome: PlanOutcome, entries: list[dict], not_ready: list[str], replicas: int) -> Verdict:
    """entries: status.stages (without a plan, the last known ones)."""
    if outcome.plan is None:
        return Verdict("Unknown" if not entries else "False", "NotPlanned", "no plan: " + outcome.message)
    if replicas == 0:
        return Verdict("False", "ScaledToZero", "spec.replicas is 0")
    n = len(outcome.plan.stages)
    if not not_ready and entries and all(e["ready"] for e in entries):
        return Verdict("True", "AllStagesReady", f"{n} of {n} stages ready in every pipeline")
    return Verdict("False", "StagesNotReady", "; ".join(not_ready[:4]) or "no pipeline yet")


def frontend_condition(obs: Observed, current: list[PipelineObserved], replicas: int,
                       probe_messages: dict[str, str] | None = None) -> Verdict:
    if replicas == 0:
        return Verdict("False", "ScaledToZero", "spec.replicas is 0")
    missing = [p for p in current if not p.frontend_ready]
    if not current:
        return Verdict("False", "NoFrontend", "no pipeline's frontend exists yet")
    if missing:
        p = missing[0]
        return Verdict("False", "FrontendNotReady",
                       f"pipeline {p.index}'s frontend not ready: " + _pending_reason(p.frontend_pods, probe_messages))
    if not deployment_ready(obs.router):
        return Verdict("False", "RouterNotReady", "the router is not ready")
    return Verdict("True", "FrontendReady", "every pipeline's frontend answers /ready, and the router routes to them")


def ready_condition(planned: Verdict, stages: Verdict, frontend: Verdict, ready: int, replicas: int) -> Verdict:
    """Ready when the other three are and spec.replicas pipelines serve; else the first that is not says why."""
    first = next((v for v in (planned, stages, frontend) if v.status != "True"), None)
    if first is not None:
        return Verdict("False", first.reason, first.message)
    if ready < replicas:
        return Verdict("False", "PipelinesNotReady", f"{ready} of {replicas} pipelines ready")
    return Verdict("True", "Ready", f"the OpenAI endpoint is serving ({ready} pipelines)")


def degraded_condition(obs: Observed, failed: list[str], cap: Capacity | None) -> Verdict:
    """A pipeline failed, a pod failing, or fewer pipelines serving than asked beyond those starting
    for the first time (cap: None without a plan)."""
    if failed:
        return Verdict("True", "PipelineFailed", "; ".join(failed[:2]))
    if obs.problems:
        return Verdict("True", "PodsFailing", "; ".join(obs.problems[:4]))
    short = capacity_problem(cap) if cap is not None else None
    if short:
        return Verdict("True", "CapacityBelowDesired", short)
    return Verdict("False", "AsExpected", "no pod of the mesh is failing and every pipeline asked for serves "
                                          "or is starting")


def phase_of(outcome: PlanOutcome, ready: Verdict, degraded: Verdict) -> str:
    if outcome.planned_status == "False":
        return "Failed"
    if outcome.planned_status == "Unknown":
        return "Pending"
    if degraded.status == "True":
        return "Degraded"
    return "Ready" if ready.status == "True" else "Progressing"


def speculative_status(planned: SpeculativeChoice, observed: tuple[str, str] | None) -> dict:
    """What the frontend runs: its own report when there is one, else the plan's prediction."""
    if observed is None:
        return {"strategy": planned.strategy, "reason": planned.reason, "message": planned.message}
    strategy, reason = observed
    if (strategy, reason) == (planned.strategy, planned.reason):
        return {"strategy": strategy, "reason": reason, "message": planned.message + " (the frontend runs it)"}
    return {"strategy": strategy, "reason": reason,
            "message": f"the frontend runs {strategy} ({reason}); planned was {planned.strategy}: {planned.message}"}


def _pipeline_entry(obs: Observed, index: int, decision: Decision, window: RestartWindow | None,
                    budget_text: str, previous: dict | None, probe_messages: dict[str, str] | None) -> dict:
    p = obs.pipelines.get(index) or PipelineObserved(index, "", {}, [], {})
    problems = [m for m in (pod_problem(pod) for pod in p.pods) if m]
    if window is not None and window.failed:
        state, message = "Failed", f"{p.restarts - window.restarts_at_start} restarts {budget_text}; " \
            + (p.crash_report() or "no termination message") + "; kept for debugging, nothing routes to it"
    elif index in decision.drain or (index in obs.pipelines and not p.has_frontend and index not in decision.keep):
        state, message = "Draining", "its frontend finishes its requests; its stages go after it"
    elif index in decision.old:
        state, message = "Outdated", "an older revision, serving until a new pipeline serves" if p.serving \
            else "an older revision, not serving: " + why_not_serving(p, probe_messages)
    elif problems:  # serving or not: a failing pod is worth saying first
        state, message = "Degraded", "; ".join(problems[:2])
    elif p.serving:
        state, message = "Ready", "serving"
    elif served_before(previous):
        state, message = "Degraded", "served, and does not now: " + why_not_serving(p, probe_messages)
    else:
        state, message = "Progressing", why_not_serving(p, probe_messages) if p.deployments else "starting"
    entry = {"index": index, "name": pipeline_prefix(obs.base, index),
             # A pipeline with no object yet has no revision: leave the key out, never "" (kube-apiserver
             # 1.20's merge patch stores "" as null and refuses the whole status: see stage_entries).
             **({"revision": p.revision} if p.revision else {}),
             "state": state, "ready": p.serving and state not in ("Failed", "Draining"),
             "message": message, "restarts": p.restarts}
    if window is not None:
        entry |= {"windowStart": window.start, "windowRestarts": window.restarts_at_start}
    return entry


def _verdicts(obs: Observed, outcome: PlanOutcome, cap: Capacity | None, decision: Decision, stages: Verdict,
              frontend: Verdict, ready_count: int, replicas: int, failed: list[str]) -> dict[str, Verdict]:
    """Every condition's verdict, by type (cap: None without a plan)."""
    planned = planned_condition(outcome)
    unplanned = Verdict("Unknown" if outcome.planned_status == "Unknown" else "False", "NotPlanned",
                        "no plan: " + outcome.message)
    return {
        "Planned": planned, "StagesReady": stages, "FrontendReady": frontend,
        "Available": available_condition(cap) if cap is not None else unplanned,
        "Progressing": progressing_condition(cap, obs, decision) if cap is not None else unplanned,
        "Ready": ready_condition(planned, stages, frontend, ready_count, replicas),
        "Degraded": degraded_condition(obs, failed, cap),
    }


def compute_status(mesh: dict, spec: MeshSpec | None, outcome: PlanOutcome, deployments: dict[str, dict],
                   pods: list[dict], now: str, observed_speculative: tuple[str, str] | None = None,
                   decision: Decision | None = None, windows: dict[int, RestartWindow] | None = None,
                   revision: str = "", probe_messages: dict[str, str] | None = None) -> dict:
    """The whole status object. deployments: by name; pods: every pod carrying the mesh label;
    spec: None when it does not parse (then outcome says why and there is no plan);
    decision: the pipelines the reconciler runs (pipelines.decide; default: the existing ones);
    windows: each pipeline against its restart budget (pipeline_windows); revision: the current one;
    probe_messages: the last readiness probe failure of a pod, by name; observed_speculative: the
    (strategy, reason) a running frontend reports, if it could be read."""
    obs, windows = Observed.of(mesh, deployments, pods), windows or {}
    if decision is None:
        decision = Decision(keep={i: True for i, p in obs.pipelines.items() if p.has_frontend})
    generation = int(mesh["metadata"].get("generation", 0))
    old_status = mesh.get("status") or {}
    previous = {str(c.get("type")): c for c in old_status.get("conditions") or [] if isinstance(c, dict)}
    before = {int(e.get("index", -1)): e for e in old_status.get("pipelines") or [] if isinstance(e, dict)}
    plan = outcome.plan
    replicas = spec.replicas if spec is not None else len(decision.keep)

    current = [obs.pipelines.get(i) or PipelineObserved(i, "", {}, [], {})
               for i, running in sorted(decision.keep.items()) if running and not (i in windows and windows[i].failed)]
    entries, not_ready = stage_entries(obs, plan, current, probe_messages) if plan is not None \
        else (old_status.get("stages") or [], [])
    status: dict = {"observedGeneration": generation, "stages": entries}
    if plan is not None:
        n = len(plan.stages)
        ready_stages = min((n - sum(1 for m in not_ready if m.startswith(f"pipeline {p.index} ")) for p in current),
                           default=0)
        status["stagesSummary"] = f"{ready_stages}/{n}"
    budget_text = "" if spec is None else \
        f"in {spec.restart_budget.window_seconds}s (budget {spec.restart_budget.restarts})"
    indexes = sorted((set(obs.pipelines) | set(decision.keep)) - set(decision.remove))
    status["pipelines"] = [_pipeline_entry(obs, i, decision, windows.get(i), budget_text, before.get(i),
                                           probe_messages) for i in indexes]
    failed = [f"pipeline {e['index']} failed: {e['message']}" for e in status["pipelines"] if e["state"] == "Failed"]
    ready_count = sum(p.serving for p in current)
    status["replicas"] = ready_count
    status["selector"] = selector_text(frontends_selector(obs.base))
    status["pipelinesSummary"] = f"{ready_count}/{replicas}" + (f" ({len(failed)} failed)" if failed else "")
    if reset_value(mesh):  # never "": kube-apiserver 1.20's merge patch stores it as null (see stage_entries)
        status["restartsReset"] = reset_value(mesh)

    cap = capacity(obs, decision, windows, before, replicas, revision or "?", now, probe_messages) \
        if plan is not None else None
    stages = stages_condition(outcome, entries, not_ready, replicas)
    frontend = frontend_condition(obs, current, replicas, probe_messages)
    verdicts = _verdicts(obs, outcome, cap, decision, stages, frontend, ready_count, replicas, failed)
    status["conditions"] = [_condition(t, v, generation, previous, now) for t, v in verdicts.items()]
    status["phase"] = phase_of(outcome, verdicts["Ready"], verdicts["Degraded"])

    if plan is not None and spec is not None:
        status["planHash"] = plan.hash
        status["speculative"] = speculative_status(plan.speculative, observed_speculative)
        status["endpoint"] = endpoint_url(obs.base, obs.namespace, spec)
    else:
        for key in ("planHash", "speculative", "endpoint", "stagesSummary"):
            if key in old_status:
                status[key] = old_status[key]
    return status
