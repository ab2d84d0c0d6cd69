"""The router's HTTP client to its replicas (router/transport.py: httpx's models over h11) against
scripted servers that answer byte for byte what a test says: every framing a replica may use, the
pool and its retry on a kept-alive connection the replica closed, 100-continue, and answers that
are broken or not HTTP at all, which must end in an httpx error, never a hang or another error."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from router_upstream import free_port

from inferencemesh.router import transport as transport_module
from inferencemesh.router.transport import EXPECT_CONTINUE_BYTES, HEAD_LIMIT, ReplicaTransport

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """A request's head and its Content-Length body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    expects = b"expect: 100-continue" in head.lower()
    return head, b"" if expects else await reader.readexactly(length)


@contextlib.asynccontextmanager
async def scripted(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A server running `handler` on each connection; yields its URL and its connections, counted."""
    connections: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(len(connections))
        with contextlib.suppress(Exception):
            await handler(reader, writer)
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", connections


async def fetch(transport: ReplicaTransport, url: str, body: bytes = b"", method: str | None = None
                ) -> tuple[int, bytes]:
    length = [(b"content-length", str(len(body)).encode())] if body else []
    request = httpx.Request(method or ("POST" if body else "GET"), url + "/v1/x",
                            headers=[(b"host", b"replica"), *length], stream=httpx.ByteStream(body))
    response = await transport.handle_async_request(request)
    try:
        return response.status_code, await response.aread()
    finally:
        await response.aclose()


def answering(*answers: bytes, close: bool = False) -> Handler:
    """Each request on a connection gets the next answer; then the connection closes (`close`) or waits."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for answer in answers:
            await read_request(reader)
            writer.write(answer)
            await writer.drain()
        if not close:
            await reader.read()
    return handler


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))  # type: ignore[arg-type]


CHUNKED = (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
           b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nx-trailer: 1\r\n\r\n")


@pytest.mark.parametrize(("answer", "body"), [(OK, b"ok"), (CHUNKED, b"hello world"),
                                              (b"HTTP/1.1 204 No Content\r\n\r\n", b"")],
                         ids=["content-length", "chunked-with-extension-and-trailer", "204"])
def test_framed_answers_are_read_whole_and_their_connection_is_kept(answer: bytes, body: bytes) -> None:
    async def go() -> None:
        async with scripted(answering(answer, answer)) as (url, connections):
            transport, status = ReplicaTransport(connect_timeout=2), int(answer.split(b" ")[1])
            assert await fetch(transport, url) == (status, body)
            assert await fetch(transport, url) == (status, body)
            assert len(connections) == 1  # the second request on the kept-alive connection
            await transport.aclose()
    run(go())


def test_an_answer_to_head_has_no_body_whatever_its_length_says() -> None:
    async def go() -> None:
        async with scripted(answering(b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\n", OK)) as (url, connections):
            transport = ReplicaTransport(connect_timeout=2)
            assert await fetch(transport, url, method="HEAD") == (200, b"")
            assert await fetch(transport, url) == (200, b"ok") and len(connections) == 1
            await transport.aclose()
    run(go())


def test_a_body_that_ends_with_the_connection_is_whole_and_the_connection_is_not_reused() -> None:
    async def go() -> None:
        async with scripted(answering(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end", close=True)
                            ) as (url, connections):
            transport = ReplicaTransport(connect_timeout=2)
            assert await fetch(transport, url) == (200, b"until the end")
            assert await fetch(transport, url) == (200, b"until the end") and len(connections) == 2
            await transport.aclose()
    run(go())


def test_a_kept_alive_connection_the_replica_closed_is_replaced_without_an_error() -> None:
    async def go() -> None:
        async with scripted(answering(OK, close=True)) as (url, connections):  # one answer per connection
            transport = ReplicaTransport(connect_timeout=2)
            for _ in range(3):
                assert await fetch(transport, url) == (200, b"ok")
            assert len(connections) == 3
            await transport.aclose()
    run(go())


@pytest.mark.parametrize(("answer", "says"), [
    (b"", "without an answer"),
    (b"NOT HTTP AT ALL\r\n\r\n", "not HTTP/1.1"),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part", "broke off"),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", "broke off"),
    (b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * (2 * HEAD_LIMIT) + b"\r\n\r\n", "not HTTP/1.1"),
], ids=["closed-without-a-byte", "not-http", "cut-body", "bad-chunk-size", "head-beyond-the-limit"])
def test_a_broken_answer_is_an_httpx_protocol_error(answer: bytes, says: str) -> None:
    async def go() -> None:
        async with scripted(answering(answer, close=True)) as (url, _):
            transport = ReplicaTransport(connect_timeout=2)
            with pytest.raises(httpx.RemoteProtocolError, match=says):
                await fetch(transport, url)
            await transport.aclose()
    run(go())


def test_a_refused_connection_is_a_connect_error() -> None:
    async def go() -> None:
        with pytest.raises(httpx.ConnectError):
            await fetch(ReplicaTransport(connect_timeout=2), f"http://127.0.0.1:{free_port()}")
    run(go())


def test_a_large_body_goes_after_100_continue_and_a_refusal_from_the_head_is_answered() -> None:
    body = b"b" * EXPECT_CONTINUE_BYTES

    async def continues(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_request(reader)
        assert b"expect: 100-continue" in head.lower()
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        got = await reader.readexactly(len(body))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(got[:10]), got[:10]))
        await writer.drain()
        await reader.read()

    async def refuses(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)  # the head only: the body is not read, and never comes
        writer.write(b"HTTP/1.1 413 Too Large\r\ncontent-length: 3\r\n\r\nbig")
        await writer.drain()
        await asyncio.sleep(0.5)

    async def go() -> None:
        async with scripted(continues) as (url, _):
            assert await fetch(ReplicaTransport(connect_timeout=2), url, body) == (200, b"b" * 10)
        async with scripted(refuses) as (url, connections):
            transport = ReplicaTransport(connect_timeout=2)
            assert await fetch(transport, url, body) == (413, b"big")
            assert await fetch(transport, url, body) == (413, b"big")
            assert len(connections) == 2  # the replica still expects the first body: not reused
    run(go())


def test_a_replica_that_never_says_100_continue_gets_the_body_after_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport_module, "CONTINUE_WAIT_S", 0.2)
    body = b"c" * EXPECT_CONTINUE_BYTES

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        got = await reader.readexactly(len(body))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(got) + got)
        await writer.drain()
        await reader.read()

    async def go() -> None:
        async with scripted(silent) as (url, _):
            assert await fetch(ReplicaTransport(connect_timeout=2), url, body) == (200, body)
    run(go())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(answer=st.one_of(
    st.binary(max_size=300),
    st.builds(lambda head, rest: head + rest, st.sampled_from([
        b"HTTP/1.1 200 OK\r\n", b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n", b"HTTP/1.0 200 OK\r\n\r\n", b"HTTP/1.1 100 Continue\r\n\r\n"]),
        st.binary(max_size=200))))
def test_whatever_a_replica_sends_the_answer_is_a_response_or_an_httpx_error(answer: bytes) -> None:
    async def go() -> None:
        async with scripted(answering(answer, close=True)) as (url, _):
            transport = ReplicaTransport(connect_timeout=2)
            with contextlib.suppress(httpx.HTTPError):
                status, _ = await fetch(transport, url)
                assert 100 <= status < 1000
            await transport.aclose()
    run(go())
