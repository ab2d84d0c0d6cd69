"""The frontend's pipeline: the stages in order, each reached through its hop (hops.py), and the
step scheduler (scheduler.py) that sends every session's frames over the first hop's stream.

The engine opens a session per request, sends its frames and awaits their predictions; which
hops carry them (gRPC to stage processes, or a stage in this process called directly) is
decided by whoever builds the pipeline: the programs (inferencemesh.programs.mesh).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from inferencemesh.config import DEFAULT_MAX_BATCH_TOKENS
from inferencemesh.frontend.engine.hops import Hop
from inferencemesh.frontend.engine.scheduler import ScheduledSession, StepScheduler
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol.streams import RemoteStage
from inferencemesh.tls import TlsMaterial

if TYPE_CHECKING:
    from inferencemesh.frontend.engine.kv_blocks import KvRoom
    from inferencemesh.frontend.engine.metrics import FrontendMetrics


class HopPipeline:
    """The stages at `hops`, in pipeline order."""

    def __init__(self, hops: Sequence[Hop], *, step_timeout: float = 30.0,
                 max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, metrics: FrontendMetrics | None = None) -> None:
        if not hops:
            raise ValueError("a pipeline needs at least one stage")
        self.hops = list(hops)
        self.step_timeout = step_timeout
        self.max_batch_tokens = max_batch_tokens
        self.metrics = metrics
        self._scheduler: StepScheduler | None = None
        # Told when a new stream replaces a broken one: every stage's KV pool is empty for it.
        self.new_stream_listeners: list[Callable[[], None]] = []
        # Who gives out the stages' KV blocks on this pipeline's stream, shared by every engine over
        # it (engine._pool_room makes it).
        self.kv_room: KvRoom | None = None

    @property
    def scheduler(self) -> StepScheduler | None:
        """The step scheduler of the current stream into stage 0 (None before the first session)."""
        return self._scheduler

    def connect(self) -> None:
        """What reaching the stages takes belongs to the event loop that makes it: made on first
        use (or call this on the serving loop at start-up: a stage in this process then begins
        loading its layers)."""
        for hop in self.hops:
            hop.connect()

    def open(self) -> ScheduledSession:
        """A new session, on the current stream (a new one if it broke: its sessions replay)."""
        self.connect()
        if self._scheduler is None or self._scheduler.failure is not None:
            self._scheduler = StepScheduler(self.hops[0].open_stream(), len(self.hops), self.max_batch_tokens,
                                            self.metrics)
            for listener in self.new_stream_listeners:
                listener()
        return ScheduledSession(self._scheduler, uuid.uuid4().hex, self.step_timeout)

    async def is_ready(self, timeout: float = 3.0) -> bool:
        """True when every stage is serving."""
        self.connect()
        return all(await asyncio.gather(*(hop.serving(timeout) for hop in self.hops)))

    async def infos(self, timeout: float = 2.0) -> list[pb.StageInfo]:
        self.connect()
        return list(await asyncio.gather(*(hop.info(timeout) for hop in self.hops)))

    async def wait_ready(self, deadline_s: float) -> bool:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if await self.is_ready():
                return True
            await asyncio.sleep(0.2)
        return False

    async def close(self) -> None:
        if self._scheduler is not None:
            await self._scheduler.close()
            self._scheduler = None
        for hop in self.hops:
            await hop.close()


class GrpcPipeline(HopPipeline):
    """The stage processes at `addresses`, in pipeline order, after `embedded` (a first stage in
    this process) if any."""

    def __init__(self, addresses: list[str], *, step_timeout: float = 30.0, tls: TlsMaterial | None = None,
                 embedded: Hop | None = None, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                 max_message_bytes: int | None = None, metrics: FrontendMetrics | None = None) -> None:
        if not addresses and embedded is None:
            raise ValueError("a pipeline needs at least one stage address")
        remote: list[Hop] = [RemoteStage(address, tls, max_message_bytes) for address in addresses]
        super().__init__(([embedded] if embedded is not None else []) + remote, step_timeout=step_timeout,
                         max_batch_tokens=max_batch_tokens, metrics=metrics)
        self.addresses = addresses
        self.embedded = embedded
