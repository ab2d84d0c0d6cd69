"""One try of a relayed request on one replica, and its answer relayed back to the client.

A try fails (UpstreamFailed: the next replica may serve) when the connection is refused or drops
before the first body bytes of the answer; the replica is then marked down. The status line waits
for those first bytes, so that a replica that dies before them (a stream still in prefill, a
non-streamed answer being computed) is retried elsewhere. After them, a replica that dies ends an
SSE stream with an OpenAI error event (`replica_failed`, no `[DONE]`) and any other answer by
cutting the client's connection: never a complete-looking answer.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from inferencemesh.openai_errors import sse_error_event
from inferencemesh.router.asgi import HOP_BY_HOP, REQUEST_DROPPED, Headers, Scope, Send, without
from inferencemesh.router.policy import retryable
from inferencemesh.router.replicas import Replica

log = logging.getLogger("inferencemesh.router")

Answer = tuple[httpx.Response, bytes, AsyncIterator[bytes]]  # the response, its first body bytes, the rest


@dataclass(frozen=True)
class Outgoing:
    """A client's request as it goes to any replica: its body read once, replayed on each retry."""

    method: str
    target: str  # path and query, as the client sent them
    headers: Headers
    body: bytes

    @classmethod
    def of(cls, scope: Scope, body: bytes) -> Outgoing:
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        return cls(scope["method"], target.decode("latin-1"), without(scope["headers"], REQUEST_DROPPED), body)

    def to(self, replica: Replica) -> httpx.Request:
        # The body as a stream: httpx then leaves the headers as given (40 us less than content=),
        # so Host and Content-Length are ours to write.
        length = [(b"content-length", str(len(self.body)).encode())] if self.body else []
        return httpx.Request(self.method, replica.url + self.target, stream=httpx.ByteStream(self.body),
                             headers=[(b"host", replica.url.partition("://")[2].encode()), *self.headers, *length])


@dataclass(frozen=True)
class Refusal:
    """A replica's answer that the next replica may do better than (policy.RETRY_STATUSES), read whole."""

    status: int
    headers: Headers
    body: bytes


class UpstreamFailed(Exception):
    """A replica failed before any byte of its answer went to the client: the next one may serve."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


async def attempt(transport: httpx.AsyncBaseTransport, replica: Replica, request: httpx.Request, *,
                  retry: bool) -> Refusal | Answer:
    """One try on `replica`: its Refusal when `retry` and the status is one the policy retries;
    else the response with its first body bytes read (and an iterator over the rest).
    UpstreamFailed when it failed before those first bytes."""
    try:
        response = await transport.handle_async_request(request)
    except (httpx.ConnectError, httpx.ConnectTimeout) as err:
        replica.mark_down(f"connecting: {err or type(err).__name__}")
        raise UpstreamFailed("connect", str(err) or type(err).__name__) from err
    except httpx.RemoteProtocolError as err:  # it closed the connection without an answer
        replica.mark_down(str(err))
        raise UpstreamFailed("disconnected", str(err) or type(err).__name__) from err
    try:
        if retryable(response.status_code) and retry:
            answer = await response.aread()
            await response.aclose()
            return Refusal(response.status_code, without(response.headers.raw, HOP_BY_HOP), answer)
        rest = response.aiter_raw()
        first = await anext(rest, b"")
    except httpx.HTTPError as err:
        await response.aclose()
        replica.mark_down(f"its answer broke off: {err}")
        raise UpstreamFailed("disconnected", str(err) or type(err).__name__) from err
    except BaseException:
        await response.aclose()
        raise
    return response, first, rest


async def relay(replica: Replica, answer: Answer, send: Send, state: dict[str, bool]) -> None:
    """The answer to the client as it arrives; `state["done"]` once nothing more will be sent."""
    response, first, rest = answer
    await send({"type": "http.response.start", "status": response.status_code,
                "headers": without(response.headers.raw, HOP_BY_HOP)})
    sse = response.headers.get("content-type", "").startswith("text/event-stream")
    last = first
    try:
        if first:
            await send({"type": "http.response.body", "body": first, "more_body": True})
        async for chunk in rest:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            last = chunk or last
    except httpx.HTTPError as err:  # after the first bytes: the client must see that it broke
        replica.mark_down(f"its answer broke off: {err}")
        log.warning("replica %s ended its answer early: %s", replica.name, err)
        if not sse:
            state["done"] = True
            return  # without the body's end: uvicorn cuts the connection, the client sees it cut
        # An event of its own: after a whole event's blank line (what was relayed ends one, or
        # the blank line ends the part that came).
        event = sse_error_event(f"The replica {replica.name} serving this stream failed: {err}", "server_error",
                                code="replica_failed")
        await send({"type": "http.response.body", "more_body": True,
                    "body": event if last.endswith(b"\n\n") else b"\n\n" + event})
    state["done"] = True
    await send({"type": "http.response.body", "body": b"", "more_body": False})
