"""The latency bench (the default): one request at a time, tokens/s, TPOT and TTFT of each
configuration, against `transformers` on the same model.

Configurations, all measured in one run on one model (the machine is noisy: compare the
ratios within a run, not numbers across runs):
- hf-generate: `transformers` generate() of the unsplit model (greedy, same dtype);
- in-process 1 stage: our engine and stage runtime with no network;
- N stages: stage processes on loopback gRPC, the engine in this process;
- with --speculative: each strategy at each stage count, plus the peers `transformers`
  assisted generation (hf-assisted) and prompt lookup (hf-prompt-lookup);
- with --peer llama-cpp: llama.cpp on the same model (llama_cpp_peer.py) at the bench's threads
  (llama-cpp) and at each split's share of the cores (llama-cpp[threads=N]); tpot_vs_llama_cpp
  divides each of our configurations' TPOT by llama.cpp's at the threads each of its stages has.
per_hop_overhead_ms = (TPOT at N stages - TPOT in-process) / (N + 1 network hops).
Configurations take turns (a warm-up each, then round after round over the prompts), so a
noisy machine's drift falls on all of them alike.
"""

from __future__ import annotations

import asyncio
import os
import re
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from inferencemesh.cpus import share_of_cpus
from inferencemesh.programs.bench.config import BenchConfig
from inferencemesh.programs.bench.mesh import FIRST_STAGE_LABELS, in_process_pipeline, meshes, start_mesh
from inferencemesh.programs.bench.models import MAX_CONTEXT, BenchModel
from inferencemesh.programs.bench.report import find, header
from inferencemesh.programs.bench.runners import EngineUnderTest, HfPeer, Run, SpecCounter, proposer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from inferencemesh.frontend.engine.pipeline import HopPipeline
    from inferencemesh.programs.bench.llama_cpp_peer import LlamaCppPeer


def summarise(label: str, runs: list[Run], **extra: object) -> dict:
    tpots = [(r.total_s - r.ttft_s) / (r.tokens - 1) for r in runs if r.tokens > 1]
    entry = {
        "label": label,
        **extra,
        "tokens_per_s": round(sum(r.tokens for r in runs) / sum(r.total_s for r in runs), 2),
        "tpot_ms_median": round(1000 * statistics.median(tpots), 3) if tpots else None,
        "ttft_ms_median": round(1000 * statistics.median(r.ttft_s for r in runs), 3),
        "runs": len(runs),
    }
    print(f"  {label:<34} {entry['tokens_per_s']:>8.1f} tok/s  TPOT {entry['tpot_ms_median']} ms  "
          f"TTFT {entry['ttft_ms_median']} ms", flush=True)
    return entry


@dataclass
class Measured:
    """One measured configuration. Configurations take turns, prompt by prompt and round by round,
    so that drift in a noisy machine's speed falls on all of them alike."""

    label: str
    extra: dict
    prompts: list[list[int]]
    runner: HfPeer | EngineUnderTest | LlamaCppPeer
    threads: int  # this process's torch threads while it runs (it plays the frontend for stage processes)
    counter: SpecCounter | None = None
    runs: list[Run] = field(default_factory=list)

    def entry(self) -> dict:
        extra = dict(self.extra)
        c = self.counter
        if c is not None:
            extra["acceptance_rate"] = round(c.accepted / c.draft_tokens, 4) if c.draft_tokens else 0.0
            extra["mean_accepted_per_window"] = round(c.accepted / c.drafts, 3) if c.drafts else 0.0
        return summarise(self.label, self.runs, **extra)


async def measure(configs: list[Measured], repeats: int) -> None:
    """A warm-up run of each configuration, then `repeats` rounds over every prompt of each."""
    for round_index in range(repeats + 1):
        for config in configs:
            torch.set_num_threads(config.threads)
            for ids in config.prompts[:1] if round_index == 0 else config.prompts:
                run = await config.runner.run(ids)
                if round_index > 0:
                    config.runs.append(run)
                if config.counter is not None and round_index == 0:
                    config.counter.reset()


def peers(config: BenchConfig, model: BenchModel, target: PreTrainedModel, speculation: dict,
          threads: int) -> list[Measured]:
    """The `transformers` configurations, per prompt set."""
    from transformers import AutoModelForCausalLM

    spec_mode = config.speculative != ("none",)
    out = []
    for prompt_set, ids in model.prompts.items():
        common = {"prompts": prompt_set} if spec_mode or len(model.prompts) > 1 else {}
        if "hf-generate" in config.peer:
            out.append(Measured("hf-generate", {"stages": 1, "speculative": "none", **common}, ids,
                                HfPeer(target, config.new_tokens), threads))
        if "draft" in speculation and speculation["draft"].draft is not None:
            assistant = AutoModelForCausalLM.from_pretrained(speculation["draft"].draft.source,
                                                             dtype=model.dtype).eval()
            assistant.to(target.device)  # type: ignore[arg-type]  # transformers types .to() as its own wrapper
            out.append(Measured("hf-assisted", {"stages": 1, "speculative": "draft", **common}, ids,
                                HfPeer(target, config.new_tokens, assistant_model=assistant), threads))
        if spec_mode and ("ngram" in config.speculative or "auto" in config.speculative):
            out.append(Measured("hf-prompt-lookup", {"stages": 1, "speculative": "ngram", **common}, ids,
                                HfPeer(target, config.new_tokens, prompt_lookup_num_tokens=4), threads))
    return out


def split_shares(config: BenchConfig, threads: int) -> list[int]:
    """The threads each stage of the splits measured has, where they differ from the bench's."""
    return sorted({share_of_cpus(c) for c in config.stages if c > 1} - {threads})


def llama_cpp_peers(config: BenchConfig, model: BenchModel, threads: int) -> tuple[list[Measured], dict]:
    """llama.cpp on the model converted to GGUF: at the bench's threads and at each split's share;
    and the report's facts of it."""
    from inferencemesh.programs.bench import llama_cpp_peer as lc

    version = lc.llama_cpp_version()
    outtype = lc.gguf_type(model.dtype_name, model.quantization)
    converter = lc.find_converter(config.llama_cpp_converter, version)
    gguf = lc.convert(model.model_dir, outtype, converter)
    print(f"  llama.cpp peer: llama-cpp-python {version}, {gguf}", flush=True)
    spec_mode = config.speculative != ("none",)
    out = []
    for peer_threads in [threads, *split_shares(config, threads)]:
        peer = lc.LlamaCppPeer(gguf, config.new_tokens, peer_threads, MAX_CONTEXT)
        for prompt_set, ids in model.prompts.items():
            extra = {"stages": 1, "speculative": "none", "threads": peer_threads, "gguf": outtype}
            if spec_mode or len(model.prompts) > 1:
                extra["prompts"] = prompt_set
            out.append(Measured(lc.peer_label(peer_threads, threads), extra, ids, peer, threads))
    return out, {"llama_cpp": {"llama_cpp_python": version, "gguf": str(gguf), "converter": str(converter)}}


async def measure_with_agreement(configs: list[Measured], repeats: int, reference: HopPipeline | None,
                                 new_tokens: int, threads: int) -> dict:
    """measure(), then how far llama.cpp's greedy tokens equal ours (`reference`'s) on its prompts."""
    from inferencemesh.programs.bench.llama_cpp_peer import PEER_LABEL, LlamaCppPeer, agreement

    await measure(configs, repeats)
    peer = next((c for c in configs if c.label == PEER_LABEL), None)
    if peer is None or reference is None:
        return {}
    assert isinstance(peer.runner, LlamaCppPeer)
    torch.set_num_threads(threads)
    found = await agreement(peer.runner, EngineUnderTest(reference, new_tokens, MAX_CONTEXT), peer.prompts)
    print(f"  llama.cpp's greedy tokens equal ours for the first {found['common_prefix_tokens']} of "
          f"{new_tokens} tokens", flush=True)
    return {"llama_cpp_agreement": found}


def run_latency(config: BenchConfig, model: BenchModel, target: PreTrainedModel, speculation: dict) -> dict:
    threads = torch.get_num_threads()
    spec_mode = config.speculative != ("none",)
    configs = peers(config, model, target, speculation, threads)
    facts: dict = {}
    if "llama-cpp" in config.peer:
        llama_cpp, facts = llama_cpp_peers(config, model, threads)
        configs += llama_cpp
    with meshes() as started:
        pipelines = []  # (label, stage count, pipeline, this process's threads while it runs)
        for count in config.stages:
            if count == 1:  # one process: the whole model in-process, whatever the form
                whole = in_process_pipeline(model, MAX_CONTEXT)
                pipelines.append(("in-process-1-stage", 1, whole, threads))
                # The split's baseline: one stage with the compute each stage of the split has (its
                # share of the cores), as one GPU against one GPU per stage.
                for shared in split_shares(config, threads):
                    pipelines.append((f"in-process-1-stage[threads={shared}]", 1, whole, shared))
                continue
            for form in config.first_stage:
                mesh = start_mesh(model.model_dir, model.dtype_name, count, MAX_CONTEXT, first_stage=form,
                              quantization=model.quantization)
                started.append(mesh)
                pipelines.append((mesh.label, count, mesh.pipeline, mesh.threads))
        for label, count, pipeline, config_threads in pipelines:
            for prompt_set, ids in model.prompts.items():
                for strategy in config.speculative:
                    counter = SpecCounter() if strategy != "none" else None
                    extra = {"stages": count, "speculative": strategy}
                    if spec_mode or len(model.prompts) > 1:
                        extra["prompts"] = prompt_set
                    name = label if strategy == "none" else f"{label}+{strategy}"
                    runner = EngineUnderTest(pipeline, config.new_tokens, MAX_CONTEXT,
                                             proposer(speculation, strategy, counter),
                                             config.speculative_disable_by_batch_size)
                    configs.append(Measured(name, extra, ids, runner, config_threads, counter))
        print(f"  {len(configs)} configurations, {config.repeats} interleaved rounds", flush=True)
        facts["load_average_before"] = [round(x, 2) for x in os.getloadavg()]
        reference = pipelines[0][2] if pipelines else None
        found = asyncio.run(measure_with_agreement(configs, config.repeats, reference, config.new_tokens, threads))
        torch.set_num_threads(threads)
        facts["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
        results = [c.entry() for c in configs]
    report = {**header(config, model, torch.get_num_threads()), **facts, "results": results, **found}
    report.update(ratios(results))
    report.update(llama_cpp_ratios(results))
    return report


def ratios(results: list[dict]) -> dict:
    """The headline ratios the targets are stated in, from entries of this run."""
    out: dict = {}
    base = find(results, "in-process-1-stage", speculative="none")
    hf = find(results, "hf-generate")
    if base and hf:
        out["one_stage_vs_hf_generate"] = round(base["tokens_per_s"] / hf["tokens_per_s"], 3)

    def baseline(stages: int) -> dict | None:
        """One stage with the threads each of `stages` stages has, where it differs from base."""
        return find(results, f"in-process-1-stage[threads={share_of_cpus(stages)}]", speculative="none") or base

    for form, prefix in FIRST_STAGE_LABELS.items():
        key = "" if form == "process" else f"{form}_"  # the stage-0-process keys keep their names
        hops = {}
        for r in results:
            if r["label"].startswith(prefix + "-") and r.get("speculative") == "none" and base and r.get(
                    "prompts") == base.get("prompts"):
                n = r["stages"]
                split_base = baseline(n)
                assert split_base is not None  # base exists here, and baseline falls back to it
                if split_base is not base:
                    out[f"{key}stages_{n}_vs_1_all_cores"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
                out[f"{key}stages_{n}_vs_1"] = round(r["tokens_per_s"] / split_base["tokens_per_s"], 3)
                # hops per token: frontend -> stage 0 -> ... -> frontend; one fewer with stage 0 embedded
                hop_count = n + 1 if form == "process" else n
                hops[str(n)] = round((r["tpot_ms_median"] - split_base["tpot_ms_median"]) / hop_count, 3)
        if hops:
            out[f"{key}per_hop_overhead_ms_by_stages"] = hops
            out[f"{key}per_hop_overhead_ms"] = max(hops.values())
        for prompt_set in ("code", "prose"):
            none2 = find(results, f"{prefix}-2-stages", speculative="none", prompts=prompt_set)
            for strategy in ("draft", "auto", "ngram"):
                spec2 = find(results, f"{prefix}-2-stages+" + strategy, prompts=prompt_set)
                if none2 and spec2:
                    ratio = spec2["tokens_per_s"] / none2["tokens_per_s"]
                    out[f"{key}{strategy}_vs_none_2_stages_{prompt_set}"] = round(ratio, 3)
    for prompt_set in ("code", "prose"):
        ours = find(results, "in-process-1-stage+draft", prompts=prompt_set)
        peer = find(results, "hf-assisted", prompts=prompt_set)
        if ours and peer:
            out[f"draft_1_stage_vs_hf_assisted_{prompt_set}"] = round(ours["tokens_per_s"] / peer["tokens_per_s"], 3)
    return out


def llama_cpp_ratios(results: list[dict]) -> dict:
    """TPOT ÷ llama.cpp's TPOT for each of our configurations without speculation (and the
    `transformers` peers), against llama.cpp at the threads it computes with: one stage at its own
    threads, N stages at the share of the cores each stage has (a 2-stage split on 2 cores
    against llama.cpp on one core)."""
    from inferencemesh.programs.bench.llama_cpp_peer import PEER_LABEL

    out = {}
    for r in results:
        if r["label"].startswith(PEER_LABEL) or r.get("speculative") != "none" or not r.get("tpot_ms_median"):
            continue
        threads = re.search(r"\[threads=(\d+)\]$", r["label"])
        want = PEER_LABEL
        if threads:
            want = f"{PEER_LABEL}[threads={threads[1]}]"
        elif r.get("stages", 1) > 1:
            want = f"{PEER_LABEL}[threads={share_of_cpus(r['stages'])}]"
        # llama-cpp[threads=N] is measured only where N differs from the bench's threads
        peer = find(results, want, prompts=r.get("prompts")) or (
            None if threads else find(results, PEER_LABEL, prompts=r.get("prompts")))
        if peer and peer.get("tpot_ms_median"):
            out[f"{r['label']} / {peer['label']}"] = round(r["tpot_ms_median"] / peer["tpot_ms_median"], 3)
    return {"tpot_vs_llama_cpp": out} if out else {}
