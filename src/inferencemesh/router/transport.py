"""The router's HTTP/1.1 client to its replicas: httpx's request and response models over h11.

h11 (the parser uvicorn's server runs on, here and in every frontend) frames both ways: request
heads and bodies out, response heads, Content-Length, chunked and connection-delimited bodies,
HEAD/204/304 and keep-alive in. It does no I/O, so what stays here is the router's own: asyncio
connections, a pool of kept-alive ones per origin, the retry of a request on a new connection when
a kept-alive one turns out closed, and 100-continue. Each body chunk is passed on as it arrives
(an SSE stream unbuffered); a connection whose response was not read to its end is closed.

Measured (tools/router_latency.py, docs/benchmarks/router-transports.json, interleaved): h11 adds
0.1 to 0.2 ms per request to the hand-written parser this replaced, nothing measurable per SSE
event; httpx's own transport (httpcore over anyio) roughly doubles what the router adds.

A body of EXPECT_CONTINUE_BYTES or more is sent only once the replica says `100 Continue`
(RFC 9110 10.1.1): a replica that refuses it from its head alone (413 beyond its own body limit)
answers at once and closes, instead of resetting the connection under a body still being written
(which the router took for a dead replica: 503 "no replica could be reached" for a 2 MiB body).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import h11
import httpx

HEAD_LIMIT = 256 * 1024  # a response head beyond this (give or take one read) is refused
READ_SIZE = 64 * 1024
EXPECT_CONTINUE_BYTES = 64 * 1024  # smaller bodies go with their head: one write, no round trip
CONTINUE_WAIT_S = 1.0  # a replica that never says 100 Continue gets the body after this (curl waits 1 s)

Origin = tuple[str, int]


class _Stale(Exception):
    """A kept-alive connection the replica had closed: the request goes again on a new one."""


class _Connection:
    """One connection to a replica, and h11's state of the exchange on it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=HEAD_LIMIT)
        self.heard = False  # whether any byte of the current answer came

    def usable(self) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof()

    def ready_for_next(self) -> bool:
        """Readies the connection for its next request when the exchange ended whole on both sides,
        neither asking to close; else False. (An answer that came before the body went did not: the
        replica still expects that body.)"""
        done = self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE
        if done and self.usable():
            self.h11.start_next_cycle()
            return True
        return False

    async def send(self, *events: h11.Event) -> None:
        self.writer.write(b"".join(self.h11.send(event) or b"" for event in events))
        await self.writer.drain()

    async def next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        """h11's next event of the answer (never NEED_DATA), reading as much as it needs."""
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = await self.reader.read(READ_SIZE)
            self.heard = self.heard or bool(data)
            self.h11.receive_data(data)  # b"": the connection's end

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class _Body(httpx.AsyncByteStream):
    """A response body as it arrives; its connection back to the pool once read to its end."""

    def __init__(self, transport: ReplicaTransport, origin: Origin, conn: _Connection) -> None:
        self.transport, self.origin, self.conn = transport, origin, conn

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            while isinstance(event := await self.conn.next_event(), h11.Data):
                yield bytes(event.data)
        except (h11.RemoteProtocolError, ConnectionError) as err:
            raise httpx.RemoteProtocolError(f"the replica's body broke off: {err}") from err
        if not isinstance(event, h11.EndOfMessage):
            raise httpx.RemoteProtocolError(f"the replica's body broke off: {type(event).__name__}")

    async def aclose(self) -> None:
        conn, self.conn = self.conn, None  # type: ignore[assignment]
        if conn is None:
            return
        if conn.ready_for_next():
            self.transport.release(self.origin, conn)
        else:
            conn.close()


class ReplicaTransport(httpx.AsyncBaseTransport):
    """An httpx transport over pooled h11 connections, plain HTTP/1.1 (the replicas are the
    router's own frontends on a trusted network)."""

    def __init__(self, *, connect_timeout: float, max_idle_per_origin: int = 64) -> None:
        self.connect_timeout, self.max_idle = connect_timeout, max_idle_per_origin
        self._idle: dict[Origin, list[_Connection]] = {}

    def release(self, origin: Origin, conn: _Connection) -> None:
        idle = self._idle.setdefault(origin, [])
        if len(idle) < self.max_idle:
            idle.append(conn)
        else:
            conn.close()

    async def _connect(self, origin: Origin) -> _Connection:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(*origin, limit=HEAD_LIMIT),
                                                    self.connect_timeout)
        except TimeoutError as err:
            raise httpx.ConnectTimeout(f"connecting to {origin[0]}:{origin[1]} timed out") from err
        except OSError as err:
            raise httpx.ConnectError(f"{origin[0]}:{origin[1]}: {err.strerror or err}") from err
        return _Connection(reader, writer)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"the router speaks plain HTTP to its replicas, not {url.scheme}")
        origin = (url.host, url.port or 80)
        body = await request.aread()
        expect = [(b"expect", b"100-continue")] if len(body) >= EXPECT_CONTINUE_BYTES else []
        try:
            head = h11.Request(method=request.method, target=url.raw_path, headers=[*request.headers.raw, *expect])
        except h11.LocalProtocolError as err:
            raise httpx.LocalProtocolError(f"the request cannot be sent as HTTP/1.1: {err}") from err
        idle = self._idle.get(origin)
        while idle:  # a kept-alive connection; one the replica closed meanwhile fails before any answer
            conn = idle.pop()
            if not conn.usable():
                conn.close()
                continue
            with contextlib.suppress(_Stale):
                return self._response(request, origin, conn, await self._exchange(conn, head, body, fresh=False))
        conn = await self._connect(origin)
        return self._response(request, origin, conn, await self._exchange(conn, head, body, fresh=True))

    async def _exchange(self, conn: _Connection, head: h11.Request, body: bytes, *, fresh: bool) -> h11.Response:
        """The request sent, the answer's head read; _Stale when a kept-alive connection (not
        `fresh`) was closed before a byte of the answer came."""
        conn.heard = False
        try:
            return await _send_and_read_head(conn, head, body)
        except asyncio.CancelledError:
            conn.close()
            raise
        except (h11.RemoteProtocolError, ConnectionError) as err:
            conn.close()
            if not fresh and not conn.heard:
                raise _Stale from err
            if not conn.heard:
                raise httpx.RemoteProtocolError("the replica closed the connection without an answer") from err
            raise httpx.RemoteProtocolError(f"the replica's answer is not HTTP/1.1: {err}") from err

    def _response(self, request: httpx.Request, origin: Origin, conn: _Connection,
                  head: h11.Response) -> httpx.Response:
        return httpx.Response(head.status_code, headers=head.headers.raw_items(), request=request,
                              stream=_Body(self, origin, conn),
                              extensions={"http_version": b"HTTP/" + head.http_version,
                                          "reason_phrase": head.reason})

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


async def _send_and_read_head(conn: _Connection, head: h11.Request, body: bytes) -> h11.Response:
    """Send the request (a large body once the replica says 100 Continue, or after CONTINUE_WAIT_S
    without a word) and read up to the final answer's head."""
    waiting = len(body) >= EXPECT_CONTINUE_BYTES
    rest: list[h11.Event] = [h11.Data(data=body), h11.EndOfMessage()] if body else [h11.EndOfMessage()]
    await (conn.send(head) if waiting else conn.send(head, *rest))
    while True:
        event: h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED] | None
        try:
            async with asyncio.timeout(CONTINUE_WAIT_S if waiting else None):
                event = await conn.next_event()
        except TimeoutError:
            event = None  # no word in time: the body goes anyway
        if isinstance(event, h11.Response):
            return event  # before the body went: a refusal from the head, and the body never goes
        if waiting and (event is None or isinstance(event, h11.InformationalResponse) and event.status_code == 100):
            waiting = False
            await conn.send(*rest)
        elif not isinstance(event, h11.InformationalResponse):
            raise h11.RemoteProtocolError(f"expected an answer's head, got {event!r}")
