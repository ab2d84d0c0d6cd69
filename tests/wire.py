"""Raw access to a stage's Pipeline stream, for tests that speak the wire protocol themselves."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import torch

from inferencemesh.config import StageConfig
from inferencemesh.protocol import codec
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol import stage_pb2_grpc as pb_grpc
from inferencemesh.protocol.transport import KV_BLOCK_TOKENS

STATUS = {code.value[0]: code for code in grpc.StatusCode}
LANE_BLOCKS = 8  # blocks(..., lane): each lane holds 8 blocks (128 positions) of its own


def blocks(stop: int, lane: int = 0) -> list[int]:
    """A block table of consecutive blocks covering positions [0, stop), starting at the lane's
    first block: sessions in different lanes never share a block."""
    first = lane * LANE_BLOCKS
    return list(range(first, first + -(-stop // KV_BLOCK_TOKENS)))


class RawStream:
    """One Pipeline stream into a stage (async): batches in, BatchResults (or its status) out."""

    def __init__(self, stub: pb_grpc.StageStub) -> None:
        self.call = stub.Pipeline()
        self.seq = 0

    async def send(self, *frames: pb.Frame, **batch) -> int:
        self.seq += 1
        await self.call.write(pb.Batch(seq=self.seq, frames=frames, **batch))
        return self.seq

    async def result(self, timeout: float = 20) -> pb.BatchResult:
        return await asyncio.wait_for(self.call.read(), timeout)

    async def exchange(self, *frames: pb.Frame, **batch) -> pb.BatchResult:
        seq = await self.send(*frames, **batch)
        result = await self.result()
        assert result.seq == seq
        return result

    async def close(self) -> None:
        await self.call.done_writing()
        self.call.cancel()


def failures(result: pb.BatchResult) -> list[tuple[grpc.StatusCode, str]]:
    return [(STATUS[f.code], f.message) for f in result.failures]


def exchange(address: str, batches: list[dict], timeout: float = 20) -> tuple[list[pb.BatchResult], grpc.StatusCode]:
    """Send each batch (pb.Batch fields) on one stream and read its answer: (the results, and
    the status the stream ended with: OK when the stage kept it open)."""
    with grpc.insecure_channel(address) as channel:
        requests = iter([pb.Batch(seq=i + 1, **b) for i, b in enumerate(batches)])
        call = pb_grpc.StageStub(channel).Pipeline(requests, timeout=timeout)
        results: list[pb.BatchResult] = []
        try:
            results.extend(call)
        except grpc.RpcError as err:
            return results, err.code()
    return results, grpc.StatusCode.OK


def hidden_batch(frames: list[pb.Frame], hidden: int, dtype: torch.dtype = torch.float32) -> dict:
    """Batch fields for frames into a stage after the first: zero hidden states for each."""
    rows = sum(f.token_count for f in frames)
    return {"frames": frames, "dtype": codec.WIRE_CODES[dtype], "hidden_size": hidden,
            "activations": codec.encode(torch.zeros(rows, hidden), dtype)}


class StageServers:
    """Real gRPC stage servers on loopback, one per layer range of `splits` (e.g. [(0, 1), (1, 2)]),
    each sending to the next, served by a background event loop (so that tests may block).
    `settings` are StageConfig fields every stage shares."""

    def __init__(self, model: Path, splits: list[tuple[int, int]], max_context: int = 128, **settings) -> None:
        from inferencemesh.modeling.runtime import StageRuntime
        from inferencemesh.stage.server import start_stage_server

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.runtimes = [StageRuntime(model, start, end, max_context=max_context) for start, end in splits]
        self.servers, self.ports = [], []
        for index in reversed(range(len(splits))):  # downstream first: each stage is given its next
            downstream = f"127.0.0.1:{self.ports[0]}" if self.ports else None
            options = StageConfig(model=str(model), layers=splits[index], stage_index=index, num_stages=len(splits),
                                  host="127.0.0.1", port=0, downstream=downstream, max_context=max_context,
                                  **{"max_sessions": 64, **settings})
            server, service, port = self.run(start_stage_server(options, runtime=self.runtimes[index]))
            self.servers.append((server, service))
            self.ports.insert(0, port)

    def run(self, coroutine, timeout: float = 30):
        """Run a coroutine on the servers' loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    def close(self) -> None:
        for server, service in self.servers:
            self.run(server.stop(0), 10)
            self.run(service.close(), 10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def tiny_two_layer_model(folder: Path) -> Path:
    """The stage tests' smallest Llama: 2 layers of width 32, in one shard."""
    from tiny_models import write_tiny_model

    return write_tiny_model(folder, "llama", num_layers=2, shards=1, hidden_size=32, intermediate_size=64)


def serving_one_stage(model: Path, **settings) -> Iterator[StageServers]:
    """One stage of both layers, for a module-scoped fixture to yield from; closed after."""
    servers = StageServers(model, [(0, 2)], **settings)
    try:
        yield servers
    finally:
        servers.close()
