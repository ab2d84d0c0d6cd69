"""The router's ASGI app: its own endpoints, and every other request relayed to a replica.

    GET /health            200: the process runs
    GET /ready             200 while at least one replica is known (listed ready by its endpoints),
                           else 503; a replica this router marked down still counts (see _own)
    GET /metrics           the router's Prometheus series (router/metrics.py)
    GET /router/replicas   each replica: url, in flight, reported waiting, routed, KV blocks held (JSON,
                           for debugging), and the scorer in use
    anything else          relayed to the replica policy.choose picks

A prompt is scored by the KV blocks each replica's cache holds (kv_view.py: the replicas' KV events,
the prompt tokenized as the frontend does by `prompt_tokenizer`, which the router's program gives
it; where the source the replicas name is not readable here, its files fetched from a replica:
tokenizer_files.py), or, where the router cannot tokenize (no tokenizer loader, a tokenizer neither
readable nor fetched, or a request it cannot tokenize), by the characters it sent each replica
before (policy.PrefixAffinity). The metric label `scorer` and the log say which. The router's own
requests to the replicas present their API key (tokenizer_files.api_key_headers).

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

Here: the lifespan, the router's own endpoints and the order of tries. The client's side (its body,
the router's own answers) is asgi.py; one try on a replica and the relay of its answer, upstream.py;
the HTTP client to the replicas, transport.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from inferencemesh.config import RouterConfig
from inferencemesh.router.asgi import (
    BodyRefused,
    Message,
    Receive,
    Scope,
    Send,
    lifespan,
    read_body,
    send_error,
    send_whole,
)
from inferencemesh.router.kv_view import BLOCKS, CHARACTERS, BlockScorer, KvDigests, KvViews, PromptTokenizer
from inferencemesh.router.metrics import RouterMetrics
from inferencemesh.router.policy import PrefixAffinity, RouteChoice, block_hashes, choose, key_seed, routing_key
from inferencemesh.router.replicas import EndpointSliceWatch, LoadPoller, Replica, ReplicaSet, StaticReplicas, cancel
from inferencemesh.router.tokenizer_files import TokenizerFolders, api_key_headers
from inferencemesh.router.transport import ReplicaTransport
from inferencemesh.router.upstream import Outgoing, Refusal, UpstreamFailed, attempt, relay

log = logging.getLogger("inferencemesh.router")

CONNECT_TIMEOUT_S = 4.0
# When no replica could be reached at all (every try failed before an answer: a connection timed
# out on a saturated node, say, while a rollout's new pods load beside the serving ones), the
# order is tried once more after a pause before the client gets a 503.
UNREACHABLE_ROUNDS = 2
UNREACHABLE_PAUSE_S = 0.5
OWN_PATHS = ("/health", "/ready", "/metrics", "/router/replicas")
TransportFactory = Callable[[], httpx.AsyncBaseTransport]


def replica_transport() -> httpx.AsyncBaseTransport:
    return ReplicaTransport(connect_timeout=CONNECT_TIMEOUT_S)


class RouterApp:
    """The router (an ASGI app, lifespan included: it starts the replica source and the load poller)."""

    def __init__(self, config: RouterConfig, *, api_client: Any = None,
                 transport: TransportFactory = replica_transport,
                 prompt_tokenizer: PromptTokenizer | None = None) -> None:
        self.config = config
        self.make_transport = transport  # the replicas' HTTP client (the latency bench compares others)
        self.header_timeout_s = config.header_timeout  # http_server.server_config's, for the request head
        self.replicas = ReplicaSet()
        self.source: StaticReplicas | EndpointSliceWatch = (
            StaticReplicas(self.replicas, config.frontends) if config.frontends else
            EndpointSliceWatch(self.replicas, config.frontends_service or "", config.namespace,
                               config.frontend_port, api_client=api_client))
        self.affinity = PrefixAffinity(ttl=config.affinity_ttl, max_entries=config.affinity_entries)
        self.kv = KvViews()
        self.tokenizer_folders = TokenizerFolders()
        self.blocks = BlockScorer(self.kv, prompt_tokenizer, fetch=self._fetch_tokenizer)
        self.metrics = RouterMetrics()
        self.metrics.ready_replicas.set_function(lambda: len(self.replicas.up()))
        self.client: httpx.AsyncClient | None = None  # the load poller's
        self.transport = transport()
        self.poller: LoadPoller | None = None
        self._poll_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifespan -------------------------------------------------------------------------

    async def startup(self) -> None:
        self._loop = asyncio.get_running_loop()
        # httpx's models over h11 (router/transport.py). Relayed requests go to the transport itself:
        # no client cookie jar (a Set-Cookie of one client's answer must never ride along on another
        # client's request), no redirects.
        self.transport = self.make_transport()
        self.client = httpx.AsyncClient(transport=self.transport,
                                        timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S), trust_env=False,
                                        follow_redirects=False)
        for name in list(self.client.headers):  # no Accept/User-Agent/... of its own: the client's pass
            del self.client.headers[name]
        # Its own requests (/metrics, /ready, /kv/*) present the frontends' API key; relayed requests
        # go to the transport, with the client's own headers.
        self.client.headers.update(api_key_headers())
        self.replicas.on_removed.append(self._removed_elsewhere)
        self.source.start()
        self.poller = LoadPoller(self.replicas, self.client, self.config.load_poll_interval, kv=self.kv,
                                 after_round=self.blocks.check)
        self._poll_task = asyncio.create_task(self.poller.run())
        if self.blocks.prompt_tokenizer is None:
            log.info("routing by characters: this router has no tokenizer to score prompts by KV blocks")

    async def shutdown(self) -> None:
        await cancel(self._poll_task)
        await cancel(self.blocks.loading)
        self.source.stop()
        if self.client is not None:
            await self.client.aclose()
        self.tokenizer_folders.close()

    async def _fetch_tokenizer(self, source: str) -> str:
        """A folder holding the tokenizer files of a replica whose KV events name `source`."""
        assert self.client is not None
        views = self.kv.views
        urls = [r.url for name, r in self.replicas.up().items() if name in views and views[name].tokenizer == source]
        return await self.tokenizer_folders.fetch(self.client, urls)

    def _removed_elsewhere(self, name: str) -> None:
        """From the watch thread (or the loop): forget a replica that left, on the loop."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._removed, name)

    def _removed(self, name: str) -> None:
        self.affinity.forget(name)  # gone, or back as a new pod: its cache is not the one we knew
        self.kv.forget(name)
        if name not in self.replicas.current():
            self.metrics.remove_replica(name)

    # ---- requests -------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send, self.startup, self.shutdown)
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
            # Known, not only up: every router marks the same slow frontends down, and all unready empty the Service.
            if replicas:
                body = {"status": "ready", "replicas": len(replicas), "up": len(self.replicas.up())}
                await send_whole(send, 200, json.dumps(body).encode())
            else:
                await send_error(send, 503, "No replica is ready.", "service_unavailable", "no_replica",
                                 retry_after=True)
        elif path == "/metrics":
            for name, replica in replicas.items():
                self.metrics.in_flight.labels(name).set(replica.in_flight)
                self.metrics.replica_waiting.labels(name).set(replica.waiting)
                self.metrics.kv_blocks.labels(name).set(self.kv.held(name))
            await send_whole(send, 200, generate_latest(self.metrics.registry),
                             content_type=CONTENT_TYPE_LATEST.encode())
        else:
            body = {"replicas": [{"name": r.name, "url": r.url, "in_flight": r.in_flight, "waiting": r.waiting,
                                  "routed": r.routed, "up": r.down is None, "down": r.down,
                                  "kv_blocks": self.kv.held(r.name)} for r in replicas.values()],
                    "prefix_blocks": len(self.affinity), "scorer": self.blocks.scorer}
            await send_whole(send, 200, json.dumps(body).encode())

    async def _proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await read_body(scope, receive, limit=self.config.max_body_bytes,
                                   timeout_s=self.config.body_timeout)
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


    async def _choose(self, replicas: dict[str, Replica], scope: Scope, body: bytes, key: str | None,
                      blocks: list[int]) -> tuple[RouteChoice, KvDigests | None]:
        digests = await self.blocks.digests(scope["path"], body) if key is not None else None
        scorer = BLOCKS if digests is not None else CHARACTERS
        if digests is not None:
            matches = self.kv.match(digests)
        else:
            matches = self.affinity.match(blocks) if blocks else {}
        choice = choose({name: r.load for name, r in replicas.items()}, matches, seed=key_seed(key),
                        balance_abs=self.config.balance_abs, balance_rel=self.config.balance_rel)
        if blocks and choice.order:
            (self.metrics.affinity_hits if choice.matched_blocks else self.metrics.affinity_misses).labels(
                choice.order[0], scorer).inc()
        return choice, digests

    async def _forward(self, scope: Scope, body: bytes, send: Send, state: dict[str, bool]) -> None:
        """The request to the replicas in the policy's order until one answers (each tried once)."""
        started = time.perf_counter()
        key = routing_key(scope["path"], body) if scope["method"] == "POST" else None
        blocks = block_hashes(key, self.config.block_chars)
        # Down replicas only when none is up: they may be back before the poller has seen it.
        replicas = self.replicas.up() or self.replicas.current()
        choice, digests = await self._choose(replicas, scope, body, key, blocks)
        if not choice.order:
            self.metrics.no_replica.inc()
            await send_error(send, 503, "No replica is ready to serve this request.", "service_unavailable",
                             "no_replica", retry_after=True)
            return
        outgoing = Outgoing.of(scope, body)
        last: Refusal | None = None
        failed: list[str] = []
        for round_ in range(UNREACHABLE_ROUNDS):
            if round_:
                await asyncio.sleep(UNREACHABLE_PAUSE_S)
            for tried, name in enumerate(choice.order):
                request = outgoing.to(replicas[name])
                if tried == 0 and not round_:
                    self.metrics.overhead.observe(time.perf_counter() - started)
                outcome = await self._try(replicas[name], request, (blocks, digests), send, state,
                                          retry=tried + 1 < len(choice.order) or round_ + 1 < UNREACHABLE_ROUNDS)
                if outcome is None:
                    return
                if isinstance(outcome, Refusal):
                    last = outcome
                else:
                    failed.append(outcome)
            if last is not None:  # a replica answered (it refused): no second round
                break
        if last is not None:  # every replica refused it: the last answer, as it came
            await send({"type": "http.response.start", "status": last.status, "headers": last.headers})
            await send({"type": "http.response.body", "body": last.body, "more_body": False})
            return
        log.warning("no replica reachable: %s", "; ".join(failed))
        await send_error(send, 503, "No replica could be reached: " + "; ".join(failed), "service_unavailable",
                         "no_replica", retry_after=True)

    async def _try(self, replica: Replica, request: httpx.Request, prefix: tuple[list[int], KvDigests | None],
                   send: Send, state: dict[str, bool], *, retry: bool) -> Refusal | str | None:
        """One replica: None once the client was answered (by it, or by the router's 502); its
        Refusal, for the next replica to do better; or why it failed before its first bytes."""
        name = replica.name
        replica.in_flight += 1
        try:
            try:
                answer = await attempt(self.transport, replica, request, retry=retry)
            except UpstreamFailed as err:
                self.metrics.retries.labels(name, err.reason).inc()
                return f"{name}: {err.detail}"
            except httpx.HTTPError as err:
                log.warning("replica %s failed: %s", name, err)
                await send_error(send, 502, f"The replica {name} failed: {type(err).__name__}.", "server_error",
                                 "bad_gateway")
                return None
            if isinstance(answer, Refusal):
                self.metrics.requests.labels(name, f"{answer.status // 100}xx").inc()
                self.metrics.retries.labels(name, str(answer.status)).inc()
                return answer
            try:
                blocks, digests = prefix
                if blocks:
                    self.affinity.record(blocks, name)
                if digests:
                    self.kv.expect(name, digests)
                replica.routed += 1
                self.metrics.requests.labels(name, f"{answer[0].status_code // 100}xx").inc()
                await relay(replica, answer, send, state)
                return None
            finally:
                await answer[0].aclose()
        finally:
            replica.in_flight -= 1
            if name not in self.replicas.current():  # it left holding this request: its series go with it
                self.metrics.remove_replica(name)


def create_router(config: RouterConfig, *, api_client: Any = None, transport: TransportFactory = replica_transport,
                  prompt_tokenizer: PromptTokenizer | None = None) -> RouterApp:
    return RouterApp(config.check(), api_client=api_client, transport=transport, prompt_tokenizer=prompt_tokenizer)
