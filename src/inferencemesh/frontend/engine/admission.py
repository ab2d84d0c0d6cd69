"""Admission: this frontend's pipeline sessions (slots), taken all at once and in arrival order.

A request that needs `count` sessions (n choices, or a list of prompts times n) waits in one
first-in-first-out queue until that many are free, then takes them together. It never holds
some while it waits for the rest: two batches could otherwise each hold a part and wait for the
other, and a request larger than the whole capacity could wait forever. Such a request is
refused at once (400), as is a new arrival when the queue is full (429).

Slots are taken and given back by one construct, `Admission.lease`: an async context manager
around everything the engine does after admission. Whatever is still in the lease when the
block ends (an exception anywhere, a cancellation) goes back; what the block hands over (one
slot per choice, `Lease.hand_over`) goes back when that choice ends, exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from inferencemesh.frontend.engine.errors import EngineOverloaded, InvalidRequest


@dataclass
class _Waiter:
    count: int
    granted: asyncio.Future[None]


class Slot:
    """One slot handed to a choice: `give_back` returns it to the admission, once."""

    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission

    def give_back(self) -> None:
        if self._admission is not None:
            admission, self._admission = self._admission, None
            admission._give_back(1)


class Lease:
    """The slots one request holds inside `Admission.lease`."""

    def __init__(self, admission: Admission, count: int) -> None:
        self._admission = admission
        self.held = count

    def hand_over(self) -> Slot:
        """One of the slots leaves the lease: its new owner gives it back (Slot.give_back)."""
        if self.held <= 0:
            raise RuntimeError("no slot left in this lease")
        self.held -= 1
        return Slot(self._admission)

    def _end(self) -> None:
        held, self.held = self.held, 0
        if held:
            self._admission._give_back(held)


class Admission:
    def __init__(self, capacity: int, *, max_waiting: int, timeout_s: float) -> None:
        self.capacity = capacity
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self.free = capacity
        self._queue: deque[_Waiter] = deque()

    @property
    def running(self) -> int:
        """Slots held: by requests being set up, and by choices generating."""
        return self.capacity - self.free

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @contextlib.asynccontextmanager
    async def lease(self, count: int, *, what: str = "the request") -> AsyncIterator[Lease]:
        """Take `count` slots (waiting up to timeout_s), and give back on exit what was not handed over.

        `what` names the request's size in the refusal when it can never fit, e.g. "n".
        """
        if count > self.capacity:
            raise InvalidRequest(f"{what} needs {count} concurrent sequences; this server runs at most "
                                 f"{self.capacity} at once", param="n")
        await self._take(count)
        lease = Lease(self, count)
        try:
            yield lease
        finally:
            lease._end()

    async def _take(self, count: int) -> None:
        if not self._queue and self.free >= count:
            self.free -= count
            return
        if len(self._queue) >= self.max_waiting:
            raise EngineOverloaded(f"{len(self._queue)} requests are already waiting; retry later")
        waiter = _Waiter(count, asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
        try:
            # Shielded: a cancel must not cancel `granted` itself, which _withdraw reads to know
            # whether the slots were granted meanwhile. asyncio.timeout, never wait_for, which on
            # Python 3.11 loses a cancel that comes with the grant.
            async with asyncio.timeout(self.timeout_s):
                await asyncio.shield(waiter.granted)
        except BaseException as err:
            self._withdraw(waiter)
            if isinstance(err, TimeoutError):
                raise EngineOverloaded(f"timed out after {self.timeout_s:.0f}s waiting for {count} free pipeline "
                                       f"session(s) of {self.capacity}") from err
            raise

    def _withdraw(self, waiter: _Waiter) -> None:
        """A waiter leaves (timed out, cancelled): out of the queue, or, if it was granted meanwhile,
        its slots go back."""
        if waiter.granted.done():
            self._give_back(waiter.count)
            return
        waiter.granted.cancel()
        self._queue.remove(waiter)
        self._grant()  # a large waiter at the head may have kept smaller ones behind it

    def _give_back(self, count: int) -> None:
        self.free += count
        self._grant()

    def _grant(self) -> None:
        """Admit waiters from the head of the queue while their counts fit: first come, first served."""
        while self._queue and self._queue[0].count <= self.free:
            waiter = self._queue.popleft()
            self.free -= waiter.count
            waiter.granted.set_result(None)
