"""Quantized weights against the same model in bfloat16, on this CPU: decode, prefill, bytes, load.

    python tools/quantized_bench.py --json docs/benchmarks/quantized-bundled.json
    python tools/quantized_bench.py --shape llama-150m --json docs/benchmarks/quantized-llama-150m.json
    git show COMMIT:src/inferencemesh/modeling/quantized.py > /tmp/quantized-before.py
    python tools/quantized_bench.py --before /tmp/quantized-before.py ...   # FORMAT@before beside FORMAT
    python tools/quantized_bench.py --device cuda --shape llama-1b --rounds 2 --json out.json   # on a GPU

Each format (bf16, and int8, int4, fp8 quantized as the stages read the 16-bit checkpoint:
load_stage(quantization=...), what `--quantization` does) runs the whole model as one stage, in
bfloat16 compute, one thread unless --threads. Round by round the formats take turns (the machine
is shared and noisy); a ratio to bf16 is the median over the rounds of that round's ratio (each
pairs measurements taken seconds apart), the best round and the raw rounds kept too. Measured:

- decode tok/s at batch 1 (one session's greedy steps, StageRuntime.forward) and batch 8 (eight
  sessions' steps in one pass, StageRuntime.forward_batch), after a short prompt, the formats
  taking turns step by step, from each format's median step;
- prefill tok/s of one --prefill-tokens prompt;
- load time of the model's 2-stage plan (both stages' StageRuntime, one after the other: reading,
  quantizing, the CPU's packing) and the bytes each stage's weights hold (scales included),
  each ÷ bf16's.

The issue's targets (int8 ≥ 1.2 and int4 ≥ 1.3 × bf16 decode at batch 1, every format ≥ 1.0 at
batch 8, load ≤ 1.0 × bf16, bytes ≤ 0.55 (fp8, int8) / 0.3 (int4)) are checked in the JSON. The
machine's load (`uptime`) is recorded before and after: numbers from a busy machine are noisier.

--device cuda: the same, on the GPU (its kernels: tinygemm for INT4, torch._scaled_mm for FP8, see
modeling/quantized.py), each timed step, prefill and load between two torch.cuda.synchronize().
Decoding there runs as a GPU stage's does: the sessions' KV in the runtime's block pool, every step
through forward_batch, so as CUDA graphs where the stage's decode steps are captured
(modeling/decode_graphs.py; INFERENCEMESH_DECODE_GRAPHS=0 measures them eager); whether each
format's steps were captured is recorded (--pool: the same on a CPU, uncaptured). The targets
above are the issue's for a CPU: on a GPU they are figures, not goals.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib import util
from pathlib import Path
from types import ModuleType

import torch

import inferencemesh
from inferencemesh.bundled import resolve_model
from inferencemesh.checkpoint.read import read_local
from inferencemesh.compute_dtype import cpu_flags
from inferencemesh.modeling import quantized_load
from inferencemesh.modeling.kv_pool import BlockTableKV, KVPool
from inferencemesh.modeling.loader import StageModules, load_stage
from inferencemesh.modeling.quantized import QuantizedLinear
from inferencemesh.modeling.runtime import Segment, StageRuntime
from inferencemesh.planner import PlanInputs, plan_stages

FORMATS = ("bf16", "int8", "int4", "fp8")
TARGETS = [  # (metric, format, op, value)
    ("decode_b1_tok_s", "int8", ">=", 1.2), ("decode_b1_tok_s", "int4", ">=", 1.3),
    *[("decode_b8_tok_s", f, ">=", 1.0) for f in FORMATS[1:]],
    *[("load_2_stages_s", f, "<=", 1.0) for f in FORMATS[1:]],
    ("weight_bytes", "int8", "<=", 0.55), ("weight_bytes", "fp8", "<=", 0.55), ("weight_bytes", "int4", "<=", 0.3),
]
PROMPT = 16  # tokens each decoding session reads before its timed steps
MAX_CONTEXT = 2048  # serve's default
BLOCK = 16  # positions a KV block holds (a GPU stage's, protocol.transport.KV_BLOCK_TOKENS)
DEVICE = torch.device("cpu")  # --device


def sync() -> None:
    """Wait for the GPU's queued work (a timed step ends when its kernels have)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def machine() -> dict:
    flags = cpu_flags()
    model = next((line.partition(":")[2].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    out = {"cpu": model, "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags,
           "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
           "platform": platform.platform()}
    if DEVICE.type == "cuda":
        props = torch.cuda.get_device_properties(DEVICE)
        out["gpu"] = {"name": props.name, "capability": list(torch.cuda.get_device_capability(DEVICE)),
                      "memory_GiB": round(props.total_memory / 2 ** 30, 1), "cuda": torch.version.cuda}
    return out


def tree() -> dict:
    """The commit measured and whether its source had uncommitted changes."""
    src = Path(inferencemesh.__file__).resolve().parent
    def git(*args: str) -> str:
        out = subprocess.run(["git", "-C", str(src), *args], capture_output=True, text=True, check=False)
        return out.stdout.strip()
    return {"src": str(src), "commit": git("rev-parse", "HEAD"),
            "uncommitted_changes": bool(git("status", "--porcelain", "--", "."))}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


BEFORE: dict[str, ModuleType] = {}  # --before: another commit's modeling/quantized.py, as a module


def quantization(fmt: str) -> str | None:
    name = fmt.partition("@")[0]
    return None if name == "bf16" else name


def load(model: Path, start: int, end: int, fmt: str) -> StageModules:
    """load_stage; a "@before" format quantizes with --before's quantize() (its QuantizedLinear); a
    "@pytorch" one computes without the native kernels (PyTorch's kernels and dequantized tiles)."""
    if fmt.endswith("@pytorch"):
        modules = load_stage(model, start, end, dtype="bfloat16", device=str(DEVICE), quantization=quantization(fmt))
        for part in (modules.layers, modules.lm_head):
            for layer in [] if part is None else part.modules():
                if isinstance(layer, QuantizedLinear):
                    layer.native_rows = 0
        return modules
    if not fmt.endswith("@before"):
        return load_stage(model, start, end, dtype="bfloat16", device=str(DEVICE), quantization=quantization(fmt))
    ours = quantized_load.quantize
    quantized_load.quantize = BEFORE["module"].quantize
    try:
        return load_stage(model, start, end, dtype="bfloat16", device=str(DEVICE), quantization=quantization(fmt))
    finally:
        quantized_load.quantize = ours


def runtime(model: Path, start: int, end: int, fmt: str, context: int) -> tuple[StageRuntime, int]:
    """Layers [start, end) in bfloat16, their linear layers quantized as they are read (load_stage's
    quantization, what `--quantization` does), ready to run (the CPU's packing); and the bytes its
    weights hold as loaded (each tensor once: a tied head is the embedding)."""
    modules = load(model, start, end, fmt)
    held = {id(t): t.numel() * t.element_size() for m in (modules.embed, modules.layers, modules.norm,
                                                           modules.lm_head)
            if m is not None for t in [*m.parameters(), *m.buffers()]}
    return (StageRuntime(model, start, end, dtype="bfloat16", device=str(DEVICE), max_context=context,
                         modules=modules), sum(held.values()))


def load_two_stages(model: Path, fmt: str, bounds: list[tuple[int, int]]) -> tuple[float, list[int]]:
    """Seconds until both stages of the 2-stage plan are ready to run (StageRuntime: load_stage, then
    the CPU's weight packing), one after the other, and the bytes each one's weights hold."""
    sync()
    start = time.perf_counter()
    stages = [runtime(model, a, b, fmt, MAX_CONTEXT) for a, b in bounds]
    sync()
    seconds = time.perf_counter() - start
    held = [h for _, h in stages]
    del stages
    gc.collect()
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
    return seconds, held


def paths(runtime: StageRuntime) -> dict[str, str]:
    """How each quantized linear layer of the first decoder layer computes (QuantizedLinear.path)."""
    layer = runtime._layers[0]
    return {name: m.path for name, m in layer.named_modules() if type(m).__name__ == QuantizedLinear.__name__}


class Decoder:
    """`len(prompts)` sessions of one runtime decoding greedy tokens together, a step at a time
    (with a pool: each session's KV in its blocks of it, as a GPU stage keeps it, every step
    through forward_batch)."""

    def __init__(self, runtime: StageRuntime, prompts: list[torch.Tensor],
                 pool: tuple[KVPool, int] | None = None) -> None:
        self.runtime = runtime
        self.pool = None
        if pool is not None:  # (the pool, blocks a session)
            self.pool, per = pool
            self.tables = [list(range(i * per, (i + 1) * per)) for i in range(len(prompts))]
            self.pooled(prompts)
            return
        self.sessions = [runtime.new_session() for _ in prompts]
        self.last = []
        for kv, prompt in zip(self.sessions, prompts, strict=True):
            logits = runtime.forward(kv, 0, token_ids=prompt)
            assert logits is not None
            self.last.append(int(logits[-1].argmax()))
        self.pos = prompts[0].numel()

    def pooled(self, prompts: list[torch.Tensor]) -> None:
        assert self.pool is not None
        self.last = []
        for table, prompt in zip(self.tables, prompts, strict=True):
            logits = self.runtime.forward(BlockTableKV(self.pool, table, 0, prompt.numel()), 0, token_ids=prompt)
            assert logits is not None
            self.last.append(int(logits[-1].argmax()))
        self.pos = prompts[0].numel()

    def step(self) -> float:
        """Seconds for one step of every session."""
        if self.pool is not None:
            return self.pooled_step()
        start = time.perf_counter()
        if len(self.sessions) == 1:
            outs = [self.runtime.forward(self.sessions[0], self.pos, token_ids=torch.tensor([self.last[0]]))]
        else:
            outs = self.runtime.forward_batch([Segment(kv, self.pos, torch.tensor([t]))
                                               for kv, t in zip(self.sessions, self.last, strict=True)])
        self.last = [int(o[-1].argmax()) for o in outs if o is not None]
        self.pos += 1
        return time.perf_counter() - start

    def pooled_step(self) -> float:
        assert self.pool is not None
        segments = [Segment(BlockTableKV(self.pool, table, self.pos, 1), self.pos, torch.tensor([t]))
                    for table, t in zip(self.tables, self.last, strict=True)]
        sync()
        start = time.perf_counter()
        outs = self.runtime.forward_batch(segments)
        self.last = [int(o[-1].argmax()) for o in outs if o is not None]  # the sampler's read: a sync
        sync()
        seconds = time.perf_counter() - start
        self.pos += 1
        return seconds


def decode(runtimes: dict[str, StageRuntime], prompts: list[torch.Tensor], steps: int,
           pools: dict[str, tuple[KVPool, int]] | None = None) -> dict[str, float]:
    """Tokens per second per format, the formats taking turns step by step (a step is tens of
    milliseconds: the machine's drifting load falls on all of them alike); from the median step."""
    decoders = {f: Decoder(rt, prompts, (pools or {}).get(f)) for f, rt in runtimes.items()}
    times: dict[str, list[float]] = {f: [] for f in runtimes}
    for _ in range(steps):
        for f, d in decoders.items():
            times[f].append(d.step())
    return {f: len(prompts) / statistics.median(t) for f, t in times.items()}


def prefill(runtime: StageRuntime, ids: torch.Tensor) -> float:
    kv = runtime.new_session()
    sync()
    start = time.perf_counter()
    runtime.forward(kv, 0, token_ids=ids)
    sync()
    return ids.numel() / (time.perf_counter() - start)


def graphs_state(runtime: StageRuntime) -> dict:
    """Whether this runtime's pooled decode steps ran as CUDA graphs (modeling/decode_graphs.py)."""
    graphs = getattr(runtime, "_graphs", None)
    if graphs is None:
        return {"captured_graphs": False, "fixed_shape_step": False}
    return {"captured_graphs": bool(graphs.capture), "captured": graphs.captured, "failed": graphs.failed,
            "buckets": sorted(graphs._graphs)}


def measure(model: Path, args: argparse.Namespace) -> dict:
    facts = read_local(model)
    layers = facts.num_layers
    plan = plan_stages(PlanInputs.from_checkpoint(facts, dtype="bfloat16"), 2)
    bounds = [(s.layer_start, s.layer_end) for s in plan]
    gen = torch.Generator().manual_seed(0)
    vocab = facts.vocab_size
    prompts = [torch.randint(3, vocab, (PROMPT,), generator=gen) for _ in range(max(args.batch))]
    long = torch.randint(3, vocab, (args.prefill_tokens,), generator=gen)
    context = max(args.prefill_tokens, PROMPT + args.decode_tokens) + 8
    runtimes = {f: runtime(model, 0, layers, f, context)[0] for f in args.formats}
    pools = None
    if DEVICE.type == "cuda" or args.pool:  # a GPU stage's KV: blocks of a pool, the sessions' tables in it
        per = -(-(PROMPT + args.decode_tokens + 1) // BLOCK)
        graphs = True if DEVICE.type == "cpu" else None  # --pool: the fixed-shape step, uncaptured
        pools = {f: (rt.new_pool(len(prompts) * per, BLOCK, decode_graphs=graphs), per) for f, rt in runtimes.items()}
    rounds: dict[str, dict[str, list[float]]] = {f: {} for f in args.formats}
    held: dict[str, list[int]] = {}
    for r in range(args.rounds):
        for f in args.formats:
            seconds, held[f] = load_two_stages(model, f, bounds)
            rounds[f].setdefault("load_2_stages_s", []).append(seconds)
        for b in args.batch:
            for f, rate in decode(runtimes, prompts[:b], args.decode_tokens, pools).items():
                rounds[f].setdefault(f"decode_b{b}_tok_s", []).append(rate)
        for f in args.formats:
            rounds[f].setdefault("prefill_tok_s", []).append(prefill(runtimes[f], long))
            print(f"round {r + 1} {f:11} " + "  ".join(f"{k} {v[-1]:.2f}" for k, v in rounds[f].items()), flush=True)
    out = summarize(rounds, held, bounds, {f: paths(rt) for f, rt in runtimes.items()})
    if pools is not None:
        out["decode_graphs"] = {f: graphs_state(rt) for f, rt in runtimes.items()}
    return out


def summarize(rounds: dict[str, dict[str, list[float]]], held: dict[str, list[int]], bounds: list[tuple[int, int]],
              layer_paths: dict[str, dict[str, str]]) -> dict:
    """Per format: the best of the rounds (max for rates, min for times), and its ratio to bf16,
    the median over the rounds of each round's ratio to that round's bf16 (measured seconds apart:
    on a shared machine the load drifts between rounds, so this pairing is what the checks use)."""
    best = {f: {k: (max(v) if k.endswith("tok_s") else min(v)) for k, v in got.items()} for f, got in rounds.items()}
    base = rounds["bf16"]
    paired = {f: {k: statistics.median(a / b for a, b in zip(v, base[k], strict=True)) for k, v in got.items()}
              for f, got in rounds.items()}
    for f in best:
        best[f]["weight_bytes"] = sum(held[f])
        paired[f]["weight_bytes"] = max(a / b for a, b in zip(held[f], held["bf16"], strict=True))  # worst stage
    out: dict = {"stages_2_plan": [list(b) for b in bounds], "formats": {}}
    for f, got in best.items():
        out["formats"][f] = {
            "best": {k: round(v, 4) for k, v in got.items()},
            "best_over_bf16_best": {k: round(v / best["bf16"][k], 3) for k, v in got.items()},
            "over_bf16": {k: round(v, 3) for k, v in paired[f].items()},
            "stage_weight_bytes": held[f],
            "stage_weight_bytes_over_bf16": [round(a / b, 3) for a, b in zip(held[f], held["bf16"], strict=True)],
            "rounds": {k: [round(x, 4) for x in v] for k, v in rounds[f].items()},
            "layer_0_paths": layer_paths[f],
        }
    checks = []
    for metric, f, op, value in TARGETS:
        if f in paired and metric in paired[f]:
            ratio = paired[f][metric]
            checks.append({"metric": metric, "format": f, "target": f"{op} {value}", "ratio": round(ratio, 3),
                           "pass": ratio >= value if op == ">=" else ratio <= value})
    out["checks"] = checks
    return out


def table(result: dict) -> str:
    metrics = list(result["formats"]["bf16"]["best"])
    scaled = {"weight_bytes": ("weight_MiB", 2 ** -20)}  # shown in MiB
    lines = [f"{'format':11}" + "".join(f"{scaled.get(m, (m,))[0]:>24}" for m in metrics)]
    for f, got in result["formats"].items():
        cells = [f"{got['best'][m] * scaled.get(m, ('', 1))[1]:>14.2f} ({got['over_bf16'][m]:5.2f}x)" for m in metrics]
        lines.append(f"{f:11}" + "".join(cells))
    lines += [f"{'PASS' if c['pass'] else 'FAIL'} {c['format']} {c['metric']} / bf16 {c['ratio']} {c['target']}"
              for c in result["checks"]]
    return "\n".join(lines)


def resummarize(path: Path) -> None:
    """The report at `path` with its results summarized from its raw rounds (as summarize does now)."""
    report = json.loads(path.read_text())
    formats = report["results"]["formats"]
    again = summarize({f: v["rounds"] for f, v in formats.items()},
                      {f: v["stage_weight_bytes"] for f, v in formats.items()},
                      [(a, b) for a, b in report["results"]["stages_2_plan"]],
                      {f: v["layer_0_paths"] for f, v in formats.items()})
    report["results"] = {**report["results"], **again}  # what summarize does not make (decode_graphs) kept
    report["summarized_by"] = tree()["commit"]
    print(table(report["results"]))
    path.write_text(json.dumps(report, indent=2) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint directory (default: the bundled code model)")
    p.add_argument("--shape", help="a random-weight preset shape instead (llama-150m)")
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decode batch sizes")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=1, help="torch's CPU threads (a GPU stage's are 1 too)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--pool", action="store_true", help="decode over a block pool, as on cuda (always there): a CPU "
                                                       "dry run of that path")
    p.add_argument("--json", type=Path)
    p.add_argument("--pytorch-kernels", action="store_true", help="also INT8 and FP8 without the native kernels "
                   "(modeling/native_kernels.py), as FORMAT@pytorch, in the same rounds")
    p.add_argument("--summarize", type=Path, help="only summarize (again) the rounds of a JSON this wrote")
    p.add_argument("--before", type=Path, help="another commit's modeling/quantized.py: its formats measured "
                                                "beside ours, as FORMAT@before, in the same rounds")
    args = p.parse_args()
    if args.summarize:
        resummarize(args.summarize)
        return
    if "bf16" not in args.formats:
        p.error("--formats must include bf16 (the baseline)")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here")
    global DEVICE
    DEVICE = torch.device(args.device)
    args.formats = ["bf16", *[f for f in args.formats if f != "bf16"]]
    if args.before:
        spec = util.spec_from_file_location("quantized_before", args.before)
        assert spec is not None and spec.loader is not None
        BEFORE["module"] = util.module_from_spec(spec)
        spec.loader.exec_module(BEFORE["module"])
        args.formats += [f"{f}@before" for f in args.formats[1:]]
    if args.pytorch_kernels:
        args.formats += [f"{f}@pytorch" for f in args.formats[1:] if f in ("int8", "fp8")]
    torch.set_num_threads(args.threads)
    if args.shape:
        from inferencemesh.programs.bench.models import make_shape_model

        model = make_shape_model(args.shape, "bfloat16")
    else:
        model = Path(resolve_model(args.model))
    report = {"issue": 36, "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(), "tree": tree(),
              "model": args.shape or str(model), "device": args.device, "threads": args.threads,
              "rounds": args.rounds, "compute_dtype": "bfloat16", "decode_tokens": args.decode_tokens,
              "prefill_tokens": args.prefill_tokens, "before": str(args.before) if args.before else None,
              "uptime_before": uptime(),
              "note": "formats interleaved round by round; over_bf16: the median of each round's ratio to that "
                      "round's bf16; best: the best round"}
    report["results"] = measure(model, args)
    report["uptime_after"] = uptime()
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(table(report["results"]))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
