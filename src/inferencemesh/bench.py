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
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from inferencemesh.bundled import resolve_model
from inferencemesh.config import DEFAULT_DRAFT_THREADS, SpeculativeOptions

SHAPES = {
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

    def __init__(self, pipeline, new_tokens: int, max_context: int, proposer_for=None) -> None:
        from inferencemesh.frontend.engine import EngineOptions, PipelineEngine

        self.engine = PipelineEngine(pipeline, EngineOptions("bench", max_context=max_context),
                                     proposer_for=proposer_for)
        self.new_tokens = new_tokens
        self.count = 0

    async def run(self, ids: list[int]) -> Run:
        from inferencemesh.frontend.engine_api import GenerationRequest

        self.count += 1
        request = GenerationRequest(f"bench-{self.count}", ids, self.new_tokens, temperature=0.0)
        started = time.perf_counter()
        first = None
        count = 0
        async for tokens in self.engine.generate(request):
            if first is None:
                first = time.perf_counter() - started
            count += len(tokens)
        return Run(first, time.perf_counter() - started, count)


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
    from inferencemesh.frontend.pipeline import GrpcPipeline
    from inferencemesh.launcher import LocalStages, stage_template
    from inferencemesh.planner import PlanInputs, plan_stages
    from inferencemesh.stage.inprocess import LocalPipeline
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

    meshes: list[LocalStages] = []
    try:
        pipelines = {}
        for count in stage_counts:
            if count == 1:
                pipelines[1] = LocalPipeline([StageRuntime(model_dir, 0, facts.num_layers, dtype=dtype_name,
                                                           max_context=max_context)])
                continue
            plan = plan_stages(PlanInputs.from_checkpoint(facts, dtype=str(dtype).removeprefix("torch.")), count)
            stages = LocalStages(stage_template(str(model_dir), dtype=dtype_name, max_context=max_context), plan)
            meshes.append(stages)
            stages.start()
            stages.wait_ready(600)
            pipelines[count] = GrpcPipeline(stages.addresses)
        for count, pipeline in pipelines.items():
            label = "in-process-1-stage" if count == 1 else f"grpc-{count}-stages"
            # Across processes this one is the frontend, with the frontend's threads (config.DEFAULT_DRAFT_THREADS).
            config_threads = threads if count == 1 else DEFAULT_DRAFT_THREADS
            for prompt_set, ids in prompts.items():
                for strategy in strategies:
                    counter, proposer_for = None, None
                    if strategy != "none":
                        counter = SpecCounter()
                        proposer_for = dataclasses.replace(speculation[strategy], metrics=counter).proposer_for
                    extra = {"stages": count, "speculative": strategy}
                    if spec_mode or len(prompts) > 1:
                        extra["prompts"] = prompt_set
                    name = label if strategy == "none" else f"{label}+{strategy}"
                    runner = EngineUnderTest(pipeline, args.new_tokens, max_context, proposer_for)
                    configs.append(Config(name, extra, ids, runner, config_threads, counter))
        print(f"  {len(configs)} configurations, {args.repeats} interleaved rounds", flush=True)
        asyncio.run(measure(configs, args.repeats))
        torch.set_num_threads(threads)
        results = [config.entry() for config in configs]
    finally:
        for stages in meshes:
            stages.stop()

    report = {
        "model": str(model_dir), "shape": args.shape, "dtype": str(dtype).removeprefix("torch."),
        "new_tokens": args.new_tokens, "repeats": args.repeats, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "machine": platform.machine(), "python": sys.version.split()[0],
        "results": results,
    }
    report.update(_ratios(results))
    print(json.dumps({k: v for k, v in report.items() if k != "results"}, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    return 0


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
    hops = {}
    for r in results:
        if r["label"].startswith("grpc-") and r.get("speculative") == "none" and base and r.get("prompts") == base.get(
                "prompts"):
            n = r["stages"]
            out[f"stages_{n}_vs_1"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
            hops[str(n)] = round((r["tpot_ms_median"] - base["tpot_ms_median"]) / (n + 1), 3)
    if hops:
        out["per_hop_overhead_ms_by_stages"] = hops
        out["per_hop_overhead_ms"] = max(hops.values())
    for prompt_set in ("code", "prose"):
        none2 = find("grpc-2-stages", speculative="none", prompts=prompt_set)
        for strategy in ("draft", "auto", "ngram"):
            spec2 = find("grpc-2-stages+" + strategy, prompts=prompt_set)
            if none2 and spec2:
                ratio = spec2["tokens_per_s"] / none2["tokens_per_s"]
                out[f"{strategy}_vs_none_2_stages_{prompt_set}"] = round(ratio, 3)
        ours = find("in-process-1-stage+draft", prompts=prompt_set)
        peer = find("hf-assisted", prompts=prompt_set)
        if ours and peer:
            out[f"draft_1_stage_vs_hf_assisted_{prompt_set}"] = round(ours["tokens_per_s"] / peer["tokens_per_s"], 3)
    return out
