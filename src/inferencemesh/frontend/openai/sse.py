"""Server-sent events: a response that always releases the engine, keep-alive comments while
the pipeline is slow, and several choices' chunks merged into one stream."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

# While a stream waits on the pipeline (a stalled stage: 40-70 s seen), an SSE comment every few
# seconds keeps proxies with a read timeout (commonly 60 s) from cutting it; clients ignore comments.
SSE_KEEPALIVE_S = 5.0
KEEPALIVE_COMMENT = ": keep-alive\n\n"
DONE = "data: [DONE]\n\n"
# Stopping a stream's tasks: a task still running this long after its cancel is cancelled again
# (it missed the first), and one still running after STOP_GIVE_UP_S is logged and left behind.
STOP_RETRY_S = 0.5
STOP_GIVE_UP_S = 10.0

log = logging.getLogger("inferencemesh.frontend")


def sse(obj: dict[str, Any]) -> str:
    """One event: the object as compact JSON (non-ASCII text as it is)."""
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
    """SSE response that watches for the client going away while it waits on the engine, and
    always closes its body iterator (which closes the engine's iterator: the session is freed),
    then runs `on_close`: an async generator that was never started ignores aclose() (its
    finally never runs), so what frees the request's slots must not rest on the body alone."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], *, on_close: Callable[[], Awaitable[None]] | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(content, headers=headers)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = self.body_iterator
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client is gone; the finally below cleans up
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await _aclose(body)
                finally:
                    if self.on_close is not None:
                        await self.on_close()


async def with_keepalive(source: AsyncIterator[str], interval_s: float) -> AsyncIterator[str]:
    """source's items, with a keep-alive comment whenever none came for interval_s. The pending
    item is awaited across comments (never cancelled, which would lose it), and source is closed."""
    pending: asyncio.Future[str] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield KEEPALIVE_COMMENT
                continue
            item, pending = pending, None
            try:
                yield item.result()
            except StopAsyncIteration:
                return
    finally:
        # Shielded: when the client goes away this runs inside a cancelled scope, which would
        # cancel these awaits too and leave source (and the sessions its choices hold) open.
        with anyio.CancelScope(shield=True):
            if pending is not None:
                await stop_tasks([pending])
            await _aclose(source)


async def stop_tasks(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel tasks and wait until they have ended, never forever: a task that missed its cancel (a
    library that swallows one, as asyncio.wait_for does on Python 3.11) is cancelled again every
    STOP_RETRY_S, wherever it waits now (a put into a queue nobody reads any more, say); one still
    running after STOP_GIVE_UP_S is logged and left behind, so that what its caller frees after
    it (a request's slots) is freed all the same."""
    tasks = list(tasks)
    loop = asyncio.get_running_loop()
    give_up = loop.time() + STOP_GIVE_UP_S
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        left = give_up - loop.time()
        if left <= 0:
            log.error("%d task(s) did not end when cancelled; left running: %s", len(pending),
                      ", ".join(str(task) for task in pending))
            break
        _, pending = await asyncio.wait(pending, timeout=min(STOP_RETRY_S, left))
    for task in tasks:  # their failures are the caller's to report, or nobody's: retrieved here
        if task.done() and not task.cancelled():
            task.exception()


_EXHAUSTED = object()


async def merged(sources: list[AsyncIterator[str]]) -> AsyncGenerator[str, None]:
    """The items of several async generators as they come, each one's in its own order; the
    first failure is raised and the others stopped (and closed). Closing it never waits on a
    source for long (stop_tasks), and closes every source whatever fails."""
    if len(sources) == 1:
        try:
            async for item in sources[0]:
                yield item
        finally:
            await _aclose(sources[0])
        return
    queue: asyncio.Queue[tuple[object, Exception | None]] = asyncio.Queue(maxsize=len(sources))
    # (bounded: a slow client holds the producers back)

    async def pump(source: AsyncIterator[str]) -> None:
        try:
            async for item in source:
                await queue.put((item, None))
            await queue.put((_EXHAUSTED, None))
        except Exception as exc:
            await queue.put((None, exc))

    tasks = [asyncio.ensure_future(pump(source)) for source in sources]
    try:
        remaining = len(tasks)
        while remaining:
            entry, failure = await queue.get()
            if failure is not None:
                raise failure
            if entry is _EXHAUSTED:
                remaining -= 1
            else:
                assert isinstance(entry, str)
                yield entry
    finally:
        await stop_tasks(tasks)
        for source in sources:
            await _aclose(source)


async def _aclose(iterator: object) -> None:
    """Close an async iterator; a failure to (a generator still running in a task left behind) is
    logged, never raised into the closing of the others."""
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:
            log.exception("closing a stream's source failed")
