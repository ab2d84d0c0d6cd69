"""Continuous batching: several sessions' frames in one forward pass compute what each would alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from mesh_helpers import collect, generate
from tiny_models import FAMILIES, write_tiny_model

from inferencemesh.config import StageConfig
from inferencemesh.frontend.engine.engine import EngineOptions, PipelineEngine
from inferencemesh.frontend.engine.pipeline import GrpcPipeline
from inferencemesh.modeling.runtime import Segment, StageRuntime
from inferencemesh.programs.mesh import in_process_pipeline
from inferencemesh.stage.server import start_stage_server


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("batching")
    return {f: write_tiny_model(root / f, f, num_layers=3, shards=2) for f in FAMILIES}


def feed(runtime: StageRuntime, values: torch.Tensor) -> dict:
    return {"token_ids": values} if runtime.is_first else {"hidden": values}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layers", [(0, 2), (2, 3), (0, 3)])
def test_batched_pass_equals_separate_passes(models, family, layers) -> None:
    """Sessions at different lengths: a decode, a verify window and a rolled-back multi-token
    frame in one pass give each what its own pass gives, and leave the same caches behind."""
    runtime = StageRuntime(models[family], *layers, dtype="float32", max_context=128)
    gen = torch.Generator().manual_seed(11)

    def inputs(count: int) -> torch.Tensor:
        if runtime.is_first:
            return torch.randint(0, 300, (count,), generator=gen)
        return torch.randn(count, runtime.hidden_size, generator=gen)

    lengths = [5, 30, 12]  # Mistral's window (24) is crossed by the second
    prompts = [inputs(n) for n in lengths]
    alone, together = [runtime.new_session() for _ in lengths], [runtime.new_session() for _ in lengths]
    for kvs in (alone, together):
        for kv, prompt in zip(kvs, prompts, strict=True):
            runtime.forward(kv, 0, **feed(runtime, prompt))
    head = "none" if runtime.is_last else "last"
    steps = [(5, inputs(1), "last"), (30, inputs(4), "all"), (8, inputs(3), head)]  # the last one rolls back
    for _ in range(2):
        expected = [runtime.forward(kv, pos, logits=lg, **feed(runtime, x))
                    for kv, (pos, x, lg) in zip(alone, steps, strict=True)]
        got = runtime.forward_batch([Segment(kv, pos, x, lg) for kv, (pos, x, lg) in zip(together, steps, strict=True)])
        for want, have in zip(expected, got, strict=True):
            assert (want is None) == (have is None)
            if want is not None:
                torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-3)
        assert [kv.length for kv in together] == [kv.length for kv in alone]
        steps = [(pos + len(x), inputs(1), "last") for pos, x, _ in steps]  # then everyone decodes


def test_concurrent_sessions_are_batched_and_exact(models) -> None:
    """Six requests at once through a stage server: they share forward passes, and each gets
    exactly the tokens it gets alone."""
    model = models["llama"]
    prompts = [[(13 * i + 7 * j) % 250 for j in range(5 + 3 * i)] for i in range(6)]
    alone = [generate(in_process_pipeline([StageRuntime(model, 0, 3, max_context=128)]), p, 20, max_context=128,
                      temperature=0.0) for p in prompts]

    async def go():
        options = StageConfig(model=str(model), layers=(0, 3), stage_index=0, num_stages=1,
                               host="127.0.0.1", port=0, max_context=128)
        server, service, port = await start_stage_server(options, runtime=StageRuntime(model, 0, 3, max_context=128))
        engine = PipelineEngine(GrpcPipeline([f"127.0.0.1:{port}"]), EngineOptions("test", max_context=128))
        try:
            outputs = await asyncio.gather(*(collect(engine, p, 20, temperature=0.0) for p in prompts))
            sample = service.metrics.registry.get_sample_value
            labels = {"model_name": model.name, "stage": "0"}  # a local model's folder name, as the frontend's
            passes = sample("inferencemesh_stage_batch_frames_count", labels)
            frames = sample("inferencemesh_stage_batch_frames_sum", labels)
            # The time breakdown: every frame waited once, every pass was timed and counted as busy.
            assert sample("inferencemesh_stage_queue_wait_seconds_count", labels) == frames
            assert sample("inferencemesh_stage_compute_seconds_count", labels) == passes
            busy = sample("inferencemesh_stage_busy_seconds_total", labels)
            assert busy == sample("inferencemesh_stage_compute_seconds_sum", labels) > 0
            return outputs, passes, frames
        finally:
            await engine.close()
            await server.stop(0)
            await service.close()

    outputs, passes, frames = asyncio.run(go())
    assert outputs == alone
    assert frames > passes  # some passes carried several sessions' frames
