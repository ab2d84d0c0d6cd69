"""The frontend's HTTP server limits: the generic part lives in inferencemesh.http_server (a bottom
module, shared with the router, which may not import the frontend); re-exported here."""

from __future__ import annotations

from inferencemesh.http_server import (
    HEADER_TIMEOUT_S,
    KEEP_ALIVE_S,
    LIMIT_CONCURRENCY,
    MAX_INCOMPLETE_EVENT_BYTES,
    HeaderTimeoutProtocol,
    protocol_with,
    server_config,
)

__all__ = ["HEADER_TIMEOUT_S", "KEEP_ALIVE_S", "LIMIT_CONCURRENCY", "MAX_INCOMPLETE_EVENT_BYTES",
           "HeaderTimeoutProtocol", "protocol_with", "server_config"]
