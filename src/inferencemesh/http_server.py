"""The HTTP servers' connection limits (the frontend's and the router's): how long a client may
take to send its headers, how many connections are served at once, how long an idle keep-alive
connection is kept.

    uvicorn.Server(server_config(app, host=..., port=...))

uvicorn closes an idle keep-alive connection (timeout_keep_alive) and answers 503 beyond
limit_concurrency, but it waits forever for the first bytes of a request and for the rest of
half-sent headers: 300 silent connections (a slow-loris) stay open, each holding a socket and a
protocol object. HeaderTimeoutProtocol closes a connection that has not sent a whole request
head within header_timeout_s of connecting or of its last response. (The body's read timeout is
the app's: frontend.app's guard reads the body, the router's proxy its own.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0  # a request head (request line and headers) must arrive within this
# An idle keep-alive connection is closed after this. Longer than the clients' own pool expiry
# (httpx, the openai client, LangChain: 5 s, aiohttp: 15 s): a client must drop a connection before
# the server does, or a request it sends as the server closes is reset (uvicorn's 5 s default met
# httpx's 5 s, and a test's request after a 5 s pause got "Connection reset by peer"). nginx: 75 s.
KEEP_ALIVE_S = 75
LIMIT_CONCURRENCY = 1024  # connections plus running requests; beyond it uvicorn answers 503
MAX_INCOMPLETE_EVENT_BYTES = 64 * 1024  # the largest request head h11 buffers (uvicorn's 16 KiB is tight for tokens)


class HeaderTimeoutProtocol(H11Protocol):
    """h11's protocol, closing a connection whose request head does not arrive in time."""

    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._between_requests():  # bytes of a next request head are arriving (or trickling in)
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._expire)

    def _expire(self) -> None:
        self._head_timer = None
        # A request being served is the app's business; the next head is timed from the next bytes.
        if self._between_requests() and not self.transport.is_closing():
            self.transport.close()


def protocol_with(header_timeout_s: float) -> type[HeaderTimeoutProtocol]:
    """HeaderTimeoutProtocol with another header timeout (tests use short ones)."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": header_timeout_s})


def server_config(app: Any, *, header_timeout_s: float = HEADER_TIMEOUT_S, limit_concurrency: int = LIMIT_CONCURRENCY,
                  **settings: Any) -> uvicorn.Config:
    """uvicorn's Config for the frontend and the router: these limits, then `settings` (host, port, log_level, ...)."""
    return uvicorn.Config(app, http=protocol_with(header_timeout_s), limit_concurrency=limit_concurrency,
                          timeout_keep_alive=KEEP_ALIVE_S, h11_max_incomplete_event_size=MAX_INCOMPLETE_EVENT_BYTES,
                          **settings)
