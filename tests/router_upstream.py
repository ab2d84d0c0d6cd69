"""A small real upstream for the router's tests: a Starlette app that plays a replica's frontend
(streams SSE chunks with delays, answers a chosen status, reports waiting requests on /metrics,
records every request it got), and helpers to run ASGI apps under uvicorn in a thread."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Upstream:
    """A replica: what it answers, and what it was asked."""

    name: str
    status: int = 200  # answer every generation request with this (non-200: an OpenAI error)
    retry_after: str | None = None
    waiting: float = 0.0  # its inferencemesh_num_requests_waiting
    received: list[tuple[str, bytes, dict[str, str]]] = field(default_factory=list)  # (path, body, headers)
    cancelled: threading.Event = field(default_factory=threading.Event)  # a stream's client went away
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def count(self, path: str | None = None) -> int:
        return sum(1 for p, _, _ in self.received if path is None or p == path)

    def app(self) -> Starlette:
        async def generate(request: Request) -> Response:
            body = await request.body()
            self.received.append((request.url.path, body, dict(request.headers)))
            if self.status != 200:
                headers = {"retry-after": self.retry_after} if self.retry_after else None
                return JSONResponse({"error": {"message": f"{self.name} says {self.status}", "type": "x",
                                               "param": None, "code": None}}, self.status, headers=headers)
            data = json.loads(body or b"{}")
            await asyncio.sleep(float(data.get("header_delay", 0.0)))  # a replica slow to answer at all
            if not data.get("stream"):
                return JSONResponse({"replica": self.name, "prompt": data.get("prompt")},
                                    headers={"x-replica": self.name})
            chunks, delay = int(data.get("chunks", 3)), float(data.get("delay", 0.0))
            fail_after = data.get("fail_after")

            async def events() -> AsyncIterator[bytes]:
                try:
                    for i in range(chunks):
                        if fail_after is not None and i == fail_after:
                            raise RuntimeError("the replica breaks mid-stream")
                        yield f'data: {{"replica": "{self.name}", "i": {i}, "pad": "{"x" * (i * 7)}"}}\n\n'.encode()
                        if delay:
                            await asyncio.sleep(delay)
                    yield b"data: [DONE]\n\n"
                except asyncio.CancelledError:
                    self.cancelled.set()
                    raise

            return StreamingResponse(events(), media_type=data.get("media_type", "text/event-stream"),
                                     headers={"x-replica": self.name})

        async def models(request: Request) -> Response:
            self.received.append((request.url.path, b"", dict(request.headers)))
            return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": self.name}]})

        async def metrics(_: Request) -> Response:
            return PlainTextResponse(
                "# HELP inferencemesh_num_requests_waiting Admitted requests that have not produced their first "
                "token yet.\n# TYPE inferencemesh_num_requests_waiting gauge\n"
                f'inferencemesh_num_requests_waiting{{model_name="m"}} {self.waiting}\n')

        async def ready(_: Request) -> Response:
            return JSONResponse({"status": "ready"})

        return Starlette(routes=[Route("/v1/chat/completions", generate, methods=["POST"]),
                                 Route("/v1/completions", generate, methods=["POST"]),
                                 Route("/v1/models", models), Route("/metrics", metrics), Route("/ready", ready)])


class ServerThread:
    """An ASGI app under uvicorn in a thread, on a free loopback port."""

    def __init__(self, app: Any, port: int = 0, server: uvicorn.Server | None = None, **settings: Any) -> None:
        self.port = port or free_port()
        self.server = server or uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                              log_level="warning", **settings))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *_: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@contextlib.contextmanager
def upstreams(*names: str) -> Iterator[list[Upstream]]:
    replicas = [Upstream(name) for name in names]
    with contextlib.ExitStack() as stack:
        for replica in replicas:
            replica.port = stack.enter_context(ServerThread(replica.app())).port
        yield replicas
