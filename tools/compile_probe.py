"""What torch.compile (inductor, this CPU) would give a stage's decode step, before building it in.

One decode step of every layer (lean_layers' math, float32, one new token over a context in the
KV pool) three ways, interleaved: the runtime's forward as it serves (lean layers, eager, the head
included), the same step as one Python function (eager, no head), and that function compiled with
dynamic context length (the KV write left outside the graph: a write into the pool inside it makes
inductor copy the whole pool back every step). Prints and writes: compile seconds, the recompile on
a new length, the thread's CPU time per step, and the compiled step's largest difference.

    python tools/compile_probe.py [--shape llama-150m] [--context 400] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from inferencemesh.modeling.kv_pool import BlockTableKV
from inferencemesh.modeling.lean_layers import LeanLayer
from inferencemesh.modeling.runtime import StageRuntime
from inferencemesh.programs.bench.config import BenchConfig
from inferencemesh.programs.bench.models import load_bench_model


def decode_step(layers: list[LeanLayer]):  # noqa: ANN201 (a closure torch.compile traces)
    shape = layers[0].shape
    groups, dim, kv_heads = shape.heads // shape.kv_heads, shape.head_dim, shape.kv_heads

    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def step(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, store: torch.Tensor, stop: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [1, 1, H] at position `stop` over positions [0, stop) of the pool: (x out, its new K/V)."""
        new = []
        for i, layer in enumerate(layers):
            norm, eps = layer.input_norm
            qkv = layer.qkv(torch.rms_norm(x, norm.shape, norm, eps)).view(-1, dim)
            qk = rotate(qkv[: shape.heads + kv_heads], cos, sin)
            q, k, v = qk[: shape.heads], qk[shape.heads:], qkv[shape.heads + kv_heads:]
            keys, values = store[i, 0, :, :stop], store[i, 1, :, :stop]
            queries = q.view(kv_heads, groups, dim) * layer.scaling
            old = queries @ keys.transpose(-1, -2)
            own = (queries * k.view(kv_heads, 1, dim)).sum(-1, keepdim=True)
            top = torch.maximum(old.amax(-1, keepdim=True), own)
            p_old, p_own = torch.exp(old - top), torch.exp(own - top)
            out = (p_old @ values + p_own * v.view(kv_heads, 1, dim)) / (p_old.sum(-1, keepdim=True) + p_own)
            x = x + layer.o_proj(out.reshape(1, 1, -1))
            norm, eps = layer.post_norm
            gate, up = layer.gate_up(torch.rms_norm(x, norm.shape, norm, eps)).chunk(2, dim=-1)
            x = x + layer.down_proj(torch.nn.functional.silu(gate) * up)
            new.append(torch.stack((k, v)))
        return x, torch.stack(new)

    return step


def cpu_ms(fn, steps: int) -> float:  # noqa: ANN001
    for _ in range(10):
        fn()
    start = time.thread_time()
    for _ in range(steps):
        fn()
    return (time.thread_time() - start) / steps * 1e3


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default=None)
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_bench_model(BenchConfig(dtype="float32", shape=args.shape, stages=(1,)).check())
    runtime = StageRuntime(model.model_dir, 0, model.facts.num_layers, dtype="float32", max_context=2048)
    layers = [layer for layer in runtime._lean if layer is not None]
    assert len(layers) == runtime.num_layers
    pool = runtime.new_pool(2048 // 16)
    blocks = list(range(pool.num_blocks))
    context = args.context
    runtime.forward(BlockTableKV(pool, blocks, 0, context), 0, token_ids=torch.randint(0, 100, (context,)))
    store = pool.store
    x = torch.randn(1, 1, runtime.hidden_size)
    cos, sin = runtime._rope(x, context, 1, None)
    cos, sin = cos.reshape(1, -1), sin.reshape(1, -1)
    step = decode_step(layers)
    compiled = torch.compile(step, dynamic=True, fullgraph=True)
    started = time.perf_counter()
    compiled(x, cos, sin, store, context - 1)
    compile_s = time.perf_counter() - started
    started = time.perf_counter()
    compiled(x, cos, sin, store, context)
    again_s = time.perf_counter() - started
    want, got = step(x, cos, sin, store, context)[0], compiled(x, cos, sin, store, context)[0]
    runs = {"runtime.forward, lean, eager (head included)": lambda: runtime.forward(
                BlockTableKV(pool, blocks, context, 1), context, token_ids=torch.tensor([5])),
            "one function, eager (no head)": lambda: step(x, cos, sin, store, context),
            "one function, compiled (no head)": lambda: compiled(x, cos, sin, store, context)}
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            samples[name].append(cpu_ms(fn, 200))
    report = {"model": model.model_dir.name, "shape": args.shape, "context": context, "threads": args.threads,
              "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "compile_s": round(compile_s, 1), "next_length_s": round(again_s, 3),
              "compiled_max_abs_difference": float((want - got).abs().max()),
              "thread_cpu_ms_per_step": {name: round(statistics.median(v), 3) for name, v in samples.items()}}
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
