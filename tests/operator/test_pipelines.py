"""pipelines.decide as a pure function: which pipelines a mesh keeps, starts, drains and removes."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from inferencemesh.operator.pipelines import Decision, Live, decide, floor_of


def live(index: int, revision: str = "r1", *, ready: bool = True, frontend: bool = True, pods: int = 1,
         failed: bool = False, stale: bool = False) -> Live:
    return Live(index, revision, frontend, pods if frontend or pods else 0, ready, failed, stale)


def test_a_fresh_mesh_starts_every_pipeline() -> None:
    assert decide(2, "r1", []) == Decision(keep={0: True, 1: True})
    assert decide(1, "r1", []) == Decision(keep={0: True})
    assert decide(0, "r1", []) == Decision()


def test_a_steady_mesh_changes_nothing() -> None:
    steady = [live(0), live(1)]
    assert decide(2, "r1", steady) == Decision(keep={0: True, 1: True})


def test_scale_down_drains_the_highest_index() -> None:
    d = decide(1, "r1", [live(0), live(1)])
    assert d.keep == {0: True} and d.drain == [1] and d.remove == [] and d.old == []
    d = decide(1, "r1", [live(0), live(1), live(2)])
    assert d.keep == {0: True} and d.drain == [1, 2]


def test_scale_down_drains_a_failed_then_a_not_ready_pipeline_first() -> None:
    d = decide(2, "r1", [live(0, ready=False, failed=True), live(1, ready=False), live(2)])
    assert d.drain == [0] and d.keep == {1: True, 2: True}
    d = decide(1, "r1", [live(0, ready=False, failed=True), live(1, ready=False), live(2)])
    assert d.drain == [0, 1] and d.keep == {2: True}
    d = decide(1, "r1", [live(0, ready=False), live(1)])
    assert d.drain == [0] and d.keep == {1: True}


def test_a_drained_pipeline_is_removed_only_once_its_frontend_pods_are_gone() -> None:
    d = decide(1, "r1", [live(0), live(1, frontend=False, pods=1)])
    assert d.drain == [1] and d.remove == [] and d.keep == {0: True}  # still finishing its requests
    d = decide(1, "r1", [live(0), live(1, frontend=False, pods=0)])
    assert d.remove == [1] and d.drain == [] and d.keep == {0: True}


def test_a_failed_pipeline_keeps_its_place_with_its_frontend_off() -> None:
    d = decide(2, "r1", [live(0), live(1, ready=False, failed=True)])
    assert d.keep == {0: True, 1: False} and d.drain == [] and d.remove == []


def test_replicas_zero_drains_everything() -> None:
    d = decide(0, "r2", [live(0, "r2"), live(1, "r1"), live(2, "r2", ready=False)])
    assert d.keep == {} and d.old == [] and d.drain == [0, 1, 2]


def test_indexes_are_reused_lowest_first() -> None:
    assert decide(3, "r1", [live(1)]).keep == {0: True, 1: True, 2: True}
    assert decide(2, "r1", [live(0), live(2)]).keep == {0: True, 2: True}
    # a draining pipeline still holds its index (its objects exist): a new one takes the next free
    d = decide(2, "r1", [live(0), live(1, frontend=False, pods=1)])
    assert d.keep == {0: True, 2: True} and d.drain == [1]


@dataclass
class Pipe:
    index: int
    revision: str
    ready: bool = False
    has_frontend: bool = True
    frontend_pods: int = 1
    failed: bool = False
    stale: bool = False

    def as_live(self, blink: bool = False) -> Live:
        """blink: its frontend unready for this pass (a probe timed out): not serving, not stale."""
        return Live(self.index, self.revision, self.has_frontend, self.frontend_pods, self.ready and not blink,
                    self.failed, self.stale and not blink)


def step(pipes: dict[int, Pipe], decision: Decision, revision: str, *, starts: bool = True) -> None:
    """What the reconciler and the cluster make of a decision until the next pass: new pipelines are
    created (and serve by the pass after, unless `starts` is False: a broken revision), a drained one
    loses its frontend, and its frontend pods go one pass later; removed ones vanish."""
    for index in decision.remove:
        del pipes[index]
    for index in decision.drain:
        p = pipes[index]
        if not p.has_frontend:
            p.frontend_pods = 0
        p.has_frontend, p.ready = False, False
    for index in decision.keep:
        if index not in pipes:
            pipes[index] = Pipe(index, revision)
        elif pipes[index].has_frontend and starts:
            pipes[index].ready = True


def serving(pipes: dict[int, Pipe], blinked: int | None = None) -> int:
    return sum(p.ready and p.has_frontend and p.index != blinked for p in pipes.values())


def done(pipes: dict[int, Pipe], replicas: int, revision: str) -> bool:
    return all(p.revision == revision for p in pipes.values()) and serving(pipes) == replicas == len(pipes)


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_a_rollout_replaces_one_pipeline_at_a_time_and_never_serves_fewer_than_asked(replicas: int) -> None:
    pipes = {i: Pipe(i, "r1", ready=True) for i in range(replicas)}
    for _ in range(8 * replicas + 4):
        decision = decide(replicas, "r2", [p.as_live() for p in pipes.values()])
        new_unready = [i for i in decision.keep if i not in pipes or not pipes[i].ready]
        assert len(new_unready) <= 1, f"more than one new pipeline at a time: {decision}"
        step(pipes, decision, "r2")
        assert serving(pipes) >= replicas, f"fewer than {replicas} serving after {decision}: {pipes}"
        assert sum(p.has_frontend for p in pipes.values()) <= replicas + 1  # a surge of one
        if done(pipes, replicas, "r2"):
            break
    else:
        pytest.fail(f"the rollout did not finish: {pipes}")
    assert decide(replicas, "r2", [p.as_live() for p in pipes.values()]) == \
        Decision(keep=dict.fromkeys(pipes, True))


@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize(("surge", "unavailable"), [(1, 0), (0, 0), (1, 1), (0, 1), (1, 2)])
@pytest.mark.parametrize("phase", [0, 1, 2])
def test_a_rollout_with_a_blink_at_every_step_keeps_the_floor_and_converges(
        replicas: int, surge: int, unavailable: int, phase: int) -> None:
    """Every pass one pipeline's frontend blinks (a different one each time, old and new alike): no
    blinking pipeline drains, drains never take the serving ones below replicas - maxUnavailable
    (at least 1 with maxSurge 0; never the last one with a surge), the frontends stay within
    replicas + maxSurge, and once the blinks stop the rollout finishes."""
    floor = floor_of(replicas, surge, unavailable)
    if surge:
        floor = max(floor, 1)
    pipes = {i: Pipe(i, "r1", ready=True) for i in range(replicas)}
    for n in range(12 * replicas + 8):
        blinking = n < 6 * replicas
        order = sorted(pipes)
        blinked = order[(n + phase) % len(order)] if blinking and order else None
        before = serving(pipes, blinked)
        decision = decide(replicas, "r2", [p.as_live(p.index == blinked) for p in pipes.values()], surge, unavailable)
        assert blinked not in decision.drain or not pipes[blinked].has_frontend, f"drained a blink: {decision}"
        step(pipes, decision, "r2")
        assert serving(pipes, blinked) >= min(before, floor), f"pass {n}: below the floor after {decision}: {pipes}"
        assert sum(p.has_frontend for p in pipes.values()) <= replicas + surge
        if not blinking and done(pipes, replicas, "r2"):
            break
    else:
        pytest.fail(f"the rollout did not finish: {pipes}")


def test_the_incident_a_stage_blink_on_both_old_pipelines_drains_nothing() -> None:
    """The review's replay: a spec change while the old pipelines' frontends serve (a stage of each
    blinked, so the old rule drained both and started both new ones in one reconcile)."""
    d = decide(2, "r2", [live(0), live(1)])
    assert d.drain == [] and d.old == [0, 1] and d.keep == {2: True}
    # their frontends blink too, for a pass: still nothing drains, nothing more starts
    d = decide(2, "r2", [live(0, ready=False), live(1, ready=False), live(2, "r2", ready=False)])
    assert d.drain == [] and d.old == [0, 1] and d.keep == {2: True}


def test_a_new_revision_that_never_serves_leaves_the_old_pipelines_serving() -> None:
    pipes = {i: Pipe(i, "r1", ready=True) for i in range(2)}
    for _ in range(30):
        step(pipes, decide(2, "r2", [p.as_live() for p in pipes.values()]), "r2", starts=False)
    assert serving(pipes) == 2 and sorted(p.revision for p in pipes.values()) == ["r1", "r1", "r2"]
    # a fixed spec (r3) replaces the broken new pipeline once it has been dead a while, and goes on
    pipes[2].stale = True
    d = decide(2, "r3", [p.as_live() for p in pipes.values()])
    assert d.drain == [2] and d.old == [0, 1] and d.keep == {3: True}


def test_the_last_serving_pipeline_never_drains_while_a_surge_can_replace_it() -> None:
    d = decide(1, "r2", [live(0)], max_surge=1, max_unavailable=1)
    assert d.drain == [] and d.old == [0] and d.keep == {1: True}
    d = decide(1, "r2", [live(0), live(1, "r2")], max_surge=1, max_unavailable=1)
    assert d.drain == [0] and d.keep == {1: True}
    # without a surge there is no other way: it drains first (the user said no spare capacity)
    d = decide(1, "r2", [live(0)], max_surge=0)
    assert d.drain == [0] and d.keep == {1: True}


def test_max_unavailable_lets_that_many_serving_pipelines_go_before_their_replacements() -> None:
    d = decide(3, "r2", [live(0), live(1), live(2)], max_surge=1, max_unavailable=1)
    assert d.drain == [2] and d.old == [0, 1] and d.keep == {3: True, 4: True}
    d = decide(3, "r2", [live(0), live(1), live(2)], max_surge=0, max_unavailable=2)
    assert d.drain == [1, 2] and d.old == [0] and d.keep == {3: True, 4: True}


def test_the_first_step_of_a_rollout_is_exactly_one_new_pipeline() -> None:
    d = decide(2, "r2", [live(0), live(1)])
    assert d.keep == {2: True} and d.old == [0, 1] and d.drain == []
    d = decide(2, "r2", [live(0), live(1), live(2, "r2", ready=False)])
    assert d.keep == {2: True} and d.old == [0, 1] and d.drain == []  # wait for it to be ready
    d = decide(2, "r2", [live(0), live(1), live(2, "r2")])
    assert d.drain == [1] and d.old == [0] and d.keep == {2: True, 3: True}  # 3 serve > 2: one old one goes


def test_an_old_pipeline_that_blinks_stays_and_one_dead_for_a_while_goes_at_once() -> None:
    d = decide(2, "r2", [live(0), live(1, ready=False)])
    assert d.drain == [] and d.old == [0, 1] and d.keep == {2: True}  # it may serve again in a moment
    d = decide(2, "r2", [live(0), live(1, ready=False, stale=True)])
    # its replacement and the surge start now: never more than replicas + 1 pipelines with a frontend
    assert d.drain == [1] and d.old == [0] and d.keep == {2: True, 3: True}
    d = decide(2, "r2", [live(0), live(1, ready=False, failed=True)])
    assert d.drain == [1] and d.old == [0] and d.keep == {2: True, 3: True}


def test_without_surge_an_old_pipeline_drains_before_its_replacement_starts() -> None:
    d = decide(2, "r2", [live(0), live(1)], max_surge=0)
    assert d.drain == [1] and d.old == [0] and d.keep == {2: True}


def test_a_pipeline_whose_frontend_was_never_created_is_taken_up_again() -> None:
    """A reconcile that stopped between a pipeline's stages and its frontend (the API server refused
    the frontend) leaves a pipeline without one: the next reconcile finishes it under the same index,
    not removes it and starts another (which would loop: remove, create, remove ...)."""
    unfinished = live(0, frontend=False, pods=0, ready=False)
    assert decide(1, "r1", [unfinished]) == Decision(keep={0: True})
    # a drained pipeline of an old revision is still removed, and one that is not missing too
    assert decide(1, "r2", [replace(unfinished, revision="r1")]) == Decision(keep={1: True}, remove=[0])
    assert decide(1, "r1", [live(1), unfinished]) == Decision(keep={1: True}, remove=[0])
    # scaled down and drained, then scaled up again: the same index comes back
    assert decide(2, "r1", [live(0), live(1, frontend=False, pods=0)]) == Decision(keep={0: True, 1: True})
