"""The frontend's view of one stage: a hop.

The pipeline holds a hop per stage, in pipeline order. Its first hop carries every session's
frames (open_stream); every hop answers for its own stage's readiness and identity. A hop is
either a stage process over gRPC (inferencemesh.protocol.streams.RemoteStage) or a stage in
this process called directly (inferencemesh.stage.local.LocalStage, joined to the frontend by
the programs): the frontend needs neither's internals, only this shape.
"""

from __future__ import annotations

from typing import Protocol

from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol.streams import BatchStream


class Hop(Protocol):
    @property
    def peer(self) -> str:
        """What this stage is called in messages: its address, or where it runs."""
        ...

    def connect(self) -> object:
        """Make what reaching the stage takes, on the serving event loop (a channel; a stage in
        this process begins loading its layers)."""
        ...

    def open_stream(self) -> BatchStream:
        """A new Pipeline stream into this stage (the first hop's carries the frames)."""
        ...

    async def serving(self, timeout: float) -> bool:
        """Whether the stage is ready to compute."""
        ...

    async def info(self, timeout: float) -> pb.StageInfo:
        """Its identity, layer range and lifecycle; PipelineError when it cannot be asked."""
        ...

    async def close(self) -> None: ...
