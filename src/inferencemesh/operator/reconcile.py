"""One reconcile of one InferenceMesh: read it, plan, converge its children, write its status.

Level-triggered and idempotent: each call recomputes the desired children (render.py) and the
status (status.py) from scratch and writes only what differs, so a second call on an unchanged
world writes nothing. Children carry a hash of their rendered content; a child is replaced only
when that hash changes (server-side defaults never cause churn). Every call returns its writes.
The caller (handlers.py) runs one reconcile of a mesh at a time.
"""

from __future__ import annotations

import base64
import datetime
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kubernetes.client.rest import ApiException

from inferencemesh.checkpoint.errors import CheckpointError
from inferencemesh.config import FRONTEND_PORT
from inferencemesh.operator import metrics
from inferencemesh.operator.events import Announcer, Event, action_events, probe_failures, transition_events
from inferencemesh.operator.frontend_probe import observed_strategy
from inferencemesh.operator.issuing import MeshCertificates, settle
from inferencemesh.operator.kube import Kube, Write
from inferencemesh.operator.modelfacts import ModelFacts, ModelUnavailable
from inferencemesh.operator.names import (
    HASH_ANNOTATION,
    LABEL_COMPONENT,
    LABEL_MESH,
    base_name,
    ca_secret_name,
    frontend_name,
    pipeline_prefix,
    tls_secret_name,
)
from inferencemesh.operator.observe import Observed, RestartWindow, pipeline_of, pipeline_windows
from inferencemesh.operator.pipelines import GRACE_SECONDS, PROGRESS_DEADLINE_SECONDS, Decision, Live, decide
from inferencemesh.operator.planning import Plan, make_plan
from inferencemesh.operator.render import (
    RenderOptions,
    certificate_subjects,
    pipeline_components,
    pipeline_revision,
    render_children,
)
from inferencemesh.operator.rollout import served_before
from inferencemesh.operator.spec import MeshSpec, SpecError, parse_spec, validate
from inferencemesh.operator.status import PlanOutcome, compute_status
from inferencemesh.operator.teardown import owner_references
from inferencemesh.planner import PlanError

log = logging.getLogger("inferencemesh.operator")
CHILD_KINDS = ("ConfigMap", "Service", "Deployment", "NetworkPolicy", "Secret", "ServiceAccount", "Role",
               "RoleBinding", "PodDisruptionBudget")
RETRY_SECONDS = 30.0
DRAIN_POLL_SECONDS = 5.0  # while a pipeline drains: when to look whether its frontend's pods are gone


class ChildConflict(RuntimeError):
    """A child's name is taken by an object this mesh does not own."""


class ChildRejected(RuntimeError):
    """The API server refuses a rendered child (e.g. hostile resources or tolerations): a spec problem."""


def _api_message(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body).get("message") or exc.reason)
    except (TypeError, ValueError, AttributeError):
        return str(exc.reason)


@dataclass
class Result:
    writes: list[Write] = field(default_factory=list)
    phase: str = ""
    # Reconcile again this many seconds from now (at the latest): the model could not be read yet,
    # or a certificate is due for renewal then.
    retry_after: float | None = None

    def again_within(self, seconds: float) -> None:
        self.retry_after = seconds if self.retry_after is None else min(self.retry_after, seconds)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _secret_data(secret: dict) -> dict[str, bytes]:
    """A Secret's data decoded; a value that is not base64 is left out (and so counts as missing)."""
    data = {}
    for key, value in (secret.get("data") or {}).items():
        try:
            data[key] = base64.b64decode(value, validate=True)
        except (ValueError, TypeError):
            continue
    return data


def _owned_by(obj: dict, uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or [])


def _ready_frontend_address(pods: list[dict], decision: Decision | None) -> str | None:
    """The pod IP of a ready frontend of a current pipeline: what the frontend says it runs is read there."""
    running = {i for i, on in (decision.keep if decision else {}).items() if on}
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        status = pod.get("status") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        labels = pod["metadata"].get("labels") or {}
        if (ready and labels.get(LABEL_COMPONENT) == "frontend" and pipeline_of(pod) in running
                and status.get("podIP")):
            return str(status["podIP"])
    return None


def _left_alone(base: str, decision: Decision, owned: dict[str, dict],
                live: dict[str, list[dict]]) -> tuple[set[tuple[str, str]], list[str]]:
    """The children a converge leaves alone, and the leaving components whose certificates stay.
    Pipelines of other revisions, and drained ones, keep their objects as they are (no spec renders
    them any more) and their certificates; a drained one loses its frontend."""
    leaving = set(decision.old) | set(decision.drain)
    components = []
    for i in sorted(leaving):
        components += [n for n, d in owned.items() if pipeline_of(d) == i]
        components.append(frontend_name(pipeline_prefix(base, i)))
    protected = {(kind, o["metadata"]["name"]) for kind, objs in live.items() for o in objs
                 if pipeline_of(o) in leaving
                 and not (pipeline_of(o) in decision.drain and kind == "Deployment"
                          and (o["metadata"].get("labels") or {}).get(LABEL_COMPONENT) == "frontend")}
    # Their pods mount these: kept even when the new revision brings its own Secret (mtlsSecretName).
    protected |= {("Secret", tls_secret_name(c)) for c in components}
    if components:
        protected.add(("Secret", ca_secret_name(base)))
    return protected, components


class Reconciler:
    def __init__(self, kube: Kube, facts: ModelFacts | None = None, options: RenderOptions | None = None,
                 observe: Callable[[str], tuple[str, str] | None] = observed_strategy) -> None:
        self.kube = kube
        self.facts = facts or ModelFacts()
        self.options = options or RenderOptions()
        self.observe = observe  # metrics URL -> the frontend's (strategy, reason)
        self.announcer = Announcer()  # the Ready/Degraded state each mesh was last announced in

    def reconcile(self, namespace: str, name: str) -> Result:
        """Converge one mesh; safe to call any number of times (blocking: API calls)."""
        start = time.monotonic()
        try:
            result = self._reconcile(namespace, name)
        except Exception as exc:
            metrics.RECONCILE_ERRORS.labels(type(exc).__name__).inc()
            metrics.RECONCILES.labels("error").inc()
            raise
        finally:
            metrics.RECONCILE_SECONDS.observe(time.monotonic() - start)
        metrics.RECONCILES.labels("changed" if result.writes else "unchanged").inc()
        for w in result.writes:
            metrics.WRITES.labels(w.verb, w.kind).inc()
        return result

    # -- the steps --------------------------------------------------------------------------

    def _reconcile(self, namespace: str, name: str) -> Result:
        mesh = self.kube.get("InferenceMesh", namespace, name)
        result = Result()
        if mesh is None or mesh["metadata"].get("deletionTimestamp"):
            return result  # owner references let the garbage collector remove the children
        try:
            spec: MeshSpec | None = parse_spec(mesh.get("spec") or {})
        except SpecError as exc:
            spec, outcome = None, PlanOutcome(None, "False", "InvalidSpec", str(exc))
        else:
            assert spec is not None  # parsed
            outcome = self._plan(spec, result)
        selector = f"{LABEL_MESH}={base_name(name)}"
        live = {kind: self.kube.list(kind, namespace, selector) for kind in CHILD_KINDS}
        pods = self.kube.list("Pod", namespace, selector)
        decision: Decision | None = None
        windows: dict[int, RestartWindow] | None = None
        revision = ""
        if spec is not None and outcome.plan is not None:
            revision = pipeline_revision(mesh, spec, outcome.plan, self.options)
            decision, windows, refused = self._run_pipelines(mesh, spec, outcome.plan, revision, live, pods, result)
            if refused is not None:
                outcome = refused
            else:
                live["Deployment"] = self.kube.list("Deployment", namespace, selector)
                pods = self.kube.list("Pod", namespace, selector)
        deployments = {d["metadata"]["name"]: d for d in live["Deployment"] if _owned_by(d, mesh["metadata"]["uid"])}
        self._hold_for_frontends(namespace, deployments, pods, result)
        speculative = None
        if outcome.plan is not None:
            address = _ready_frontend_address(pods, decision)
            if address is not None:
                speculative = self.observe(f"http://{address}:{FRONTEND_PORT}/metrics")
        now = _now()
        status = compute_status(mesh, spec, outcome, deployments, pods, now, observed_speculative=speculative,
                                decision=decision if outcome.plan is not None else None, windows=windows,
                                revision=revision, probe_messages=probe_failures(self.kube, namespace, pods))
        self._write_status(mesh, status, result)
        announced, due_in = self.announcer.events(f"{namespace}/{name}", mesh.get("status") or {}, status, now)
        for event in announced:
            self._post(mesh, event, result)
        if due_in is not None:
            result.again_within(due_in)
        result.phase = status["phase"]
        return result

    def _run_pipelines(self, mesh: dict, spec: MeshSpec, plan: Plan, revision: str, live: dict[str, list[dict]],
                       pods: list[dict], result: Result
                       ) -> tuple[Decision, dict[int, RestartWindow], PlanOutcome | None]:
        """Observe the pipelines, decide which run, converge the children: the decision, each pipeline
        against its restart budget, and the outcome that replaces the plan's when a child is refused."""
        base = base_name(mesh["metadata"]["name"])
        owned = {d["metadata"]["name"]: d for d in live["Deployment"] if _owned_by(d, mesh["metadata"]["uid"])}
        observed = Observed.of(mesh, owned, pods)
        now = _now()
        windows = pipeline_windows(mesh, spec, observed, now)
        previous = {e.get("index"): e for e in (mesh.get("status") or {}).get("pipelines") or [] if isinstance(e, dict)}
        lives = []
        for i, p in observed.pipelines.items():
            quiet = p.not_serving_for(now)
            # an old pipeline that never served is no blink: it serves nothing and never did
            never = p.revision != revision and not served_before(previous.get(i))
            lives.append(Live(i, p.revision, p.has_frontend, len(p.frontend_pods), p.serving, windows[i].failed,
                              stale=not p.serving and (quiet >= GRACE_SECONDS or never)))
            if p.has_frontend and not p.serving:  # look again when it turns stale, or its start runs late
                limit = GRACE_SECONDS if p.revision != revision else PROGRESS_DEADLINE_SECONDS
                if quiet < limit:
                    result.again_within(limit - quiet + 1)
        decision = decide(spec.replicas, revision, lives, spec.rollout.max_surge, spec.rollout.max_unavailable)
        actions = action_events(observed, decision, revision, spec.replicas)
        protected, leaving_components = _left_alone(base, decision, owned, live)
        components = [c for i in decision.keep for c in pipeline_components(plan, pipeline_prefix(base, i))]
        certificates = self._certificates(mesh, spec, list(dict.fromkeys(components + leaving_components)),
                                          live["Secret"], result)
        if decision.drain or decision.remove:  # the frontend's pods going: look again soon
            result.again_within(DRAIN_POLL_SECONDS)
        children = render_children(mesh, spec, plan, self.options, certificates, decision.keep, revision)
        try:
            self._converge(mesh, children, live, result, protected)
        except ChildConflict as exc:
            return decision, windows, PlanOutcome(None, "False", "ChildConflict", str(exc))
        except ChildRejected as exc:
            return decision, windows, PlanOutcome(None, "False", "InvalidChild", str(exc))
        for event in actions:
            self._post(mesh, event, result)
        return decision, windows, None

    def _plan(self, spec: MeshSpec, result: Result) -> PlanOutcome:
        errors = validate(spec)
        if errors:
            return PlanOutcome(None, "False", "InvalidSpec", "; ".join(errors))
        try:
            info = self.facts.info(spec)
            plan = make_plan(spec, info, self.facts)
        except ModelUnavailable as exc:
            result.retry_after = RETRY_SECONDS
            return PlanOutcome(None, "Unknown", "ModelUnavailable", f"{exc}; retrying every {RETRY_SECONDS:.0f}s")
        except CheckpointError as exc:
            return PlanOutcome(None, "False", "ModelUnreadable", str(exc))
        except PlanError as exc:
            return PlanOutcome(None, "False", "PlanFailed", str(exc))
        except (OSError, ValueError, KeyError, TypeError) as exc:  # a malformed checkpoint: permanent
            return PlanOutcome(None, "False", "ModelUnreadable", f"{type(exc).__name__}: {exc}")
        ranges = ", ".join(f"[{s.layer_start}, {s.layer_end})" for s in plan.stages)
        note = f"; {plan.note}" if plan.note else ""
        return PlanOutcome(plan, "True", "Planned",
                           f"{len(plan.stages)} stages, layers {ranges} ({info.source} model){note}")

    def _certificates(self, mesh: dict, spec: MeshSpec, components: list[str], secrets: list[dict],
                      result: Result) -> MeshCertificates | None:
        """The mesh's own certificates, read back from the Secrets it owns and renewed where due;
        None when the mesh brings its own Secret or runs without mutual TLS."""
        if not spec.issues_certificates:
            return None
        meta = mesh["metadata"]
        base = base_name(meta["name"])
        held = {s["metadata"]["name"]: _secret_data(s) for s in secrets if _owned_by(s, meta["uid"])}
        subjects = certificate_subjects(meta["namespace"], components)
        certificates = settle(held.get(ca_secret_name(base)), {c: held.get(tls_secret_name(c), {}) for c in subjects},
                              subjects, f"inferencemesh {base}", spec.security.lifetime)
        due_in = (certificates.renew_at - datetime.datetime.now(datetime.UTC)).total_seconds()
        result.again_within(max(1.0, due_in))
        return certificates

    def _converge(self, mesh: dict, desired: list[dict], live: dict[str, list[dict]], result: Result,
                  protected: frozenset[tuple[str, str]] | set[tuple[str, str]] = frozenset()) -> None:
        """Create and replace the desired children, delete the other owned ones except `protected`."""
        uid = mesh["metadata"]["uid"]
        ns = mesh["metadata"]["namespace"]
        # List items carry no kind of their own.
        by_key = {(kind, o["metadata"]["name"]): o for kind, objs in live.items() for o in objs}
        wanted = set()
        for obj in desired:
            kind, name = obj["kind"], obj["metadata"]["name"]
            wanted.add((kind, name))
            current = by_key.get((kind, name))
            if current is None:
                try:
                    self.kube.create(obj)
                    result.writes.append(Write("create", kind, name))
                    continue
                except ApiException as exc:
                    if exc.status in (400, 422):
                        raise ChildRejected(f"{kind} {name} rejected by the API server: {_api_message(exc)}") from exc
                    if exc.status != 409:
                        raise
                    current = self.kube.get(kind, ns, name)  # exists without our label
                    if current is None:
                        raise
            if not _owned_by(current, uid):
                raise ChildConflict(f"{kind} {name} already exists and is not owned by this InferenceMesh")
            have = (current["metadata"].get("annotations") or {}).get(HASH_ANNOTATION)
            if have == obj["metadata"]["annotations"][HASH_ANNOTATION]:
                continue
            update = dict(obj, metadata=dict(obj["metadata"], resourceVersion=current["metadata"]["resourceVersion"]))
            if kind == "Service":  # clusterIP is immutable once allocated
                update["spec"] = dict(obj["spec"], clusterIP=current["spec"].get("clusterIP"))
            try:
                self.kube.replace(update)
            except ApiException as exc:
                if exc.status in (400, 422):
                    raise ChildRejected(f"{kind} {name} rejected by the API server: {_api_message(exc)}") from exc
                raise
            result.writes.append(Write("replace", kind, name))
        for (kind, name), obj in by_key.items():
            if (kind, name) not in wanted and (kind, name) not in protected and _owned_by(obj, uid):
                self.kube.delete(kind, ns, name)
                result.writes.append(Write("delete", kind, name))

    def _hold_for_frontends(self, namespace: str, deployments: dict[str, dict], pods: list[dict],
                            result: Result) -> None:
        """Stages and the router also owned by the frontend pods they serve (teardown.py)."""
        for name, references in owner_references(list(deployments.values()), pods).items():
            patch = {"metadata": {"ownerReferences": references,
                                  "resourceVersion": deployments[name]["metadata"]["resourceVersion"]}}
            try:
                self.kube.patch("Deployment", namespace, name, patch)
            except ApiException as exc:
                # Gone, or changed since listed (404, 409): the next reconcile. Anything else costs only
                # the deletion order, never the serving pipelines: say so and go on.
                if exc.status not in (404, 409):
                    log.warning("could not point Deployment %s/%s at its frontend pods (%s: %s); deleting the "
                                "mesh may stop it before they drain", namespace, name, exc.status, _api_message(exc))
                continue
            result.writes.append(Write("patch", "Deployment", name))

    def _write_status(self, mesh: dict, status: dict, result: Result) -> None:
        old = mesh.get("status") or {}
        if old == status:
            return
        # A merge patch keeps keys it does not mention: null out the ones that went away.
        patch = {"status": {**{k: None for k in old if k not in status}, **status}}
        meta = mesh["metadata"]
        try:
            self.kube.patch_status("InferenceMesh", meta["namespace"], meta["name"], patch)
        except ApiException:
            log.error("status patch of %s/%s refused; patch was %s", meta["namespace"], meta["name"], json.dumps(patch))
            raise
        result.writes.append(Write("patch-status", "InferenceMesh", meta["name"]))
        for event in transition_events(old, status):
            self._post(mesh, event, result)

    def _post(self, mesh: dict, event: Event, result: Result) -> None:
        reason, kind, message = event
        self._event(mesh, reason, kind, message)
        result.writes.append(Write("event", "Event", reason))

    def _event(self, mesh: dict, reason: str, kind: str, message: str) -> None:
        meta = mesh["metadata"]
        # The operator's log tells the same story as the mesh's events, one line each.
        log.log(logging.WARNING if kind == "Warning" else logging.INFO, "%s/%s: %s: %s",
                meta["namespace"], meta["name"], reason, message)
        now = _now()
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{base_name(meta['name'])}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": mesh["apiVersion"], "kind": mesh["kind"], "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta["uid"]},
            "reason": reason, "message": message[:1024], "type": kind,
            "source": {"component": "inferencemesh-operator"},
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        try:
            self.kube.create(event)
        except ApiException as exc:  # events are best effort
            log.warning("could not post event %s: %s", reason, exc.reason)

