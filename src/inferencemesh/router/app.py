"""The router's ASGI app: its own endpoints, and every other request relayed to a replica.

    GET /health            200: the process runs
    GET /ready             200 once at least one replica is known ready, else 503
    GET /metrics           the router's Prometheus series (router/metrics.py)
    GET /router/replicas   each replica: url, in flight, reported waiting, routed (JSON, for debugging)
    anything else          relayed to the replica policy.choose picks

A relayed request's body is read once (at most max_body_bytes: 413 beyond) and replayed on each
retry. The replica's answer goes back as it arrives: status and headers as it sent them (minus
hop-by-hop ones), then its body bytes chunk by chunk (an SSE stream unbuffered). An answer the
policy retries (policy.RETRY_STATUSES) or a connection that fails is retried on the next replica,
each at most once, only while nothing went to the client yet; once the status line went, the
stream is the client's, and ends as the replica ends it. A client that goes away closes the
upstream connection, and the replica cancels the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from inferencemesh.config import RouterConfig
from inferencemesh.router.metrics import RouterMetrics
from inferencemesh.router.policy import PrefixIndex, block_hashes, choose, key_seed, retryable, routing_key
from inferencemesh.router.replicas import EndpointSliceWatch, LoadPoller, ReplicaSet, StaticReplicas, cancel
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
REQUEST_DROPPED = HOP_BY_HOP | {b"host", b"content-length"}
OWN_PATHS = ("/health", "/ready", "/metrics", "/router/replicas")


def _without(headers: Iterable[tuple[bytes, bytes]], dropped: frozenset[bytes]) -> list[tuple[bytes, bytes]]:
    headers = list(headers)
    named = {token.strip().lower() for name, value in headers if name.lower() == b"connection"
             for token in value.split(b",")}
    return [(name, value) for name, value in headers if name.lower() not in dropped and name.lower() not in named]


def error_body(message: str, type_: str, code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()


async def send_whole(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None,
                     content_type: bytes = b"application/json") -> None:
    head = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *(headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(send: Send, status: int, message: str, type_: str, code: str | None = None,
                     retry_after: bool = False) -> None:
    extra = [(b"retry-after", RETRY_AFTER_S.encode())] if retry_after else []
    await send_whole(send, status, error_body(message, type_, code), extra)


class BodyTooLarge(Exception):
    pass


class RouterApp:
    """The router (an ASGI app, lifespan included: it starts the replica source and the load poller)."""

    def __init__(self, config: RouterConfig, *, api_client: Any = None) -> None:
        self.config = config
        self.replicas = ReplicaSet()
        self.source: StaticReplicas | EndpointSliceWatch = (
            StaticReplicas(self.replicas, config.frontends) if config.frontends else
            EndpointSliceWatch(self.replicas, config.frontends_service or "", config.namespace,
                               config.frontend_port, api_client=api_client))
        self.index = PrefixIndex(ttl=config.affinity_ttl, max_entries=config.affinity_entries)
        self.metrics = RouterMetrics()
        self.metrics.ready_replicas.set_function(lambda: len(self.replicas.current()))
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
        self.index.forget(name)  # gone, or back as a new pod: its cache is not the one we knew
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
            if replicas:
                await send_whole(send, 200, json.dumps({"status": "ready", "replicas": len(replicas)}).encode())
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
                                  "routed": r.routed} for r in replicas.values()],
                    "prefix_blocks": len(self.index)}
            await send_whole(send, 200, json.dumps(body).encode())

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole request body (None: the client went away first)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.config.max_body_bytes:
                raise BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await self._read_body(receive)
        except BodyTooLarge:
            await send_error(send, 413, f"The request body is larger than {self.config.max_body_bytes} bytes.",
                             "invalid_request_error", "request_too_large")
            return
        if body is None:
            return
        task = asyncio.current_task()
        assert task is not None
        state = {"done": False, "gone": False}

        async def watch_disconnect() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    if not state["done"]:
                        state["gone"] = True
                        task.cancel()  # wherever _forward waits: the upstream connection closes
                    return

        watcher = asyncio.create_task(watch_disconnect())
        try:
            await self._forward(scope, body, send, state)
        except asyncio.CancelledError:
            if not state["gone"]:
                raise
            task.uncancel()
        finally:
            state["done"] = True
            watcher.cancel()

    async def _forward(self, scope: Scope, body: bytes, send: Send, state: dict[str, bool]) -> None:
        started = time.perf_counter()
        transport = self.transport
        method, path = scope["method"], scope["path"]
        key = routing_key(path, body) if method == "POST" else None
        blocks = block_hashes(key, self.config.block_chars)
        replicas = self.replicas.current()
        choice = choose({name: r.load for name, r in replicas.items()}, self.index.match(blocks) if blocks else {},
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
        last: tuple[int, list[tuple[bytes, bytes]], bytes] | None = None
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
            response: httpx.Response | None = None
            try:
                try:
                    response = await transport.handle_async_request(request)
                except (httpx.ConnectError, httpx.ConnectTimeout) as err:
                    self.metrics.retries.labels(name, "connect").inc()
                    failed.append(f"{name}: {err or type(err).__name__}")
                    continue
                except httpx.RemoteProtocolError as err:  # it closed the connection without an answer
                    self.metrics.retries.labels(name, "disconnected").inc()
                    failed.append(f"{name}: {err or type(err).__name__}")
                    continue
                except httpx.HTTPError as err:
                    log.warning("replica %s failed: %s", name, err)
                    await send_error(send, 502, f"The replica {name} failed: {type(err).__name__}.",
                                     "server_error", "bad_gateway")
                    return
                status = response.status_code
                if retryable(status) and attempt + 1 < len(choice.order):
                    answer = await response.aread()
                    self.metrics.retries.labels(name, str(status)).inc()
                    self.metrics.requests.labels(name, f"{status // 100}xx").inc()
                    last = (status, _without(response.headers.raw, HOP_BY_HOP), answer)
                    continue
                if blocks:
                    self.index.record(blocks, name)
                replica.routed += 1
                self.metrics.requests.labels(name, f"{status // 100}xx").inc()
                await self._relay(name, response, send, state)
                return
            finally:
                replica.in_flight -= 1
                if response is not None:
                    await response.aclose()
        if last is not None:  # every replica refused it: the last answer, as it came
            status, answer_headers, answer = last
            await send({"type": "http.response.start", "status": status, "headers": answer_headers})
            await send({"type": "http.response.body", "body": answer, "more_body": False})
            return
        log.warning("no replica reachable: %s", "; ".join(failed))
        await send_error(send, 503, "No replica could be reached: " + "; ".join(failed), "service_unavailable",
                         "no_replica", retry_after=True)

    async def _relay(self, name: str, response: httpx.Response, send: Send, state: dict[str, bool]) -> None:
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": _without(response.headers.raw, HOP_BY_HOP)})
        try:
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as err:  # after the first byte: the stream ends as the replica ended it
            log.warning("replica %s ended its answer early: %s", name, err)
        state["done"] = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def create_router(config: RouterConfig, *, api_client: Any = None) -> RouterApp:
    return RouterApp(config.check(), api_client=api_client)
