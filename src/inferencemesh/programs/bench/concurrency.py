"""The concurrency bench (--concurrency 1,8,32): serving many streams at once.

Per stage count (stage processes on loopback gRPC, 1 stage included, as `inferencemesh serve`
runs them) and per concurrency C, bursts of C streaming requests sent at once; per configuration
the aggregate tokens/s (all tokens / wall time of the burst), TTFT p50/p99 (from the burst's
start, so queueing counts) and ITL p50/p99 (gaps between a stream's successive token
deliveries). The peer hf-generate-batch is `transformers` generate() over 8 prompts at once
(left padding).
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from inferencemesh.programs.bench.config import BenchConfig
from inferencemesh.programs.bench.mesh import meshes, start_mesh
from inferencemesh.programs.bench.models import MAX_CONTEXT, BenchModel
from inferencemesh.programs.bench.report import header, percentile
from inferencemesh.programs.bench.runners import EngineUnderTest, proposer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

HF_BATCH = 8  # the batched peer's batch size


@dataclass
class Burst:
    """One burst of concurrent streams: when it started and, per stream, (time, tokens) of each delivery."""

    started: float
    streams: list[list[tuple[float, int]]]
    requested: int  # tokens asked for, over all streams


class _Arrivals:
    """A generate() streamer that notes when each step's tokens (for every row) come out."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() hands the streamer the prompt first
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HfBatchPeer:
    """`transformers` generate() over a batch of prompts at once, left-padded, greedy."""

    def __init__(self, model: Any, new_tokens: int) -> None:  # a transformers causal LM
        self.model, self.new_tokens = model, new_tokens

    async def burst(self, prompts: list[list[int]]) -> Burst:
        longest = max(len(ids) for ids in prompts)
        x = torch.tensor([[0] * (longest - len(ids)) + ids for ids in prompts], device=self.model.device)
        mask = torch.tensor([[0] * (longest - len(ids)) + [1] * len(ids) for ids in prompts], device=self.model.device)
        arrivals = _Arrivals()
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(x, attention_mask=mask, max_new_tokens=self.new_tokens,
                                      min_new_tokens=self.new_tokens, do_sample=False, pad_token_id=0,
                                      streamer=arrivals)
        generated = out.shape[1] - longest
        if generated != len(arrivals.times):
            raise RuntimeError(f"generate() made {generated} steps but streamed {len(arrivals.times)}")
        stream = [(t, 1) for t in arrivals.times]
        return Burst(started, [list(stream) for _ in prompts], len(prompts) * self.new_tokens)


class EngineBurst:
    """C streaming requests through one engine, sent at once."""

    def __init__(self, runner: EngineUnderTest) -> None:
        self.runner = runner

    async def burst(self, prompts: list[list[int]]) -> Burst:
        started = time.perf_counter()
        streams = await asyncio.gather(*(self.runner.stream(ids) for ids in prompts))
        return Burst(started, list(streams), len(prompts) * self.runner.new_tokens)


@dataclass
class MeasuredBursts:
    label: str
    extra: dict
    prompts: list[list[int]]  # one per stream of a burst
    runner: EngineBurst | HfBatchPeer
    threads: int
    bursts: list[Burst] = field(default_factory=list)

    def entry(self) -> dict:
        return summarise_bursts(self.label, self.bursts, **self.extra)


def summarise_bursts(label: str, bursts: list[Burst], **extra: object) -> dict:
    ttfts: list[float] = []
    itls: list[float] = []
    tokens, wall, requested = 0, 0.0, 0
    for burst in bursts:
        requested += burst.requested
        wall += max(stream[-1][0] for stream in burst.streams if stream) - burst.started
        for stream in burst.streams:
            if not stream:
                continue
            tokens += sum(n for _, n in stream)
            ttfts.append(stream[0][0] - burst.started)
            itls.extend(b[0] - a[0] for a, b in zip(stream, stream[1:], strict=False))

    def ms(value: float | None) -> float | None:
        return None if value is None else round(1000 * value, 3)

    entry = {
        "label": label, **extra,
        "tokens_per_s": round(tokens / wall, 2),
        "ttft_ms_p50": ms(percentile(ttfts, 50)), "ttft_ms_p99": ms(percentile(ttfts, 99)),
        "itl_ms_p50": ms(percentile(itls, 50)), "itl_ms_p99": ms(percentile(itls, 99)),
        "tokens": tokens, "tokens_requested": requested, "bursts": len(bursts), "wall_s": round(wall, 3),
        # The spread over rounds: how far one burst's number can be trusted on this machine.
        "tokens_per_s_by_burst": [round(sum(n for stream in b.streams for _, n in stream)
                                        / (max(stream[-1][0] for stream in b.streams if stream) - b.started), 2)
                                  for b in bursts],
    }
    print(f"  {label:<24} C={extra.get('concurrency', '?'):<3} {entry['tokens_per_s']:>8.1f} tok/s  "
          f"TTFT p50 {entry['ttft_ms_p50']} p99 {entry['ttft_ms_p99']} ms  "
          f"ITL p50 {entry['itl_ms_p50']} p99 {entry['itl_ms_p99']} ms", flush=True)
    return entry


async def measure_bursts(configs: list[MeasuredBursts], repeats: int) -> None:
    """A warm-up burst of each configuration, then `repeats` rounds of one burst each, interleaved.
    Each round starts one configuration later than the last, so none always follows the same one
    (a configuration's burst can leave the machine busier or quieter for the next)."""
    for round_index in range(repeats + 1):
        shift = round_index % len(configs)
        for config in configs[shift:] + configs[:shift]:
            torch.set_num_threads(config.threads)
            burst = await config.runner.burst(config.prompts)
            if round_index > 0:
                config.bursts.append(burst)


def run_concurrency(config: BenchConfig, model: BenchModel, target: PreTrainedModel, speculation: dict) -> dict:
    """The --concurrency bench (see the module docstring): stage processes for every stage count."""
    threads = torch.get_num_threads()
    levels = config.concurrency
    assert levels, "the --concurrency bench runs with stream counts"
    prompts = [ids for ids_of_set in model.prompts.values() for ids in ids_of_set]

    def cycle(count: int) -> list[list[int]]:
        return [prompts[i % len(prompts)] for i in range(count)]

    configs = [MeasuredBursts("hf-generate-batch", {"stages": 1, "concurrency": HF_BATCH, "speculative": "none"},
                                 cycle(HF_BATCH), HfBatchPeer(target, config.new_tokens), threads)]
    thread_options = config.stage_threads
    with meshes() as started:
        variants = [(c, t, e) for c in config.stages for t in thread_options for e in config.first_stage]
        for count, stage_threads, first_stage in variants:
            # Mesh variants compared in one run: the stages' OpenMP threads ("default": as `serve`
            # starts them, each stage its share of the cores) and where the first stage runs.
            env = {} if stage_threads == "default" else {"OMP_NUM_THREADS": stage_threads}
            mesh = start_mesh(model.model_dir, model.dtype_name, count, MAX_CONTEXT, env=env, first_stage=first_stage,
                              quantization=model.quantization)
            started.append(mesh)
            variant = f"threads={stage_threads}" if len(thread_options) > 1 else ""
            label = mesh.label + (f"[{variant}]" if variant else "")
            for strategy in config.speculative:
                for level in levels:
                    # One engine per configuration, as the frontend would run it (its admission limit included).
                    runner = EngineUnderTest(mesh.pipeline, config.new_tokens, MAX_CONTEXT,
                                             proposer(speculation, strategy), config.speculative_disable_by_batch_size)
                    name = label if strategy == "none" else f"{label}+{strategy}"
                    configs.append(MeasuredBursts(name, {"stages": count, "concurrency": level,
                                                            "speculative": strategy,
                                                            "stage_threads": stage_threads, "variant": variant,
                                                            "first_stage": first_stage},
                                                     cycle(level), EngineBurst(runner), mesh.threads))
        load_before = os.getloadavg()
        print(f"  {len(configs)} configurations, {config.repeats} interleaved rounds, load average "
              f"{load_before[0]:.2f}", flush=True)
        asyncio.run(measure_bursts(configs, config.repeats))
        torch.set_num_threads(threads)
        results = [c.entry() for c in configs]
    report = {
        **header(config, model, threads), "concurrency": list(levels),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()], "results": results,
    }
    report.update(_concurrency_ratios(results))
    _print_table(results)
    return report


def _concurrency_ratios(results: list[dict]) -> dict:
    """Aggregate tokens/s at C streams over one stream, per stage count and strategy, and the
    C = 8 configurations over the batched peer."""
    out: dict = {}
    one = {(r["stages"], r["speculative"], r["label"]): r for r in results if r.get("concurrency") == 1}
    peer = next((r for r in results if r["label"] == "hf-generate-batch"), None)
    for r in results:
        if r["label"] == "hf-generate-batch":
            continue
        base = one.get((r["stages"], r["speculative"], r["label"]))
        suffix = ("embedded_" if r.get("first_stage") == "embedded" else "") + f"stages_{r['stages']}" + (
            "" if r["speculative"] == "none" else f"_{r['speculative']}")
        if r["variant"]:  # several mesh variants in this run
            suffix += "_" + re.sub(r"\W+", "_", r["variant"])
        if base and r["concurrency"] != 1:
            out[f"concurrency_{r['concurrency']}_vs_1_{suffix}"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
        if peer and r["concurrency"] == HF_BATCH:
            out[f"concurrency_{HF_BATCH}_vs_hf_generate_batch_{suffix}"] = round(
                r["tokens_per_s"] / peer["tokens_per_s"], 3)
    return out


def _print_table(results: list[dict]) -> None:
    head = f"{'configuration':<36} {'C':>3} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}"
    print(head + "\n" + "-" * len(head))
    for r in results:
        print(f"{r['label']:<36} {r['concurrency']:>3} {r['tokens_per_s']:>8.1f} {r['ttft_ms_p50']:>9.1f} "
              f"{r['ttft_ms_p99']:>9.1f} {r['itl_ms_p50']:>8.1f} {r['itl_ms_p99']:>8.1f}")
