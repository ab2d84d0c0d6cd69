"""The HTTP servers' connection limits (the frontend's and the router's): how long a client may
take to send its headers, how many connections are served at once, how long an idle keep-alive
connection is kept, and which access-log lines are noise.

    uvicorn.Server(server_config(app, host=..., port=...))

uvicorn closes an idle keep-alive connection (timeout_keep_alive) and answers 503 beyond
limit_concurrency, but it waits forever for the first bytes of a request and for the rest of
half-sent headers: 300 silent connections (a slow-loris) stay open, each holding a socket and a
protocol object. HeaderTimeoutProtocol gives each request head a total deadline: header_timeout_s
from the connection, or from the first byte of a kept-alive connection's next head, however the
bytes trickle in (a byte every second does not extend it). A head cut off midway is answered 408
(in OpenAI's error format) before the connection closes; a connection that sent nothing is just
closed. (The body's deadline is the app's, also total: frontend.guard reads the body, the router's
proxy its own.)
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from inferencemesh.config import HTTP_HEADER_TIMEOUT_S as HEADER_TIMEOUT_S

# An idle keep-alive connection is closed after this. Longer than the clients' own pool expiry
# (httpx, the openai client, LangChain: 5 s, aiohttp: 15 s): a client must drop a connection before
# the server does, or a request it sends as the server closes is reset (uvicorn's 5 s default met
# httpx's 5 s, and a test's request after a 5 s pause got "Connection reset by peer"). nginx: 75 s.
KEEP_ALIVE_S = 75
LIMIT_CONCURRENCY = 1024  # connections plus running requests; beyond it uvicorn answers 503
MAX_INCOMPLETE_EVENT_BYTES = 64 * 1024  # the largest request head h11 buffers (uvicorn's 16 KiB is tight for tokens)
# Scraped every second or so (the router's load poller reads each frontend's /metrics and /kv/events;
# Prometheus and the kubelet's probes the rest): their successful answers are not worth an access-log line.
QUIET_PATHS = frozenset({"/metrics", "/health", "/ready", "/kv/events"})


def timeout_answer(message: str) -> bytes:
    """A whole HTTP/1.1 408 in OpenAI's error format that closes its connection."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": "request_timeout"}}).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


class HeaderTimeoutProtocol(H11Protocol):
    """h11's protocol, closing a connection whose request head does not arrive, whole, in time."""

    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = False  # bytes of the awaited head arrived
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        between = self._between_requests()
        super().data_received(data)
        if not self._between_requests():
            self._disarm()  # the head is whole: the request is the app's now (its body has its own deadline)
        elif between:  # bytes of a next head are arriving (or trickling in): the deadline runs from the first
            self._head_bytes = True
            self._arm()

    def on_response_complete(self) -> None:
        # The kept-alive connection's idle time is uvicorn's keep-alive timeout; the next head's
        # deadline starts with its first byte.
        self._disarm()
        self._head_bytes = False
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._head_timer is None:  # armed once per head: trickling bytes never extend it
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _expire(self) -> None:
        self._head_timer = None
        if not self._between_requests() or self.transport.is_closing():
            return
        if self._head_bytes:
            self.transport.write(timeout_answer(
                f"The request head did not arrive within {self.header_timeout_s:g} s."))
        self.transport.close()


def protocol_with(header_timeout_s: float) -> type[HeaderTimeoutProtocol]:
    """HeaderTimeoutProtocol with another header timeout (tests use short ones)."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": header_timeout_s})


class QuietScrapes(logging.Filter):
    """Drops uvicorn's access-log lines of successful GETs of QUIET_PATHS; errors stay."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) != 5:  # (client, method, path, http version, status)
            return True
        _, method, path, _, status = args
        return not (method == "GET" and str(path).partition("?")[0] in QUIET_PATHS
                    and isinstance(status, int) and status < 400)


_QUIET_SCRAPES = QuietScrapes()


def server_config(app: Any, *, header_timeout_s: float | None = None, limit_concurrency: int = LIMIT_CONCURRENCY,
                  **settings: Any) -> uvicorn.Config:
    """uvicorn's Config for the frontend and the router: these limits, then `settings` (host, port, log_level, ...).
    header_timeout_s None: the app's own `header_timeout_s` where it has one (the router's, from its
    --header-timeout), else HEADER_TIMEOUT_S."""
    if header_timeout_s is None:
        header_timeout_s = float(getattr(app, "header_timeout_s", HEADER_TIMEOUT_S))
    config = uvicorn.Config(app, http=protocol_with(header_timeout_s), limit_concurrency=limit_concurrency,
                            timeout_keep_alive=KEEP_ALIVE_S, h11_max_incomplete_event_size=MAX_INCOMPLETE_EVENT_BYTES,
                            **settings)
    # After the Config: it configures logging when made. The same filter object is added once.
    logging.getLogger("uvicorn.access").addFilter(_QUIET_SCRAPES)
    return config
