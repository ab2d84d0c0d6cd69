"""Where the replicas come from, and how loaded each is.

- StaticReplicas: a fixed list of frontend base URLs (`http://127.0.0.1:8001`, or `NAME=URL`).
- EndpointSliceWatch: the ready endpoints of a Kubernetes Service, from its EndpointSlices
  (label kubernetes.io/service-name), watched in a background thread with the official client
  (list, then watch from the list's resourceVersion; relist on any error or expiry), through
  discovery.k8s.io/v1 where the server has it, else v1beta1 (Kubernetes 1.20 has only that).
- LoadPoller: every replica's /metrics, read every `interval` seconds by one task, for
  inferencemesh_num_requests_waiting, and then its KV events (GET /kv/events: kv_view.py); a
  replica whose /metrics fails keeps its last value. A replica that is down (it refused or dropped
  a connection: Replica.mark_down) is asked its /ready instead, and is up again once that answers 200.

ReplicaSet holds the current replicas: the watch thread replaces them, the router's event loop
reads them and counts its requests in flight on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from inferencemesh.flags import ConfigError
from inferencemesh.kube_config import load_api_client
from inferencemesh.router.kv_view import KvViews

log = logging.getLogger("inferencemesh.router")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
WAITING_METRIC = "inferencemesh_num_requests_waiting"
# A Deployment's pod: NAME-<pod-template-hash>-<5 characters>.
_POD_SUFFIX = re.compile(r"^(?P<name>.+)-[a-z0-9]{5,10}-[a-z0-9]{5}$")
WATCH_TIMEOUT_S = 300  # the server ends a watch after this; the next one starts from where it ended
RETRY_S = (0.5, 1.0, 2.0, 5.0)  # backoff between failed list/watch attempts


@dataclass
class Replica:
    """One frontend the router sends requests to, and what the router knows of its load."""

    name: str
    url: str  # base URL, no trailing slash
    in_flight: int = 0  # this router's requests to it, not yet finished
    waiting: float = 0.0  # its inferencemesh_num_requests_waiting, last read
    routed: int = 0  # requests this router sent it (answered by it)
    # Why it is down (it refused a connection, or closed one without an answer or mid-answer): no
    # request goes to it while another replica is up, until its /ready answers 200. None: up.
    down: str | None = None

    @property
    def load(self) -> float:
        return self.in_flight + self.waiting

    def mark_down(self, reason: str) -> None:
        if self.down is None:
            log.warning("replica %s (%s) is down: %s; requests go to the others until its /ready answers",
                        self.name, self.url, reason)
        self.down = reason

    def mark_up(self) -> None:
        if self.down is not None:
            log.info("replica %s (%s) is up again", self.name, self.url)
        self.down = None


class ReplicaSet:
    """The current replicas by name. `update` (any thread) replaces the set; a replica whose name
    and URL stay keeps its counters; `on_removed` hears of each one that went away (on the thread
    that updated: listeners must be thread-safe or hand over to the loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._replicas: dict[str, Replica] = {}
        self.synced = threading.Event()  # the first update arrived
        self.on_removed: list[Callable[[str], None]] = []

    def update(self, endpoints: Mapping[str, str]) -> None:
        with self._lock:
            old = self._replicas
            new = {}
            for name, url in endpoints.items():
                kept = old.get(name)
                new[name] = kept if kept is not None and kept.url == url else Replica(name, url)
            self._replicas = new
            gone = [name for name, replica in old.items() if new.get(name) is not replica]
        self.synced.set()
        for name in gone:  # gone, or back under another URL (a new pod: a cold cache)
            log.info("replica %s (%s) left", name, old[name].url)
            for listener in self.on_removed:
                listener(name)
        for name, replica in new.items():
            if old.get(name) is not replica:
                log.info("replica %s at %s", name, replica.url)

    def current(self) -> dict[str, Replica]:
        """A snapshot (the dict is replaced, never changed in place)."""
        return self._replicas

    def up(self) -> dict[str, Replica]:
        """The replicas that are not down."""
        return {name: replica for name, replica in self._replicas.items() if replica.down is None}

    def get(self, name: str) -> Replica | None:
        return self._replicas.get(name)


# ---- static replicas --------------------------------------------------------------------------


def parse_frontends(items: Iterable[str]) -> dict[str, str]:
    """name -> base URL from `URL` (named host:port) or `NAME=URL` items."""
    found: dict[str, str] = {}
    for item in items:
        name, sep, url = item.partition("=")
        if not sep:
            name, url = "", item
        url = url.strip().rstrip("/")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"--frontends {item!r}: give a base URL such as http://10.0.0.5:8000 (or NAME=URL)")
        name = name.strip() or parts.netloc
        if name in found:
            raise ConfigError(f"--frontends names {name!r} twice")
        found[name] = url
    return found


class StaticReplicas:
    """A fixed list: set once."""

    def __init__(self, replicas: ReplicaSet, frontends: Iterable[str]) -> None:
        self.replicas, self.endpoints = replicas, parse_frontends(frontends)

    def start(self) -> None:
        self.replicas.update(self.endpoints)

    def stop(self) -> None:
        pass


# ---- Kubernetes EndpointSlices ---------------------------------------------------------------


def replica_name(endpoint: Mapping[str, Any], address: str) -> str:
    """A pod's Deployment name (`mesh-p1-frontend-7d9f8c6b5-x2x9z` -> `mesh-p1-frontend`), else the
    pod's name, else the address."""
    ref = endpoint.get("targetRef") or {}
    pod = ref.get("name") if ref.get("kind", "Pod") == "Pod" else None
    if not pod:
        return address
    found = _POD_SUFFIX.match(pod)
    return found.group("name") if found else pod


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def endpoints_of(slices: Iterable[Mapping[str, Any]], default_port: int) -> dict[str, str]:
    """name -> URL of every ready endpoint of these EndpointSlices (as dicts, either API version).
    Two ready pods of one Deployment (a rolling update) are named by their pod names."""
    found: list[tuple[str, str, str]] = []  # (short name, full name, url)
    seen: set[str] = set()
    for piece in slices:
        port = next((p.get("port") for p in piece.get("ports") or [] if p.get("name") == "http" and p.get("port")),
                    default_port)
        for endpoint in piece.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready") is False:
                continue
            for address in endpoint.get("addresses") or []:
                url = f"http://{_host(address)}:{port}"
                if url in seen:
                    continue
                seen.add(url)
                pod = (endpoint.get("targetRef") or {}).get("name") or address
                found.append((replica_name(endpoint, address), pod, url))
                break  # one address per endpoint: they are the same pod
    counts: dict[str, int] = {}
    for short, _, _ in found:
        counts[short] = counts.get(short, 0) + 1
    named: dict[str, str] = {}
    for short, full, url in sorted(found, key=lambda item: item[2]):
        name = short if counts[short] == 1 else full
        if name in named:  # one pod, several addresses in several slices: keep the first
            name = f"{name}@{url}"
        named[name] = url
    return named


def default_namespace() -> str:
    try:
        return NAMESPACE_FILE.read_text().strip() or "default"
    except OSError:
        return "default"


class EndpointSliceWatch:
    """The ready endpoints of Service `service` in `namespace`, kept in `replicas` by a watch."""

    def __init__(self, replicas: ReplicaSet, service: str, namespace: str | None, default_port: int,
                 api_client: Any = None) -> None:
        self.replicas, self.service, self.default_port = replicas, service, default_port
        self.namespace = namespace or default_namespace()
        self._api_client = api_client
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._watcher: Any = None
        self.api_version: str | None = None

    def _client(self) -> Any:
        if self._api_client is None:
            self._api_client = load_api_client()
        return self._api_client

    def _resource(self) -> Any:
        from kubernetes.dynamic import DynamicClient
        from kubernetes.dynamic.exceptions import ResourceNotFoundError

        dynamic = DynamicClient(self._client())
        for version in ("discovery.k8s.io/v1", "discovery.k8s.io/v1beta1"):
            try:
                resource = dynamic.resources.get(api_version=version, kind="EndpointSlice")
            except ResourceNotFoundError:
                continue
            self.api_version = version
            return resource
        raise RuntimeError("the API server serves no EndpointSlice (discovery.k8s.io/v1 or v1beta1)")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="endpointslice-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        watcher = self._watcher
        if watcher is not None:
            watcher.stop()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _run(self) -> None:
        from kubernetes import watch

        failures = 0
        resource = None
        selector = f"{SERVICE_NAME_LABEL}={self.service}"
        while not self._stopping.is_set():
            try:
                if resource is None:
                    resource = self._resource()
                    log.info("watching the EndpointSlices of %s/%s (%s)", self.namespace, self.service,
                             self.api_version)
                listed = resource.get(namespace=self.namespace, label_selector=selector).to_dict()
                slices = {item["metadata"]["name"]: item for item in listed.get("items") or []}
                self.replicas.update(endpoints_of(slices.values(), self.default_port))
                version = listed["metadata"]["resourceVersion"]
                failures = 0
                self._watcher = watcher = watch.Watch()
                for event in resource.watch(namespace=self.namespace, label_selector=selector,
                                            resource_version=version, timeout=WATCH_TIMEOUT_S, watcher=watcher):
                    if self._stopping.is_set():
                        break
                    kind, item = event["type"], event["raw_object"]
                    if kind == "ERROR":  # 410 Gone (expired resourceVersion) and the like: relist
                        log.info("EndpointSlice watch: %s; listing again", item.get("message", item))
                        break
                    name = item.get("metadata", {}).get("name")
                    if kind == "DELETED":
                        slices.pop(name, None)
                    elif kind in ("ADDED", "MODIFIED"):
                        slices[name] = item
                    else:  # BOOKMARK
                        continue
                    self.replicas.update(endpoints_of(slices.values(), self.default_port))
            except Exception as err:  # noqa: BLE001 - the watch must outlive any API error
                if self._stopping.is_set():
                    break
                delay = RETRY_S[min(failures, len(RETRY_S) - 1)]
                failures += 1
                log.warning("EndpointSlice watch of %s/%s failed (%s); again in %.1fs", self.namespace,
                            self.service, err, delay)
                self._stopping.wait(delay)


# ---- load -------------------------------------------------------------------------------------


def waiting_of(text: str) -> float:
    """inferencemesh_num_requests_waiting from a /metrics page (summed over its series)."""
    total, found = 0.0, False
    for family in text_string_to_metric_families(text):
        if family.name == WAITING_METRIC:
            for sample in family.samples:
                if sample.name == WAITING_METRIC:
                    total += sample.value
                    found = True
    if not found:
        raise ValueError(f"no {WAITING_METRIC} on the page")
    return total


class LoadPoller:
    """Reads every replica's /metrics (and, with `kv`, its KV events) every `interval` seconds (one
    task, all replicas at once); `after_round` runs after each round."""

    def __init__(self, replicas: ReplicaSet, client: httpx.AsyncClient, interval: float, *,
                 kv: KvViews | None = None, after_round: Callable[[], None] | None = None) -> None:
        self.replicas, self.client, self.interval = replicas, client, interval
        self.kv, self.after_round = kv, after_round
        self.polls = 0  # rounds done (tests wait on it)

    async def _poll(self, replica: Replica) -> None:
        try:  # the router's transport has no read timeout of its own: a replica that hangs is cut off here
            async with asyncio.timeout(max(self.interval, 0.5)):
                if replica.down is not None:  # back once it is ready (a restarted frontend loads first)
                    if (await self.client.get(replica.url + "/ready")).status_code == 200:
                        replica.mark_up()
                    return
                response = await self.client.get(replica.url + "/metrics")
                response.raise_for_status()
                replica.waiting = waiting_of(response.text)
                if self.kv is not None:
                    await self.kv.poll(self.client, replica.name, replica.url)
        except httpx.ConnectError as err:  # refused: nothing listens (a slow answer is only slow)
            replica.mark_down(str(err) or type(err).__name__)
        except (httpx.HTTPError, ValueError, TimeoutError) as err:
            log.debug("load or KV events of %s not read: %s", replica.name, err)

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            await asyncio.gather(*(self._poll(r) for r in list(self.replicas.current().values())))
            if self.after_round is not None:
                self.after_round()
            self.polls += 1
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))


async def cancel(task: asyncio.Task | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
