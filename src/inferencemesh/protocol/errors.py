"""The two error types of the data plane, one per side of a gRPC call.

A stage raises Fault for a frame it refuses; the sender sees its code and message as the gRPC
status. The frontend turns any failed call into a PipelineError, whose `retryable` says whether
re-prefilling the session into the stages may succeed. The engine maps that to an HTTP status.
"""

from __future__ import annotations

import grpc


class Fault(Exception):
    """A frame the stage refuses, with the gRPC status the sender gets."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class PipelineError(Exception):
    """A stage refused a frame or went away; `code` is the gRPC status, `retryable` whether
    re-prefilling the session may succeed (a restarted or briefly unreachable stage)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code

    @property
    def retryable(self) -> bool:
        return self.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION,
                             grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
