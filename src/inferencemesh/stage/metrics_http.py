"""A stage's HTTP endpoint, served on its event loop: no thread per connection. It answers
Prometheus (/metrics) and the kubelet's probes (/ready, /live).

prometheus_client's own server gives every connection a thread and never times one out: idle
connections piled up threads (300 made 311). Here a connection is a coroutine; it gets
READ_TIMEOUT_S to send its request, at most MAX_CONNECTIONS are open at once (more are closed
at once), and each gets one answer, then is closed.

The probes are answered in-process, the same with mutual TLS or without: an exec probe started an
interpreter per probe (0.5-1.9 s on a loaded 2-core node, past its 1 s timeout: Ready flapped), and
the kubelet's gRPC probe presents no client certificate. /ready is 200 while the stage's
grpc.health.v1 status is SERVING, else 503 with why not (loading, draining, failed); /live is 200
whenever the event loop answers (a busy compute thread does not stop it: it runs elsewhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

READ_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 32
MAX_REQUEST_BYTES = 8 * 1024
TEXT = b"text/plain; charset=utf-8"

# Why the stage does not serve now, "" while it does (what /ready answers). Called on the event loop.
Readiness = Callable[[], str]
STATE_FAMILY = "inferencemesh_stage_state"  # stage/metrics.py: 1 for the stage's lifecycle state


def published_state(registry: CollectorRegistry) -> Readiness:
    """Readiness from the lifecycle state the stage publishes in its registry (ready once its layers
    are loaded, as grpc.health.v1 turns SERVING): for an endpoint given no health source."""
    def why_not() -> str:
        for family in registry.collect():
            if family.name == STATE_FAMILY:
                states = [s.labels.get("state", "") for s in family.samples if s.value == 1.0]
                return "" if states == ["ready"] else ", ".join(states) or "no state yet"
        return "no health is reported here"
    return why_not


class MetricsEndpoint:
    def __init__(self, registry: CollectorRegistry, read_timeout_s: float = READ_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS, readiness: Readiness | None = None) -> None:
        self.registry = registry
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self.readiness = readiness or published_state(registry)
        self.open_connections = 0
        self.server: asyncio.Server | None = None

    def listen(self, host: str, port: int) -> tuple[str, int]:
        """Bind (now: a busy port raises here, not in a task) and serve on the running loop;
        returns the bound address."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(64)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        address = sock.getsockname()[:2]
        asyncio.get_running_loop().create_task(self._serve(sock))
        return address

    async def _serve(self, sock: socket.socket) -> None:
        self.server = await asyncio.start_server(self._answer, sock=sock, limit=MAX_REQUEST_BYTES)

    def route(self, method: bytes, path: bytes) -> tuple[bytes, bytes, bytes]:
        """(status, content type, body) of one request."""
        if method not in (b"GET", b"HEAD"):
            return b"405 Method Not Allowed", TEXT, b"only GET\n"
        if path in (b"/", b"/metrics"):
            return b"200 OK", CONTENT_TYPE_LATEST.encode(), generate_latest(self.registry)
        if path == b"/live":
            return b"200 OK", TEXT, b"alive\n"
        if path == b"/ready":
            reason = self.readiness()
            if not reason:
                return b"200 OK", TEXT, b"SERVING\n"
            return b"503 Service Unavailable", TEXT, f"NOT_SERVING: {reason}\n".encode()
        return b"404 Not Found", TEXT, b"not found: /metrics, /ready and /live are served\n"

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.open_connections >= self.max_connections:
            writer.close()
            return
        self.open_connections += 1
        try:
            async with asyncio.timeout(self.read_timeout_s):  # not wait_for: it can lose a cancel (3.11)
                head = await reader.readuntil(b"\r\n\r\n")
            method, _, rest = head.partition(b" ")
            status, kind, body = self.route(method, rest.split(b" ", 1)[0].split(b"?", 1)[0])
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + kind + b"\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n"
                         + (b"" if method == b"HEAD" else body))
            async with asyncio.timeout(self.read_timeout_s):
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # a silent, slow or broken client: dropped
        finally:
            self.open_connections -= 1
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
