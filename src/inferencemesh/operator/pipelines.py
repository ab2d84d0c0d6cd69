"""Which pipelines a mesh runs, as a pure decision: spec.replicas, the current revision and the
pipelines that exist -> the pipelines to keep, to start, to drain and to remove.

A pipeline is the unit of scale: a frontend and its own stages, identified by an index (its
objects' prefix `<base>-p<k>`) and the revision it runs (a hash of its rendered objects: a new
model, image or plan is a new revision). A pipeline **serves** while its frontend is ready (the
frontend's /ready needs every stage SERVING, so the router routes to it). The rules, each a
guarantee a user can see:

- **A floor while replacing.** A rollout keeps at least `replicas - maxUnavailable` pipelines
  serving (maxUnavailable: spec.rollout, 0 by default; at least 1 with maxSurge 0, else nothing
  could start) and at most `replicas + maxSurge` with a frontend. An old pipeline drains only
  while the serving pipelines without it still reach the floor: with the defaults a new pipeline
  serves before an old one drains, one at a time. The last serving pipeline never drains while a
  surge could replace it first.
- **A blink drains nothing.** An old pipeline that does not serve now (a probe timed out, a
  stage restarted) is kept as long as it served within GRACE_SECONDS (the caller says which are
  `stale`); only a Failed or stale one drains without regard to the floor (it serves nothing).
- **A stuck rollout stops where it is:** a new pipeline that never serves holds the surge, so no
  further old pipeline drains and the old ones keep serving (the status says why after
  PROGRESS_DEADLINE_SECONDS).
- **Scale-down drains the least useful first:** failed, then not serving, then the highest index.
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
# An old pipeline not serving for this long is dead, not blinking: it may drain regardless of the floor.
GRACE_SECONDS = 60.0
# A new pipeline not serving this long after its creation stops the rollout (Progressing=False).
PROGRESS_DEADLINE_SECONDS = 600.0


@dataclass(frozen=True)
class Live:
    """A pipeline as it exists: what the reconciler observed of it."""

    index: int
    revision: str
    has_frontend: bool  # its frontend Deployment exists (not being deleted)
    frontend_pods: int  # frontend pods still there (terminating ones included)
    ready: bool  # serving: its frontend is ready
    failed: bool = False
    stale: bool = False  # not serving, and not for GRACE_SECONDS (or never served)

    @property
    def serving(self) -> bool:
        return self.ready and not self.failed


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


def _drain_order(p: Live) -> tuple[bool, bool, bool, int]:
    # failed first, then stale, then not serving, then the highest index
    return (not p.failed, not p.stale, p.serving, -p.index)


def floor_of(replicas: int, max_surge: int, max_unavailable: int) -> int:
    """The fewest serving pipelines a rollout may leave: replicas - maxUnavailable, where maxUnavailable
    is at least 1 without a surge (else no old pipeline could make room for a new one)."""
    unavailable = max(max_unavailable, 0 if max_surge else 1)
    return max(0, replicas - unavailable)


def decide(replicas: int, revision: str, live: list[Live], max_surge: int = MAX_SURGE,
           max_unavailable: int = 0) -> Decision:
    """The pipelines to run for `replicas` pipelines of `revision`, given the `live` ones; at most
    `max_surge` pipelines beyond `replicas` and at most `max_unavailable` serving fewer while old
    ones are replaced (see the module docstring)."""
    decision = Decision()
    going = [p for p in live if not p.has_frontend]  # drained already: remove once the frontend pods are gone
    decision.remove = sorted(p.index for p in going if p.frontend_pods == 0)
    decision.drain = [p.index for p in going if p.frontend_pods > 0]
    fronted = [p for p in live if p.has_frontend]
    current = sorted((p for p in fronted if p.revision == revision), key=_drain_order)
    old = sorted((p for p in fronted if p.revision != revision), key=_drain_order)

    # Scale-down: the current pipelines beyond `replicas`, least useful first.
    while len(current) > replicas:
        decision.drain.append(current.pop(0).index)
    decision.old = _drain_old(replicas, current, old, max_surge, max_unavailable, decision.drain)
    keep_old = len(decision.old)

    # Start what is missing: all of it without old pipelines, else within the surge.
    taken = {p.index for p in live}
    missing = replicas - len(current)
    if keep_old:
        missing = min(missing, max(0, replicas + max_surge - len(current) - keep_old))
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


def _drain_old(replicas: int, current: list[Live], old: list[Live], max_surge: int, max_unavailable: int,
               drain: list[int]) -> list[int]:
    """Append to `drain` the old pipelines that go now; the old ones kept."""
    floor = floor_of(replicas, max_surge, max_unavailable)
    if max_surge and replicas:
        floor = max(floor, 1)  # never the last serving pipeline while a surge can replace it first
    serving = sum(p.serving for p in current + old)
    kept = []
    for p in old:
        if replicas == 0 or p.failed or (p.stale and not p.serving):
            drain.append(p.index)  # serves nothing, and not for a while
        elif p.serving and serving - 1 >= floor:
            drain.append(p.index)
            serving -= 1
        else:
            kept.append(p.index)  # serving and needed, or blinking: it may serve again
    return sorted(kept)
