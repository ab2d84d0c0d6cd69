"""The request guard: API key and body size, checked before anything parses a request."""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Callable

from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferencemesh.frontend.openai.errors import APIError


class RequestGuard:
    """Pure ASGI middleware: 401 without the API key, 413 for oversized bodies, 408 for a body
    that has not arrived, whole, within body_timeout_s of its head (a total deadline: a body that
    trickles in a byte every few seconds is cut off as surely as one that stops).

    The body is read here, bounded, and replayed to the app: Content-Length can be absent
    (chunked) or wrong, so the bytes actually received are what is counted.
    """

    def __init__(self, app: ASGIApp, *, api_key: str | None, exempt: tuple[str, ...], max_body_bytes: int,
                 body_timeout_s: float, reject: Callable[[APIError], Response]) -> None:
        self.app, self.api_key, self.exempt, self.max_body_bytes = app, api_key, exempt, max_body_bytes
        self.body_timeout_s, self.reject = body_timeout_s, reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["arrival"] = time.perf_counter()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"] not in self.exempt and not self._authorized(headers):
            err = APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")
            response = self.reject(err)
            response.headers["WWW-Authenticate"] = "Bearer"
            return await response(scope, receive, send)
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            return await self._too_large(scope, receive, send)
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s
        while True:
            try:
                async with asyncio.timeout_at(deadline):  # a body that stops or trickles holds a task and a slot
                    message = await receive()
            except TimeoutError:
                return await self._refuse(scope, receive, send, APIError(
                    408, f"The request body did not arrive within {self.body_timeout_s:g} s.", code="request_timeout"))
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return await self._too_large(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # afterwards: the real channel, which reports disconnects

        await self.app(scope, replay, send)

    def _authorized(self, headers: dict[str, str]) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        assert self.api_key is not None
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._refuse(scope, receive, send, APIError(
            413, f"Request body exceeds the limit of {self.max_body_bytes} bytes.", code="request_too_large"))

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, err: APIError) -> None:
        response = self.reject(err)
        response.headers["Connection"] = "close"  # the unread rest of the body is not drained
        await response(scope, receive, send)
