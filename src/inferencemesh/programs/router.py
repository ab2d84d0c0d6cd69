"""`inferencemesh router`: one OpenAI endpoint in front of N replicas' frontends (inferencemesh.router).

SIGTERM (and Ctrl-C) is uvicorn's graceful shutdown: the router stops accepting, lets the requests
in flight finish (streams included, up to GRACEFUL_SHUTDOWN_S) and exits.
"""

from __future__ import annotations

from typing import Any

from inferencemesh.config import RouterConfig

# Within a pod's default 30 s termination grace period.
GRACEFUL_SHUTDOWN_S = 25


def router_server(config: RouterConfig, **settings: Any) -> Any:
    """The uvicorn server of a router (tests run it in a thread)."""
    import uvicorn

    from inferencemesh.http_server import server_config
    from inferencemesh.router.app import create_router

    app = create_router(config)
    # The replicas' Date and Server headers pass through: none of uvicorn's own beside them. No
    # access log: one line per request is the router's largest cost (the replicas log theirs); no
    # X-Forwarded-* rewriting (the router never reads the client's address).
    options: dict[str, Any] = {"host": config.host, "port": config.port, "log_level": "info", "access_log": False,
                               "server_header": False, "date_header": False, "lifespan": "on",
                               "proxy_headers": False,
                               "timeout_graceful_shutdown": GRACEFUL_SHUTDOWN_S, **settings}
    return uvicorn.Server(server_config(app, **options))


def run_router(config: RouterConfig) -> int:
    router_server(config).run()
    return 0
