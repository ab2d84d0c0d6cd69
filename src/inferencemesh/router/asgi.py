"""The router's side that faces its clients, in ASGI: answers it gives whole (its own endpoints,
its OpenAI-format errors), which headers travel (hop-by-hop ones do not), and the request body,
read once under the router's size and time limits."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from inferencemesh.openai_errors import error_json

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

RETRY_AFTER_S = "1"
# Hop-by-hop headers (RFC 9110 7.6.1) are the connection's, not the message's; Host and
# Content-Length are the client library's to write for the upstream request.
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
                        b"proxy-authorization", b"te", b"trailer", b"trailers", b"transfer-encoding", b"upgrade"})
# Expect: the router answered the client's 100-continue itself; the transport asks its own.
REQUEST_DROPPED = HOP_BY_HOP | {b"host", b"content-length", b"expect"}
CLOSE = [(b"connection", b"close")]  # a refusal before the body was read: the rest of it is not drained


def without(headers: Iterable[tuple[bytes, bytes]], dropped: frozenset[bytes]) -> Headers:
    """`headers` less the `dropped` names and those the Connection header names."""
    headers = list(headers)
    named = {token.strip().lower() for name, value in headers if name.lower() == b"connection"
             for token in value.split(b",")}
    return [(name, value) for name, value in headers if name.lower() not in dropped and name.lower() not in named]


async def send_whole(send: Send, status: int, body: bytes, headers: Headers | None = None,
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


async def read_body(scope: Scope, receive: Receive, *, limit: int, timeout_s: float) -> bytes | None:
    """The whole request body (None: the client went away first). Refused (BodyRefused) beyond
    `limit` bytes, declared or received, and when it is not whole within `timeout_s` seconds of
    its head, however it trickles in."""
    too_large = BodyRefused(413, f"The request body is larger than {limit} bytes.", "request_too_large")
    declared = next((value for name, value in scope["headers"] if name.lower() == b"content-length"), None)
    if declared is not None and (not declared.strip().isdigit() or int(declared) > limit):
        raise too_large  # before reading a byte of it
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
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
        raise BodyRefused(408, f"The request body did not arrive within {timeout_s:g} s.", "request_timeout") from None


async def lifespan(receive: Receive, send: Send, startup: Callable[[], Awaitable[None]],
                   shutdown: Callable[[], Awaitable[None]]) -> None:
    """An app's ASGI lifespan: `startup` (a failure is reported to the server, which exits), then
    `shutdown` when the server stops."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            try:
                await startup()
            except Exception as err:  # noqa: BLE001 - reported to the server, which exits
                await send({"type": "lifespan.startup.failed", "message": str(err)})
                return
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await shutdown()
            await send({"type": "lifespan.shutdown.complete"})
            return
