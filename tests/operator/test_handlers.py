"""The kopf wiring without a cluster: each mesh's worker loop (wake-ups, backoff, resync) and how
events reach it. The handlers are plain functions; the indices kopf would pass are plain dicts here."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import kopf
import pytest

from inferencemesh.operator import handlers as H
from inferencemesh.operator.reconcile import Result


class FakeReconciler:
    """Counts reconciles; each call runs `behaviour` (raise to fail, block to be slow)."""

    def __init__(self, behaviour: Callable[[int], Result] | None = None) -> None:
        self.calls = 0
        self.behaviour = behaviour or (lambda n: Result(phase="Ready"))

    def reconcile(self, namespace: str, name: str) -> Result:
        self.calls += 1
        return self.behaviour(self.calls)


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_backoff_doubles_and_is_bounded() -> None:
    assert [H.backoff_seconds(n) for n in (1, 2, 3)] == [4.0, 8.0, 16.0]
    assert H.backoff_seconds(50) == H.MAX_BACKOFF_SECONDS


def test_a_worker_reconciles_at_once_then_on_each_wake() -> None:
    async def scenario() -> None:
        fake = FakeReconciler()
        worker = H.MeshWorker(fake, "ns", "m")  # type: ignore[arg-type]
        await until(lambda: fake.calls == 1)
        await asyncio.sleep(0.05)
        assert fake.calls == 1  # then it sleeps until the resync (300 s here)
        worker.wake()
        await until(lambda: fake.calls == 2)
        worker.stop()

    asyncio.run(scenario())


def test_events_during_a_reconcile_ask_for_exactly_one_more_pass() -> None:
    release = threading.Event()

    def slow(n: int) -> Result:
        if n == 1:
            release.wait(5)
        return Result()

    async def scenario() -> None:
        fake = FakeReconciler(slow)
        worker = H.MeshWorker(fake, "ns", "m")  # type: ignore[arg-type]
        await until(lambda: fake.calls == 1)
        for _ in range(5):
            worker.wake()
        release.set()
        await until(lambda: fake.calls == 2)
        await asyncio.sleep(0.1)
        assert fake.calls == 2
        worker.stop()

    asyncio.run(scenario())


def test_failures_are_retried_with_backoff_and_success_resets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    delays: list[int] = []
    monkeypatch.setattr(H, "backoff_seconds", lambda failures: delays.append(failures) or 0.01)
    monkeypatch.setattr(H, "RESYNC_SECONDS", 0.02)

    def flaky(n: int) -> Result:
        if n in (1, 2, 4):
            raise RuntimeError("API server unreachable")
        return Result()

    async def scenario() -> None:
        fake = FakeReconciler(flaky)
        worker = H.MeshWorker(fake, "ns", "m")  # type: ignore[arg-type]
        await until(lambda: fake.calls >= 6)  # keeps going: retries, then the periodic resync
        worker.stop()

    asyncio.run(scenario())
    assert delays[:3] == [1, 2, 1]  # the count of failures in a row, reset by the success in between


def test_a_model_that_cannot_be_read_yet_is_retried_sooner_than_the_resync(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(H, "RESYNC_SECONDS", 300.0)

    async def scenario() -> None:
        fake = FakeReconciler(lambda n: Result(phase="Pending", retry_after=0.02))
        worker = H.MeshWorker(fake, "ns", "m")  # type: ignore[arg-type]
        await until(lambda: fake.calls >= 3)
        worker.stop()

    asyncio.run(scenario())


def test_mesh_and_child_events_reach_the_meshs_worker() -> None:
    async def scenario() -> None:
        fake = FakeReconciler()
        memo = kopf.Memo(reconciler=fake)
        await H.mesh_event(type=None, namespace="ns", name="code", memo=memo, mesh_phases={})
        worker = memo.worker
        await until(lambda: fake.calls == 1)
        await H.mesh_event(type="MODIFIED", namespace="ns", name="code", memo=memo, mesh_phases={})
        assert memo.worker is worker  # one worker per mesh
        await until(lambda: fake.calls == 2)
        by_base = {("ns", "code"): [memo]}
        await H.child_event(namespace="ns", labels={"inferencemesh.io/mesh": "code"}, mesh_memos=by_base)
        await until(lambda: fake.calls == 3)
        await H.child_event(namespace="other", labels={"inferencemesh.io/mesh": "code"}, mesh_memos=by_base)
        await H.child_event(namespace="ns", labels={}, mesh_memos=by_base)
        await asyncio.sleep(0.05)
        assert fake.calls == 3  # another namespace's or an unlabelled child wakes nobody
        await H.mesh_event(type="DELETED", namespace="ns", name="code", memo=memo, mesh_phases={})
        await until(lambda: worker.task.done())
        assert worker.task.cancelled()

    asyncio.run(scenario())


def test_mesh_events_export_the_phase_gauge() -> None:
    from inferencemesh.operator import metrics

    async def scenario() -> None:
        memo = kopf.Memo(reconciler=FakeReconciler())
        phases = {"Ready": [None, None], "Failed": [None]}
        await H.mesh_event(type=None, namespace="ns", name="a", memo=memo, mesh_phases=phases)
        memo.worker.stop()

    asyncio.run(scenario())
    gauge = {phase: metrics.MESHES.labels(phase)._value.get() for phase in H.PHASES}
    assert gauge == {"Pending": 0, "Progressing": 0, "Ready": 2, "Degraded": 0, "Failed": 1}
