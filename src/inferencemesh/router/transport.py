"""A lean HTTP/1.1 transport for the router's httpx.AsyncClient.

httpx's default transport (httpcore over anyio) costs about 1.9 ms of CPU per request on the
2-core machine the latency bench ran on (tools/router_latency.py; a bare asyncio stream: 0.5 ms
for the same round trip), more than the router's whole budget. The replicas are our own
frontends on a trusted network, plain HTTP/1.1, so the router talks to them through this: the
httpx API (Request, Response, aiter_raw, its exception types) over asyncio streams, with a pool
of kept-alive connections per origin. It frames bodies by Content-Length, chunked encoding or
the connection's end, passes each chunk on as it arrives (an SSE event is one chunk), and
closes a connection whose response was not read to its end (a client that went away).

A body of EXPECT_CONTINUE_BYTES or more is sent only once the replica says `100 Continue`
(RFC 9110 10.1.1): a replica that refuses it from its head alone (413 beyond its own body limit)
answers at once and closes, instead of resetting the connection under a body still being written
(which the router took for a dead replica: 503 "no replica could be reached" for a 2 MiB body).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx

HEAD_LIMIT = 256 * 1024  # the largest response head accepted
READ_SIZE = 64 * 1024
EXPECT_CONTINUE_BYTES = 64 * 1024  # smaller bodies go with their head: one write, no round trip
CONTINUE_WAIT_S = 1.0  # a replica that never says 100 Continue gets the body after this (curl waits 1 s)


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def usable(self) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class _Body(httpx.AsyncByteStream):
    """A response body as it arrives; its connection back to the pool once read to its end."""

    def __init__(self, transport: LeanTransport, origin: tuple[str, int], conn: _Connection, mode: str,
                 length: int, keep_alive: bool) -> None:
        self.transport, self.origin, self.conn = transport, origin, conn
        self.mode, self.length, self.keep_alive = mode, length, keep_alive
        self.done = mode == "empty"

    async def __aiter__(self) -> AsyncIterator[bytes]:
        reader = self.conn.reader
        try:
            if self.mode == "length":
                left = self.length
                while left > 0:
                    chunk = await reader.read(min(left, READ_SIZE))
                    if not chunk:
                        raise httpx.RemoteProtocolError("the replica closed the connection mid-body")
                    left -= len(chunk)
                    yield chunk
            elif self.mode == "chunked":
                while True:
                    line = await reader.readuntil(b"\r\n")
                    size = int(line.split(b";", 1)[0].strip(), 16)
                    if size == 0:
                        while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                            pass
                        break
                    chunk = await reader.readexactly(size)
                    await reader.readexactly(2)
                    yield chunk
            elif self.mode == "close":
                while chunk := await reader.read(READ_SIZE):
                    yield chunk
            self.done = True
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError) as err:
            raise httpx.RemoteProtocolError(f"the replica's body broke off: {err}") from err

    async def aclose(self) -> None:
        conn, self.conn = self.conn, None  # type: ignore[assignment]
        if conn is None:
            return
        if self.done and self.keep_alive and self.mode != "close" and conn.usable():
            self.transport.release(self.origin, conn)
        else:
            conn.close()


class LeanTransport(httpx.AsyncBaseTransport):
    def __init__(self, *, connect_timeout: float, max_idle_per_origin: int = 64) -> None:
        self.connect_timeout, self.max_idle = connect_timeout, max_idle_per_origin
        self._idle: dict[tuple[str, int], list[_Connection]] = {}

    def release(self, origin: tuple[str, int], conn: _Connection) -> None:
        idle = self._idle.setdefault(origin, [])
        if len(idle) < self.max_idle:
            idle.append(conn)
        else:
            conn.close()

    async def _connect(self, origin: tuple[str, int]) -> _Connection:
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
        target = url.raw_path
        body = await request.aread()
        expect = [(b"expect", b"100-continue")] if len(body) >= EXPECT_CONTINUE_BYTES else []
        head = b"".join([request.method.encode(), b" ", target, b" HTTP/1.1\r\n",
                         *(name + b": " + value + b"\r\n" for name, value in [*request.headers.raw, *expect]),
                         b"\r\n"])
        idle = self._idle.get(origin)
        while idle:  # a kept-alive connection; one the replica closed meanwhile fails before any answer
            conn = idle.pop()
            if not conn.usable():
                conn.close()
                continue
            try:
                return await self._exchange(request, origin, conn, head, body)
            except _Stale:
                conn.close()
        return await self._exchange(request, origin, await self._connect(origin), head, body, fresh=True)

    async def _exchange(self, request: httpx.Request, origin: tuple[str, int], conn: _Connection, head: bytes,
                        body: bytes, fresh: bool = False) -> httpx.Response:
        waiting = len(body) >= EXPECT_CONTINUE_BYTES  # the body waits for 100 Continue
        try:
            conn.writer.write(head if waiting else head + body)
            await conn.writer.drain()
            while True:
                if waiting:
                    try:
                        async with asyncio.timeout(CONTINUE_WAIT_S):
                            raw = await conn.reader.readuntil(b"\r\n\r\n")
                    except TimeoutError:
                        raw = b""
                else:
                    raw = await conn.reader.readuntil(b"\r\n\r\n")
                if not raw:  # no word in time: the body goes anyway
                    waiting = False
                    conn.writer.write(body)
                    await conn.writer.drain()
                    continue
                status_line, _, rest = raw.partition(b"\r\n")
                parts = status_line.split(b" ", 2)
                status = int(parts[1])
                if status >= 200 or status == 101:
                    break
                if waiting and status == 100:  # go on: the body, then the real answer
                    waiting = False
                    conn.writer.write(body)
                    await conn.writer.drain()
        except asyncio.CancelledError:
            conn.close()
            raise
        except (asyncio.IncompleteReadError, ConnectionError) as err:
            conn.close()
            if not fresh and isinstance(err, asyncio.IncompleteReadError) and not err.partial:
                raise _Stale from err
            if not fresh and isinstance(err, ConnectionError):
                raise _Stale from err
            raise httpx.RemoteProtocolError("the replica closed the connection without an answer") from err
        except (asyncio.LimitOverrunError, ValueError, IndexError) as err:
            conn.close()
            raise httpx.RemoteProtocolError(f"the replica's answer is not HTTP/1.1: {err}") from err
        headers = []
        # An answer before the body went (a refusal from the head): the replica expects a body
        # that will never come, so the connection is not reused.
        length, chunked, keep_alive = -1, False, parts[0] == b"HTTP/1.1" and not waiting
        for line in rest[:-4].split(b"\r\n") if rest[:-4] else ():
            name, _, value = line.partition(b":")
            name, value = name.strip(), value.strip()
            lower = name.lower()
            if lower == b"content-length":
                length = int(value)
            elif lower == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif lower == b"connection":
                tokens = value.lower()
                keep_alive = b"close" not in tokens and not waiting and (keep_alive or b"keep-alive" in tokens)
            headers.append((name, value))
        if request.method == "HEAD" or status in (204, 304) or length == 0:
            mode = "empty"
        elif chunked:
            mode = "chunked"
        elif length > 0:
            mode = "length"
        else:
            mode = "close"
        stream = _Body(self, origin, conn, mode, length, keep_alive)
        return httpx.Response(status, headers=headers, stream=stream, request=request,
                              extensions={"http_version": b"HTTP/1.1", "reason_phrase": parts[2] if len(parts) > 2
                                          else b""})

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


class _Stale(Exception):
    """A kept-alive connection the replica had closed: the request goes again on a new one."""
