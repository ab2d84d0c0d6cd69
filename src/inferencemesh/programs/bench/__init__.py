"""`inferencemesh bench`: tokens/s, TPOT and TTFT of the mesh against `transformers` on the same model.

Configurations, all measured in one run on one model (the machine is noisy: compare the
ratios within a run, not numbers across runs):
- hf-generate: `transformers` generate() of the unsplit model (greedy, same dtype);
- in-process 1 stage: our engine and stage runtime with no network;
- N stages: stage processes on loopback gRPC, the engine in this process;
- with --speculative: each strategy at each stage count, plus the peers `transformers`
  assisted generation (hf-assisted) and prompt lookup (hf-prompt-lookup).
per_hop_overhead_ms = (TPOT at N stages - TPOT in-process) / (N + 1 network hops).
Configurations take turns (a warm-up each, then round after round over the prompts), so a
noisy machine's drift falls on all of them alike.

With --concurrency 1,8,32 it measures serving many streams instead: per stage count (stage
processes on loopback gRPC, 1 stage included, as `inferencemesh serve` runs them) and per
concurrency C, bursts of C streaming requests sent at once; per configuration the aggregate
tokens/s (all tokens / wall time of the burst), TTFT p50/p99 (from the burst's start, so
queueing counts) and ITL p50/p99 (gaps between a stream's successive token deliveries). The
peer hf-generate-batch is `transformers` generate() over 8 prompts at once (left padding).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from inferencemesh.bundled import resolve_model
from inferencemesh.config import DEFAULT_DRAFT_THREADS, DEFAULT_SPECULATIVE_DISABLE_BY_BATCH_SIZE, SpeculativeOptions
from inferencemesh.cpus import share_of_cpus
from inferencemesh.modeling.attention import FORM_ENV

SHAPES = {
    # A few hundred thousand parameters: the bench's own tests.
    "llama-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
    # ~155M parameters: Llama architecture at GPT-2-small width.
    "llama-150m": dict(hidden_size=768, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=12,
                       num_key_value_heads=12, vocab_size=32000, tie_word_embeddings=False),
}

PROMPTS = {
    "code": [
        "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Parse the command line and run.\"\"\"\n"
        "    if len(argv) < 2:\n",
        "class LRUCache:\n    def __init__(self, capacity):\n        self.capacity = capacity\n"
        "        self.data = {}\n\n    def get(self, key):\n",
        "def read_config(path):\n    with open(path) as f:\n        lines = f.readlines()\n    result = {}\n"
        "    for line in lines:\n",
        "    def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__, self.name)\n\n"
        "    def __eq__(self, other):\n",
    ],
    "prose": [
        "The history of the city begins with a small settlement on the river, where traders stopped on their way",
        "She walked into the kitchen, looked at the empty table, and wondered why nobody had told her that",
        "In the summer of that year the weather was unusually warm, and the farmers in the valley",
        "Our team believes that good documentation is as important as good software, because",
    ],
}


@dataclass
class Run:
    ttft_s: float
    total_s: float
    tokens: int


@dataclass
class SpecCounter:
    """Collects what speculation proposed and got accepted (the engine's metrics interface)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    model: str = "bench"
    windows: list[int] = field(default_factory=list)

    def reset(self) -> None:
        self.drafts = self.draft_tokens = self.accepted = 0
        self.windows.clear()

    def record_verify_round(self, draft_tokens: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += draft_tokens
        self.accepted += accepted

    def set_window_size(self, k: int) -> None:
        self.windows.append(k)

    def set_auto_state(self, state: str) -> None:
        pass

    def set_speculative_strategy(self, strategy: str, reason: str) -> None:
        pass


def summarise(label: str, runs: list[Run], **extra) -> dict:
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


def make_shape_model(shape: str, dtype: str) -> Path:
    """A random-weight checkpoint of a preset shape, cached under ~/.cache/inferencemesh/bench."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape not in SHAPES:
        raise SystemExit(f"unknown --shape {shape!r}; presets: {', '.join(SHAPES)}")
    out = Path.home() / ".cache" / "inferencemesh" / "bench" / f"{shape}-{dtype}"
    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape], max_position_embeddings=4096))
    model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    bundled = Path(resolve_model(None))  # any tokenizer will do for random weights: token ids are what count
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (bundled / name).exists():
            (out / name).write_bytes((bundled / name).read_bytes())
    return out


def prompt_ids(tokenizer, sets: list[str], vocab: int) -> dict[str, list[list[int]]]:
    return {name: [[t % vocab for t in tokenizer(p).input_ids] for p in PROMPTS[name]] for name in sets}


# ---- peers ------------------------------------------------------------------------------------


class HfPeer:
    """`transformers` generate() on the unsplit model: plain, assisted or prompt lookup."""

    def __init__(self, model, new_tokens: int, **generate_kwargs) -> None:
        self.model, self.new_tokens, self.kwargs = model, new_tokens, generate_kwargs

    async def run(self, ids: list[int]) -> Run:
        x = torch.tensor([ids])
        with torch.inference_mode():
            started = time.perf_counter()
            self.model.generate(x, max_new_tokens=1, do_sample=False, pad_token_id=0)
            ttft = time.perf_counter() - started
            started = time.perf_counter()
            out = self.model.generate(x, max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens,
                                      do_sample=False, pad_token_id=0, **self.kwargs)
            total = time.perf_counter() - started
        return Run(ttft, total, out.shape[1] - len(ids))


class EngineUnderTest:
    """Our engine over one pipeline (in-process or stage processes), with one speculation strategy."""

    def __init__(self, pipeline, new_tokens: int, max_context: int, proposer_for=None,
                 speculative_disable_by_batch_size: int = DEFAULT_SPECULATIVE_DISABLE_BY_BATCH_SIZE) -> None:
        from inferencemesh.frontend.engine import EngineOptions, PipelineEngine

        options = EngineOptions("bench", max_context=max_context,
                                speculative_disable_by_batch_size=speculative_disable_by_batch_size)
        self.engine = PipelineEngine(pipeline, options, proposer_for=proposer_for)
        self.new_tokens = new_tokens
        self.count = 0

    async def run(self, ids: list[int]) -> Run:
        started = time.perf_counter()
        arrivals = await self.stream(ids)
        return Run(arrivals[0][0] - started, arrivals[-1][0] - started, sum(n for _, n in arrivals))

    async def stream(self, ids: list[int]) -> list[tuple[float, int]]:
        """One greedy request: (time, tokens) of each delivery, as a streaming client sees them."""
        from inferencemesh.frontend.engine_api import GenerationRequest

        self.count += 1
        request = GenerationRequest(f"bench-{self.count}", ids, self.new_tokens, temperature=0.0)
        return [(time.perf_counter(), len(tokens)) async for tokens in self.engine.generate(request)]


@dataclass
class Config:
    """One measured configuration. Configurations take turns, prompt by prompt and round by round,
    so that drift in a noisy machine's speed falls on all of them alike."""

    label: str
    extra: dict
    prompts: list[list[int]]
    runner: object  # HfPeer | EngineUnderTest
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


async def measure(configs: list[Config], repeats: int) -> None:
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


def run_bench(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from inferencemesh.checkpoint import read_local
    from inferencemesh.programs.mesh import in_process_pipeline
    from inferencemesh.stage.runtime import StageRuntime

    torch.set_grad_enabled(False)
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if args.shape else "auto")
    model_dir = make_shape_model(args.shape, dtype_name) if args.shape else Path(resolve_model(args.model))
    facts = read_local(model_dir)
    dtype = getattr(torch, dtype_name if dtype_name != "auto" else facts.checkpoint_dtype)
    stage_counts = [int(s) for s in str(args.stages).split(",")]
    strategies = [s.strip() for s in args.speculative.split(",") if s.strip()]
    sets = [s.strip() for s in args.prompts.split(",") if s.strip()]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = prompt_ids(tokenizer, sets, facts.vocab_size)
    max_context = 1024
    print(f"bench: {model_dir} ({facts.num_layers} layers, {dtype}), {args.new_tokens} new tokens, "
          f"{args.repeats} repeats x {sum(len(p) for p in prompts.values())} prompts, torch threads "
          f"{torch.get_num_threads()}", flush=True)

    speculation = {}
    if strategies != ["none"]:
        speculation = _speculation_setups(strategies, model_dir, tokenizer, dtype_name, max_context)

    spec_mode = strategies != ["none"]
    from transformers import AutoModelForCausalLM

    configs: list[Config] = []
    threads = torch.get_num_threads()
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    if args.concurrency:
        levels = [int(c) for c in str(args.concurrency).split(",")]
        all_prompts = [ids for ids_of_set in prompts.values() for ids in ids_of_set]
        report = run_concurrency(args, model_dir, dtype, target, all_prompts, stage_counts, levels, strategies,
                                 speculation, max_context)
        return _write_report(args, report)
    for prompt_set, ids in prompts.items():
        common = {"prompts": prompt_set} if spec_mode or len(prompts) > 1 else {}
        configs.append(Config("hf-generate", {"stages": 1, "speculative": "none", **common}, ids,
                              HfPeer(target, args.new_tokens), threads))
        if "draft" in speculation and speculation["draft"].draft is not None:
            assistant = AutoModelForCausalLM.from_pretrained(speculation["draft"].draft.source, dtype=dtype).eval()
            configs.append(Config("hf-assisted", {"stages": 1, "speculative": "draft", **common}, ids,
                                  HfPeer(target, args.new_tokens, assistant_model=assistant), threads))
        if spec_mode and ("ngram" in strategies or "auto" in strategies):
            configs.append(Config("hf-prompt-lookup", {"stages": 1, "speculative": "ngram", **common}, ids,
                                  HfPeer(target, args.new_tokens, prompt_lookup_num_tokens=4), threads))

    meshes: list[BenchMesh] = []
    forms = _first_stage_forms(args)
    try:
        pipelines = []  # (label, stage count, pipeline, this process's threads while it runs)
        for count in stage_counts:
            if count == 1:  # one process: the whole model in-process, whatever the form
                whole = in_process_pipeline([StageRuntime(model_dir, 0, facts.num_layers, dtype=dtype_name,
                                                          max_context=max_context)])
                pipelines.append(("in-process-1-stage", 1, whole, threads))
                # The split's baseline: one stage with the compute each stage of the split has (its
                # share of the cores), as one GPU against one GPU per stage.
                for shared in sorted({share_of_cpus(c) for c in stage_counts if c > 1} - {threads}):
                    pipelines.append((f"in-process-1-stage[threads={shared}]", 1, whole, shared))
                continue
            for form in forms:
                mesh = start_mesh(model_dir, dtype, count, max_context, first_stage=form)
                meshes.append(mesh)
                pipelines.append((mesh.label, count, mesh.pipeline, mesh.threads))
        for label, count, pipeline, config_threads in pipelines:
            for prompt_set, ids in prompts.items():
                for strategy in strategies:
                    counter, proposer_for = None, None
                    if strategy != "none":
                        counter = SpecCounter()
                        proposer_for = speculation[strategy].with_metrics(counter).proposer_for
                    extra = {"stages": count, "speculative": strategy}
                    if spec_mode or len(prompts) > 1:
                        extra["prompts"] = prompt_set
                    name = label if strategy == "none" else f"{label}+{strategy}"
                    runner = EngineUnderTest(pipeline, args.new_tokens, max_context, proposer_for,
                                             args.speculative_disable_by_batch_size)
                    configs.append(Config(name, extra, ids, runner, config_threads, counter))
        print(f"  {len(configs)} configurations, {args.repeats} interleaved rounds", flush=True)
        asyncio.run(measure(configs, args.repeats))
        torch.set_num_threads(threads)
        results = [config.entry() for config in configs]
    finally:
        for mesh in meshes:
            mesh.stages.stop()

    report = {
        "model": str(model_dir), "shape": args.shape, "dtype": str(dtype).removeprefix("torch."),
        "new_tokens": args.new_tokens, "repeats": args.repeats, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "machine": platform.machine(), "python": sys.version.split()[0],
        "results": results,
    }
    report.update(_ratios(results))
    return _write_report(args, report)


def _first_stage_forms(args: argparse.Namespace) -> list[str]:
    forms = [f.strip() for f in args.first_stage.split(",") if f.strip()]
    unknown = [f for f in forms if f not in FIRST_STAGE_FORMS]
    if unknown or not forms:
        raise SystemExit(f"bench: --first-stage {args.first_stage!r}: use {', '.join(FIRST_STAGE_FORMS)}")
    return forms


def _write_report(args: argparse.Namespace, report: dict) -> int:
    print(json.dumps({k: v for k, v in report.items() if k != "results"}, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    return 0


# How a mesh's first stage runs: its own process ("process") or inside the frontend, here the
# bench process ("embedded", what `serve` runs by default); and the label each form's results carry.
FIRST_STAGE_FORMS = {"embedded": "embedded", "process": "grpc"}


@dataclass
class BenchMesh:
    """Stage processes on loopback, as `inferencemesh serve` plans and starts them, and the
    pipeline this process (the frontend) sends to; `threads`: this process's torch threads."""

    stages: object  # launcher.LocalStages
    pipeline: object  # frontend.pipeline.GrpcPipeline
    threads: int
    label: str


def start_mesh(model_dir: Path, dtype: torch.dtype, count: int, max_context: int, env: dict | None = None,
               first_stage: str = "process") -> BenchMesh:
    from inferencemesh.checkpoint import read_local
    from inferencemesh.config import FrontendConfig
    from inferencemesh.planner import PlanInputs, plan_stages
    from inferencemesh.programs.frontend import build_pipeline
    from inferencemesh.programs.serve import LocalStages, stage_template
    from inferencemesh.stage.runtime import StageRuntime

    dtype_name = str(dtype).removeprefix("torch.")
    plan = plan_stages(PlanInputs.from_checkpoint(read_local(model_dir), dtype=dtype_name), count)
    # serve's threads rule (each stage its share of the cores) unless the variant sets OMP_NUM_THREADS
    share = share_of_cpus(len(plan))
    threads = 0 if env and "OMP_NUM_THREADS" in env else share
    embed = first_stage == "embedded"
    stages = LocalStages(stage_template(str(model_dir), dtype=dtype_name, max_context=max_context, threads=threads),
                         plan, env=env, embed_first=embed)
    stages.start()
    try:
        stages.wait_ready(600)
    except BaseException:
        stages.stop()
        raise
    frontend = FrontendConfig(model=str(model_dir), stage_addresses=tuple(stages.addresses), dtype=dtype_name,
                              max_context=max_context, first_stage_layers=stages.first_stage_layers).check()
    runtime = None
    if embed:  # loaded here, before the clock runs (the frontend loads it in the background)
        runtime = StageRuntime(model_dir, *stages.first_stage_layers, dtype=dtype_name, max_context=max_context)
    own_threads = int(env["OMP_NUM_THREADS"]) if env and "OMP_NUM_THREADS" in env else share
    label = f"{FIRST_STAGE_FORMS[first_stage]}-{count}-stage" + ("s" if count > 1 else "")
    return BenchMesh(stages, build_pipeline(frontend, first_stage_runtime=runtime),
                     own_threads if embed else DEFAULT_DRAFT_THREADS, label)


def _speculation_setups(strategies: list[str], model_dir: Path, tokenizer, dtype: str, max_context: int) -> dict:
    from inferencemesh.frontend.speculative import resolve_speculation

    setups = {}
    for strategy in strategies:
        if strategy == "none":
            continue
        setups[strategy] = resolve_speculation(SpeculativeOptions(speculative=strategy), model_dir, tokenizer,
                                               dtype=dtype, max_context=max_context)
        print(f"  speculative {strategy}: {setups[strategy].strategy} ({setups[strategy].reason})", flush=True)
    return setups


def _ratios(results: list[dict]) -> dict:
    """The headline ratios the targets are stated in, from entries of this run."""
    def find(label: str, **match) -> dict | None:
        for r in results:
            if r["label"] == label and all(r.get(k) == v for k, v in match.items()):
                return r
        return None

    out: dict = {}
    base = find("in-process-1-stage", speculative="none")
    hf = find("hf-generate")
    if base and hf:
        out["one_stage_vs_hf_generate"] = round(base["tokens_per_s"] / hf["tokens_per_s"], 3)

    def baseline(stages: int) -> dict | None:
        """One stage with the threads each of `stages` stages has, where it differs from base."""
        return find(f"in-process-1-stage[threads={share_of_cpus(stages)}]", speculative="none") or base

    for form, prefix in FIRST_STAGE_FORMS.items():
        key = "" if form == "process" else f"{form}_"  # the stage-0-process keys keep their names
        hops = {}
        for r in results:
            if r["label"].startswith(prefix + "-") and r.get("speculative") == "none" and base and r.get(
                    "prompts") == base.get("prompts"):
                n = r["stages"]
                split_base = baseline(n)
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
            none2 = find(f"{prefix}-2-stages", speculative="none", prompts=prompt_set)
            for strategy in ("draft", "auto", "ngram"):
                spec2 = find(f"{prefix}-2-stages+" + strategy, prompts=prompt_set)
                if none2 and spec2:
                    ratio = spec2["tokens_per_s"] / none2["tokens_per_s"]
                    out[f"{key}{strategy}_vs_none_2_stages_{prompt_set}"] = round(ratio, 3)
    for prompt_set in ("code", "prose"):
        ours = find("in-process-1-stage+draft", prompts=prompt_set)
        peer = find("hf-assisted", prompts=prompt_set)
        if ours and peer:
            out[f"draft_1_stage_vs_hf_assisted_{prompt_set}"] = round(ours["tokens_per_s"] / peer["tokens_per_s"], 3)
    return out


# ---- concurrency -------------------------------------------------------------------------------

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

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate() hands the streamer the prompt first
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HfBatchPeer:
    """`transformers` generate() over a batch of prompts at once, left-padded, greedy."""

    def __init__(self, model, new_tokens: int) -> None:
        self.model, self.new_tokens = model, new_tokens

    async def burst(self, prompts: list[list[int]]) -> Burst:
        longest = max(len(ids) for ids in prompts)
        x = torch.tensor([[0] * (longest - len(ids)) + ids for ids in prompts])
        mask = torch.tensor([[0] * (longest - len(ids)) + [1] * len(ids) for ids in prompts])
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
class ConcurrencyConfig:
    label: str
    extra: dict
    prompts: list[list[int]]  # one per stream of a burst
    runner: object  # EngineBurst | HfBatchPeer
    threads: int
    bursts: list[Burst] = field(default_factory=list)

    def entry(self) -> dict:
        return summarise_bursts(self.label, self.bursts, **self.extra)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]) of values; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def summarise_bursts(label: str, bursts: list[Burst], **extra) -> dict:
    ttfts, itls, tokens, wall, requested = [], [], 0, 0.0, 0
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


async def measure_bursts(configs: list[ConcurrencyConfig], repeats: int) -> None:
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


def run_concurrency(args: argparse.Namespace, model_dir: Path, dtype: torch.dtype, target, prompts: list[list[int]],
                    stage_counts: list[int], levels: list[int], strategies: list[str], speculation: dict,
                    max_context: int) -> dict:
    """The --concurrency bench (see the module docstring): stage processes for every stage count."""
    threads = torch.get_num_threads()

    def cycle(count: int) -> list[list[int]]:
        return [prompts[i % len(prompts)] for i in range(count)]

    configs = [ConcurrencyConfig("hf-generate-batch", {"stages": 1, "concurrency": HF_BATCH, "speculative": "none"},
                                 cycle(HF_BATCH), HfBatchPeer(target, args.new_tokens), threads)]
    forms = [f.strip() for f in args.attention.split(",") if f.strip()]
    thread_options = [t.strip() for t in args.stage_threads.split(",") if t.strip()]
    meshes: list[BenchMesh] = []
    first_stages = _first_stage_forms(args)
    try:
        variants = [(c, f, t, e) for c in stage_counts for f in forms for t in thread_options for e in first_stages]
        for count, form, stage_threads, first_stage in variants:
            # Mesh variants compared in one run: the stages' batched attention form (attention.FORM_ENV),
            # their OpenMP threads ("default": as `serve` starts them, each stage its share of the cores)
            # and where the first stage runs.
            env = {FORM_ENV: form, **({} if stage_threads == "default" else {"OMP_NUM_THREADS": stage_threads})}
            mesh = start_mesh(model_dir, dtype, count, max_context, env=env, first_stage=first_stage)
            meshes.append(mesh)
            variant = ",".join([form] * (len(forms) > 1) + [f"threads={stage_threads}"] * (len(thread_options) > 1))
            label = mesh.label + (f"[{variant}]" if variant else "")
            for strategy in strategies:
                proposer_for = None
                if strategy != "none":
                    proposer_for = speculation[strategy].with_metrics(SpecCounter()).proposer_for
                for level in levels:
                    # One engine per configuration, as the frontend would run it (its admission limit included).
                    runner = EngineUnderTest(mesh.pipeline, args.new_tokens, max_context, proposer_for,
                                             args.speculative_disable_by_batch_size)
                    name = label if strategy == "none" else f"{label}+{strategy}"
                    configs.append(ConcurrencyConfig(name, {"stages": count, "concurrency": level,
                                                            "speculative": strategy, "attention": form,
                                                            "stage_threads": stage_threads, "variant": variant,
                                                            "first_stage": first_stage},
                                                     cycle(level), EngineBurst(runner), mesh.threads))
        load_before = os.getloadavg()
        print(f"  {len(configs)} configurations, {args.repeats} interleaved rounds, load average "
              f"{load_before[0]:.2f}", flush=True)
        asyncio.run(measure_bursts(configs, args.repeats))
        torch.set_num_threads(threads)
        results = [config.entry() for config in configs]
    finally:
        for mesh in meshes:
            mesh.stages.stop()
    report = {
        "model": str(model_dir), "shape": args.shape, "dtype": str(dtype).removeprefix("torch."),
        "new_tokens": args.new_tokens, "repeats": args.repeats, "concurrency": levels, "torch": torch.__version__,
        "threads": threads, "machine": platform.machine(), "python": sys.version.split()[0],
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()], "results": results,
    }
    report.update(_concurrency_ratios(results))
    report.update(_attention_ratios(results))
    _print_table(results)
    return report


def _attention_ratios(results: list[dict]) -> dict:
    """Each attention form's aggregate tokens/s over the per-session form's, per stage count and C."""
    out = {}
    def same(r: dict) -> tuple:
        return r["stages"], r["concurrency"], r["speculative"], r.get("stage_threads"), r.get("first_stage")

    base = {same(r): r for r in results if r.get("attention") == "per-session"}
    for r in results:
        b = base.get(same(r))
        if b and r.get("attention") not in (None, "per-session"):
            key = f"attention_{r['attention']}_vs_per_session_stages_{r['stages']}_concurrency_{r['concurrency']}"
            if r["variant"] and "threads=" in r["variant"]:
                key += f"_threads_{r['stage_threads']}"
            if r.get("first_stage") == "embedded":
                key += "_embedded"
            out[key] = round(r["tokens_per_s"] / b["tokens_per_s"], 3)
    return out


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
