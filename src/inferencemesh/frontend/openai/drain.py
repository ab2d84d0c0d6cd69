"""Draining: a stopping frontend finishes what it started and refuses what comes after.

When its pod is deleted (a rollout, a scale-down), the frontend gets SIGTERM. Instead of closing
its socket and cutting the streams in flight, it drains (programs/frontend.DrainingServer starts
it, on the event loop):

- /ready answers 503 (code "draining"): the kubelet marks the pod unready, routers stop choosing it;
- a new generation request answers 503 with Retry-After (another replica will take the retry);
  /health, /metrics and /v1/models still answer, and the socket stays open, so a straggler gets
  that 503, not a refused connection;
- the requests in flight run to their end; when none is left, or after the drain's timeout, the
  server stops (what is still running then is cut as a server stop cuts it).

`Drain` is the state; `DrainGuard` (pure ASGI middleware, outermost in the app) counts the requests in
flight, every route's, from the request's arrival until its response's last byte (a stream's
[DONE] included), and refuses the generation routes while draining.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from inferencemesh.frontend.openai.errors import APIError

if TYPE_CHECKING:
    from inferencemesh.frontend.engine.metrics import FrontendMetrics

log = logging.getLogger("inferencemesh.frontend")

DRAIN_RETRY_AFTER_S = 1  # by then the router has another replica for the retry
# The routes that start work: refused while draining. vLLM's utility routes are cheap but served
# by the model's tokenizer, which a stopping replica is about to drop: refused too.
DRAINED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize", "/detokenize"})


def draining_error() -> APIError:
    """A request refused by a draining replica (and /ready's answer while it drains)."""
    return APIError(503, "This replica is shutting down (draining); retry the request: another replica will "
                    "serve it.", type="service_unavailable", code="draining", retry_after=DRAIN_RETRY_AFTER_S)


class Drain:
    """Whether this frontend drains, since when and until when, and the requests in flight."""

    def __init__(self, metrics: FrontendMetrics | None = None) -> None:
        self.metrics = metrics
        self.in_flight = 0
        self.draining = False
        self.started_at: float | None = None  # time.monotonic() of start()
        self.deadline: float | None = None
        if metrics is not None:
            metrics.set_draining(False)

    def start(self, timeout_s: float) -> None:
        """Drain from now: refuse new work, let the requests in flight run up to timeout_s."""
        if self.draining:
            return
        self.draining = True
        self.started_at = time.monotonic()
        self.deadline = self.started_at + timeout_s
        if self.metrics is not None:
            self.metrics.set_draining(True)
        log.info("draining: %d request(s) in flight; new requests get 503 and /ready is 503; stopping when they "
                 "finish, in %g s at most", self.in_flight, timeout_s)

    def finished(self) -> bool:
        """Draining, and nothing is left in flight or the timeout has passed: time to stop. Logs
        the drain's end, once."""
        if not self.draining or self.started_at is None or self.deadline is None:
            return False
        now = time.monotonic()
        if self.in_flight and now < self.deadline:
            return False
        if self.in_flight:
            log.warning("drain timed out after %.1f s: stopping with %d request(s) still in flight (they are cut)",
                        now - self.started_at, self.in_flight)
        else:
            log.info("drained in %.1f s: no request in flight; stopping", now - self.started_at)
        self.started_at = self.deadline = None  # logged once; `draining` stays: the server is stopping
        return True


class DrainGuard:
    """Pure ASGI middleware, outermost: counts the requests in flight in `drain`; while it drains,
    answers the generation routes with `reject`'s 503 (and closes their connections)."""

    def __init__(self, app: ASGIApp, *, drain: Drain, reject: Callable[[APIError], Response]) -> None:
        self.app, self.drain, self.reject = app, drain, reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        drain = self.drain
        drain.in_flight += 1
        try:
            if drain.draining and scope["path"] in DRAINED_PATHS:
                response = self.reject(draining_error())
                response.headers["Connection"] = "close"  # a straggler's client reconnects, elsewhere
                return await response(scope, receive, send)
            return await self.app(scope, receive, send)
        finally:
            drain.in_flight -= 1
