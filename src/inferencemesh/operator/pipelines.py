"""Which pipelines a mesh runs, as a pure decision: spec.replicas, the current revision and the
pipelines that exist -> the pipelines to keep, to start, to drain and to remove.

A pipeline is the unit of scale: a frontend and its own stages, identified by an index (its
objects' prefix `<base>-p<k>`) and the revision it runs (a hash of its rendered objects: a new
model, image or plan is a new revision). The rules, each a guarantee a user can see:

- **Never fewer ready than asked while replacing.** A rollout starts one pipeline of the new
  revision beside the old ones (a surge of one) and drains an old one only while the ready
  pipelines outnumber spec.replicas; so a new one is Ready before an old one drains. Where no
  spare capacity exists for a surge (every GPU taken), spec.rollout.maxSurge 0 drains one old
  pipeline first and starts its replacement in its place: one pipeline fewer while it loads.
- **Scale-down drains the least useful first:** failed, then not ready, then the highest index.
- **Drain, never drop.** A drained pipeline loses its frontend first (its pod turns unready, the
  router stops choosing it, it finishes what it serves: the frontend's own drain); its stages are
  removed only once no frontend pod of it is left, so in-flight requests can finish.
- **A Failed pipeline** (its pods restarted beyond the budget: observe.py) is kept for debugging with
  its frontend scaled to zero, so nothing routes to it, while the others serve. It still takes its
  place among spec.replicas (a replacement of the same revision would most likely fail alike): a
  spec change replaces it, a scale-down removes it first, a reset of the budget lifts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_SURGE = 1  # spec.rollout.maxSurge's default


@dataclass(frozen=True)
class Live:
    """A pipeline as it exists: what the reconciler observed of it."""

    index: int
    revision: str
    has_frontend: bool  # its frontend Deployment exists (not being deleted)
    frontend_pods: int  # frontend pods still there (terminating ones included)
    ready: bool
    failed: bool = False


@dataclass
class Decision:
    """keep: current-revision pipelines to render (index -> frontend runs: False when Failed);
    old: other live pipelines left as they are; drain: pipelines whose frontend is deleted now;
    remove: pipelines whose remaining objects are deleted now (no frontend pod is left)."""

    keep: dict[int, bool] = field(default_factory=dict)
    old: list[int] = field(default_factory=list)
    drain: list[int] = field(default_factory=list)
    remove: list[int] = field(default_factory=list)

    @property
    def draining(self) -> list[int]:
        """Pipelines on their way out (drained now or before), not yet removed."""
        return sorted(self.drain)


def _drain_order(p: Live) -> tuple[bool, bool, int]:
    return (not p.failed, p.ready, -p.index)  # failed first, then not ready, then the highest index


def decide(replicas: int, revision: str, live: list[Live], max_surge: int = MAX_SURGE) -> Decision:
    """The pipelines to run for `replicas` pipelines of `revision`, given the `live` ones; at most
    `max_surge` (0 or 1) pipelines beyond `replicas` while old ones are replaced."""
    decision = Decision()
    going = [p for p in live if not p.has_frontend]  # drained already: remove once the frontend pods are gone
    decision.remove = sorted(p.index for p in going if p.frontend_pods == 0)
    decision.drain = [p.index for p in going if p.frontend_pods > 0]
    serving = [p for p in live if p.has_frontend]
    current = sorted((p for p in serving if p.revision == revision), key=_drain_order)
    old = sorted((p for p in serving if p.revision != revision), key=_drain_order)

    # Scale-down: the current pipelines beyond `replicas`, least useful first.
    while len(current) > replicas:
        decision.drain.append(current.pop(0).index)
    ready = sum(p.ready and not p.failed for p in current + old)
    current_ready = sum(p.ready and not p.failed for p in current)
    # Old pipelines go while the ready ones outnumber `replicas` (without a surge: while they
    # reach it; a failed or unready old one serves nothing: it goes at once).
    keep_old = []
    for p in old:
        if p.failed or not p.ready or replicas == 0:
            decision.drain.append(p.index)
        elif ready > replicas - 1 + max_surge and (current_ready > 0 or not max_surge):
            decision.drain.append(p.index)
            ready -= 1
        else:
            keep_old.append(p)
    decision.old = sorted(p.index for p in keep_old)

    # Start what is missing: all of it without old pipelines, else one at a time (a surge of one).
    taken = {p.index for p in live}
    missing = replicas - len(current)
    if keep_old:
        missing = min(missing, max(0, replicas + max_surge - len(current) - len(keep_old)))
    # A pipeline of this revision without a frontend and without frontend pods is either drained or
    # not finished yet (a reconcile stopped between its stages and its frontend: a refused child, an
    # API error). Where one is missing it is taken up again, not removed and replaced under another
    # index: else a refused frontend makes every reconcile remove one pipeline's stages and create
    # another's (a hot loop).
    new: list[int] = [p.index for p in sorted(going, key=lambda p: p.index)
                      if p.frontend_pods == 0 and p.revision == revision][:max(0, missing)]
    decision.remove = [i for i in decision.remove if i not in new]
    candidate = 0
    while len(new) < missing:
        if candidate not in taken:
            new.append(candidate)
        candidate += 1
    decision.keep = {p.index: not p.failed for p in current}
    decision.keep.update({k: True for k in new})
    decision.drain = sorted(decision.drain)
    return decision
