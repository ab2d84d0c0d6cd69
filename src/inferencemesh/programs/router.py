"""`inferencemesh router`: one OpenAI endpoint in front of N replicas' frontends (inferencemesh.router).

SIGTERM (and Ctrl-C) is uvicorn's graceful shutdown: the router stops accepting, lets the requests
in flight finish (streams included, up to GRACEFUL_SHUTDOWN_S) and exits 0 (RouterServer); a second
signal stops it at once.
"""

from __future__ import annotations

import functools
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import uvicorn

from inferencemesh.config import RouterConfig

if TYPE_CHECKING:
    from types import FrameType

# Within a pod's default 30 s termination grace period.
GRACEFUL_SHUTDOWN_S = 25


def prompt_tokenizer(source: str) -> Callable[[str, bytes], list[int] | None]:
    """A request's prompt ids as the replicas compute them, with their tokenizer (`source`: the
    model directory or hub id their KV events name), for the router to score replicas by the KV
    blocks they hold. Loaded on the first replica's events, off the event loop: importing
    transformers costs seconds and torch's memory, which a router that cannot use it never pays."""
    from inferencemesh.checkpoint.tokenizer import load_tokenizer
    from inferencemesh.frontend.openai.prompt_ids import prompt_ids

    tokenizer = load_tokenizer(source)
    return functools.partial(prompt_ids, tokenizer)


class RouterServer(uvicorn.Server):
    """uvicorn's server, but a graceful stop is a clean exit: uvicorn records the signals it
    handled and re-raises them once it has served (the process then dies of SIGTERM, status
    -15, or raises KeyboardInterrupt); this one does not record them, so `inferencemesh router`
    exits 0 after its streams finished (as the frontend's DrainingServer does). A second
    signal, SIGTERM or SIGINT, stops it at once (uvicorn's own: a second SIGINT only)."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig in (signal.SIGINT, signal.SIGTERM):
            self.force_exit = True
        self.should_exit = True


def router_server(config: RouterConfig, *, transport: Callable[[], Any] | None = None, **settings: Any) -> Any:
    """The uvicorn server of a router (tests run it in a thread); `transport` makes the replicas'
    HTTP client (tools/router_latency.py compares others against router/transport.py's)."""
    from inferencemesh.http_server import server_config
    from inferencemesh.router.app import create_router

    app = (create_router(config, prompt_tokenizer=prompt_tokenizer) if transport is None else
           create_router(config, transport=transport, prompt_tokenizer=prompt_tokenizer))
    # The replicas' Date and Server headers pass through: none of uvicorn's own beside them. No
    # access log: one line per request is the router's largest cost (the replicas log theirs); no
    # X-Forwarded-* rewriting (the router never reads the client's address).
    options: dict[str, Any] = {"host": config.host, "port": config.port, "log_level": "info", "access_log": False,
                               "server_header": False, "date_header": False, "lifespan": "on",
                               "proxy_headers": False,
                               "timeout_graceful_shutdown": GRACEFUL_SHUTDOWN_S, **settings}
    return RouterServer(server_config(app, **options))


def run_router(config: RouterConfig) -> int:
    router_server(config).run()
    return 0
