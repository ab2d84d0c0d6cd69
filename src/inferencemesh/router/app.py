"""The router's ASGI app: its own endpoints, and every other request relayed to a replica.

    GET /health            200: the process runs
    GET /ready             200 once at least one replica is known ready, else 503
    GET /metrics           the router's Prometheus series (router/metrics.py)
    GET /router/replicas   each replica: url, in flight, reported waiting, routed (JSON, for debugging)
    anything else          relayed to the replica policy.choose picks

A relayed request's body is read once (at most max_body_bytes: 413 beyond, from its declared
Content-Length before any byte of it is read; whole within body_timeout seconds: 408 after, both
closing the connection) and replayed on each retry. The replica's answer goes back as it arrives:
status and headers as it sent them (minus hop-by-hop ones) with its first body bytes, then the
rest chunk by chunk (an SSE stream unbuffered). An answer the policy retries
(policy.RETRY_STATUSES) or a connection that fails before the first body bytes is retried on the
next replica, each at most once, only while nothing went to the client yet. A replica that
refused a connection or dropped one is marked down (replicas.Replica.mark_down): requests go to
the others until its /ready answers. A replica that dies after the first bytes went ends an SSE
stream with an OpenAI error event (`data: {"error": {...}}`, no `[DONE]`), any other answer by
cutting the connection: never a complete-looking answer. A client that goes away closes the
upstream connection, and the replica cancels the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from inferencemesh.config import RouterConfig
from inferencemesh.openai_errors import error_json, sse_error_event
from inferencemesh.router.metrics import RouterMetrics
from inferencemesh.router.policy import PrefixAffinity, block_hashes, choose, key_seed, retryable, routing_key
from inferencemesh.router.replicas import EndpointSliceWatch, LoadPoller, Replica, ReplicaSet, StaticReplicas, cancel
from inferencemesh.router.transport import LeanTransport

log = logging.getLogger("inferencemesh.router")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

CONNECT_TIMEOUT_S = 2.0
RETRY_AFTER_S = "1"
# Hop-by-hop headers (RFC 9110 7.6.1) are the connection's, not the message's; Host and
# Content-Length are the client library's to write for the upstream request.
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
                        b"proxy-authorization", b"te", b"trailer", b"trailers", b"transfer-encoding", b"upgrade"})
# Expect: the router answered the client's 100-continue itself; the transport asks its own.
REQUEST_DROPPED = HOP_BY_HOP | {b"host", b"content-length", b"expect"}
CLOSE = [(b"connection", b"close")]  # a refusal before the body was read: the rest of it is not drained
OWN_PATHS = ("/health", "/ready", "/metrics", "/router/replicas")


def _without(headers: Iterable[tuple[bytes, bytes]], dropped: frozenset[bytes]) -> list[tuple[bytes, bytes]]:
    headers = list(headers)
    named = {token.strip().lower() for name, value in headers if name.lower() == b"connection"
             for token in value.split(b",")}
    return [(name, value) for name, value in headers if name.lower() not in dropped and name.lower() not in named]


async def send_whole(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None,
                     content_type: bytes = b"application/json") -> None:
    head = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *(headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(send: Send, status: int, message: str, type_: str, code: str | None = None,
                     retry_after: bool = False, close: bool = False) -> None:
    extra = [(b"retry-after", RETRY_AFTER_S.encode())] if retry_after else []
    await send_whole(send, status, error_json(message, type_, code=code), extra + (CLOSE if close else []))


class BodyRefused(Exception):
    """The request body is refused before it is whole: 413 (too large) or 408 (too slow)."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


@dataclass(frozen=True)
class Refusal:
    """A replica's answer that the next replica may do better than (policy.RETRY_STATUSES), read whole."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


class UpstreamFailed(Exception):
    """A replica failed before any byte of its answer went to the client: the next one may serve."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class RouterApp:
    """The router (an ASGI app, lifespan included: it starts the replica source and the load poller)."""

    def __init__(self, config: RouterConfig, *, api_client: Any = None) -> None:
        self.config = config
        self.header_timeout_s = config.header_timeout  # http_server.server_config's, for the request head
        self.replicas = ReplicaSet()
        self.source: StaticReplicas | EndpointSliceWatch = (
            StaticReplicas(self.replicas, config.frontends) if config.frontends else
            EndpointSliceWatch(self.replicas, config.frontends_service or "", config.namespace,
                               config.frontend_port, api_client=api_client))
        self.affinity = PrefixAffinity(ttl=config.affinity_ttl, max_entries=config.affinity_entries)
        self.metrics = RouterMetrics()
        self.metrics.ready_replicas.set_function(lambda: len(self.replicas.up()))
        self.client: httpx.AsyncClient | None = None  # the load poller's
        self.transport = LeanTransport(connect_timeout=CONNECT_TIMEOUT_S)
        self.poller: LoadPoller | None = None
        self._poll_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifespan -------------------------------------------------------------------------

    async def startup(self) -> None:
        self._loop = asyncio.get_running_loop()
        # httpx's models over a lean HTTP/1.1 transport (router/transport.py: httpcore's costs 1.9 ms a
        # request). Relayed requests go to the transport itself: no client cookie jar (a Set-Cookie of
        # one client's answer must never ride along on another client's request), no redirects.
        self.transport = LeanTransport(connect_timeout=CONNECT_TIMEOUT_S)
        self.client = httpx.AsyncClient(transport=self.transport,
                                        timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S), trust_env=False,
                                        follow_redirects=False)
        for name in list(self.client.headers):  # no Accept/User-Agent/... of its own: the client's pass
            del self.client.headers[name]
        self.replicas.on_removed.append(self._removed_elsewhere)
        self.source.start()
        self.poller = LoadPoller(self.replicas, self.client, self.config.load_poll_interval)
        self._poll_task = asyncio.create_task(self.poller.run())

    async def shutdown(self) -> None:
        await cancel(self._poll_task)
        self.source.stop()
        if self.client is not None:
            await self.client.aclose()

    def _removed_elsewhere(self, name: str) -> None:
        """From the watch thread (or the loop): forget a replica that left, on the loop."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._removed, name)

    def _removed(self, name: str) -> None:
        self.affinity.forget(name)  # gone, or back as a new pod: its cache is not the one we knew
        if name not in self.replicas.current():
            self.metrics.remove_replica(name)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as err:  # noqa: BLE001 - reported to the server, which exits
                    await send({"type": "lifespan.startup.failed", "message": str(err)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ---- requests -------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # websockets are not served
        if scope["method"] in ("GET", "HEAD") and scope["path"] in OWN_PATHS:
            await self._own(scope["path"], send)
            return
        await self._proxy(scope, receive, send)

    async def _own(self, path: str, send: Send) -> None:
        replicas = self.replicas.current()
        if path == "/health":
            await send_whole(send, 200, b'{"status":"ok"}')
        elif path == "/ready":
            if up := self.replicas.up():
                await send_whole(send, 200, json.dumps({"status": "ready", "replicas": len(up)}).encode())
            else:
                await send_error(send, 503, "No replica is ready.", "service_unavailable", "no_replica",
                                 retry_after=True)
        elif path == "/metrics":
            for name, replica in replicas.items():
                self.metrics.in_flight.labels(name).set(replica.in_flight)
                self.metrics.replica_waiting.labels(name).set(replica.waiting)
            await send_whole(send, 200, generate_latest(self.metrics.registry),
                             content_type=CONTENT_TYPE_LATEST.encode())
        else:
            body = {"replicas": [{"name": r.name, "url": r.url, "in_flight": r.in_flight, "waiting": r.waiting,
                                  "routed": r.routed, "up": r.down is None, "down": r.down}
                                 for r in replicas.values()],
                    "prefix_blocks": len(self.affinity)}
            await send_whole(send, 200, json.dumps(body).encode())

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole request body (None: the client went away first). Refused (BodyRefused) beyond
        max_body_bytes, declared or received, and when it is not whole within body_timeout seconds
        of its head, however it trickles in."""
        limit = self.config.max_body_bytes
        too_large = BodyRefused(413, f"The request body is larger than {limit} bytes.", "request_too_large")
        declared = next((value for name, value in scope["headers"] if name.lower() == b"content-length"), None)
        if declared is not None and (not declared.strip().isdigit() or int(declared) > limit):
            raise too_large  # before reading a byte of it
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.config.body_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise too_large
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            raise BodyRefused(408, f"The request body did not arrive within {self.config.body_timeout:g} s.",
                              "request_timeout") from None

    async def _proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await self._read_body(scope, receive)
        except BodyRefused as refused:
            await send_error(send, refused.status, refused.message, "invalid_request_error", refused.code, close=True)
            return
        if body is None:
            return
        task = asyncio.current_task()
        assert task is not None
        state = {"done": False, "gone": False, "started": False}

        async def watch_disconnect() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    if not state["done"]:
                        state["gone"] = True
                        task.cancel()  # wherever _forward waits: the upstream connection closes
                    return

        def tracked(message: Message) -> Awaitable[None]:
            state["started"] = True
            return send(message)

        watcher = asyncio.create_task(watch_disconnect())
        try:
            await self._forward(scope, body, tracked, state)
        except asyncio.CancelledError:
            if not state["gone"]:
                raise
            task.uncancel()
        except Exception:  # a bug of the router's own: an OpenAI-format 500, never uvicorn's plain text
            log.exception("the router failed on %s %s", scope["method"], scope["path"])
            if state["started"]:
                raise
            await send_error(send, 500, "The router failed on this request.", "server_error", "router_error")
        finally:
            state["done"] = True
            watcher.cancel()

    async def _forward(self, scope: Scope, body: bytes, send: Send, state: dict[str, bool]) -> None:
        started = time.perf_counter()
        method, path = scope["method"], scope["path"]
        key = routing_key(path, body) if method == "POST" else None
        blocks = block_hashes(key, self.config.block_chars)
        # Down replicas only when none is up: they may be back before the poller has seen it.
        replicas = self.replicas.up() or self.replicas.current()
        choice = choose({name: r.load for name, r in replicas.items()}, self.affinity.match(blocks) if blocks else {},
                        seed=key_seed(key), balance_abs=self.config.balance_abs, balance_rel=self.config.balance_rel)
        if not choice.order:
            self.metrics.no_replica.inc()
            await send_error(send, 503, "No replica is ready to serve this request.", "service_unavailable",
                             "no_replica", retry_after=True)
            return
        if blocks:
            (self.metrics.affinity_hits if choice.matched_blocks else self.metrics.affinity_misses).labels(
                choice.order[0]).inc()
        target = scope.get("raw_path") or path.encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        headers = _without(scope["headers"], REQUEST_DROPPED)
        last: Refusal | None = None
        failed: list[str] = []
        for attempt, name in enumerate(choice.order):
            replica = replicas[name]
            # The body as a stream: httpx then leaves the headers as given (40 us less than content=),
            # so Host and Content-Length are ours to write.
            request = httpx.Request(method, replica.url + target.decode("latin-1"), stream=httpx.ByteStream(body),
                                    headers=[(b"host", replica.url.partition("://")[2].encode()), *headers,
                                             *([(b"content-length", str(len(body)).encode())] if body else [])])
            if attempt == 0:
                self.metrics.overhead.observe(time.perf_counter() - started)
            replica.in_flight += 1
            try:
                try:
                    answer = await self._attempt(replica, request, retry=attempt + 1 < len(choice.order))
                except UpstreamFailed as err:
                    self.metrics.retries.labels(name, err.reason).inc()
                    failed.append(f"{name}: {err.detail}")
                    continue
                except httpx.HTTPError as err:
                    log.warning("replica %s failed: %s", name, err)
                    await send_error(send, 502, f"The replica {name} failed: {type(err).__name__}.",
                                     "server_error", "bad_gateway")
                    return
                if isinstance(answer, Refusal):
                    last = answer
                    continue
                response, first, rest = answer
                try:
                    if blocks:
                        self.affinity.record(blocks, name)
                    replica.routed += 1
                    self.metrics.requests.labels(name, f"{response.status_code // 100}xx").inc()
                    await self._relay(replica, response, first, rest, send, state)
                    return
                finally:
                    await response.aclose()
            finally:
                replica.in_flight -= 1
        if last is not None:  # every replica refused it: the last answer, as it came
            await send({"type": "http.response.start", "status": last.status, "headers": last.headers})
            await send({"type": "http.response.body", "body": last.body, "more_body": False})
            return
        log.warning("no replica reachable: %s", "; ".join(failed))
        await send_error(send, 503, "No replica could be reached: " + "; ".join(failed), "service_unavailable",
                         "no_replica", retry_after=True)

    async def _attempt(self, replica: Replica, request: httpx.Request, *, retry: bool
                       ) -> Refusal | tuple[httpx.Response, bytes, AsyncIterator[bytes]]:
        """One try on `replica`: its Refusal when `retry` and the status is one the policy retries;
        else the response with its first body bytes read (and an iterator over the rest).
        UpstreamFailed when it failed before those first bytes."""
        name = replica.name
        try:
            response = await self.transport.handle_async_request(request)
        except (httpx.ConnectError, httpx.ConnectTimeout) as err:
            replica.mark_down(f"connecting: {err or type(err).__name__}")
            raise UpstreamFailed("connect", str(err) or type(err).__name__) from err
        except httpx.RemoteProtocolError as err:  # it closed the connection without an answer
            replica.mark_down(str(err))
            raise UpstreamFailed("disconnected", str(err) or type(err).__name__) from err
        status = response.status_code
        try:
            if retryable(status) and retry:
                answer = await response.aread()
                self.metrics.requests.labels(name, f"{status // 100}xx").inc()
                self.metrics.retries.labels(name, str(status)).inc()
                await response.aclose()
                return Refusal(status, _without(response.headers.raw, HOP_BY_HOP), answer)
            # The status line waits for the first body bytes: a replica that dies before them (a
            # stream still in prefill, a non-streamed answer being computed) is retried elsewhere.
            rest = response.aiter_raw()
            first = await anext(rest, b"")
        except httpx.HTTPError as err:
            await response.aclose()
            replica.mark_down(f"its answer broke off: {err}")
            raise UpstreamFailed("disconnected", str(err) or type(err).__name__) from err
        except BaseException:
            await response.aclose()
            raise
        return response, first, rest

    async def _relay(self, replica: Replica, response: httpx.Response, first: bytes, rest: AsyncIterator[bytes],
                     send: Send, state: dict[str, bool]) -> None:
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": _without(response.headers.raw, HOP_BY_HOP)})
        sse = response.headers.get("content-type", "").startswith("text/event-stream")
        last = first
        try:
            if first:
                await send({"type": "http.response.body", "body": first, "more_body": True})
            async for chunk in rest:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                last = chunk or last
        except httpx.HTTPError as err:  # after the first bytes: the client must see that it broke
            replica.mark_down(f"its answer broke off: {err}")
            log.warning("replica %s ended its answer early: %s", replica.name, err)
            if not sse:
                state["done"] = True
                return  # without the body's end: uvicorn cuts the connection, the client sees it cut
            # An event of its own: after a whole event's blank line (what was relayed ends one, or
            # the blank line ends the part that came).
            event = sse_error_event(f"The replica {replica.name} serving this stream failed: {err}", "server_error",
                                    code="replica_failed")
            await send({"type": "http.response.body", "more_body": True,
                        "body": event if last.endswith(b"\n\n") else b"\n\n" + event})
        state["done"] = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def create_router(config: RouterConfig, *, api_client: Any = None) -> RouterApp:
    return RouterApp(config.check(), api_client=api_client)
