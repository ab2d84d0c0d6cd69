"""Decode speed of mixture-of-experts models: the stage runtime and `inferencemesh serve` against
transformers' own generate() on the same checkpoint.

    python tools/moe_throughput.py --json docs/benchmarks/moe-throughput.json

Per family (Qwen3-MoE, Mixtral; random weights in a small but not toy shape, the bundled model's
tokenizer), greedy decoding of one stream:
- transformers: AutoModelForCausalLM.generate(), tokens after the first per second;
- stage: the whole model as one StageRuntime in this process, one token per forward (the
  compute path without the network), taking turns with transformers round by round;
- serve: `inferencemesh serve --stages 2 --speculative none` (gRPC between real processes, the
  first stage embedded), a streamed /v1/completions, tokens after the first per second.
All in float32 on the CPU (the checkpoint is float32). Best of the rounds is reported.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch
from serve_probe import decode_rate, serving

from inferencemesh.bundled import DEFAULT_MODEL, bundled_path

SHAPES = {
    "qwen3_moe": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
                      intermediate_size=1024),
    "mixtral": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                    num_local_experts=8, num_experts_per_tok=2, intermediate_size=768),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def write_checkpoint(root: Path, family: str) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    bundled = bundled_path(DEFAULT_MODEL)
    vocab = json.loads((bundled / "config.json").read_text())["vocab_size"]
    config = AutoConfig.for_model(family, vocab_size=vocab, max_position_embeddings=2048, bos_token_id=0,
                                  eos_token_id=0, pad_token_id=3, **SHAPES[family])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = root / family
    model.save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (bundled / name).exists():
            shutil.copy(bundled / name, path / name)
    return path


def generate_rate(model: object, ids: torch.Tensor, tokens: int) -> float:
    """Tokens after the first per second of transformers' greedy generate()."""
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids[None], max_new_tokens=1, do_sample=False)  # type: ignore[attr-defined]
        first = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids[None], max_new_tokens=tokens, min_new_tokens=tokens,  # type: ignore[attr-defined]
                       do_sample=False)
        total = time.perf_counter() - start
    return (tokens - 1) / (total - first)


def stage_rate(runtime: object, ids: torch.Tensor, tokens: int) -> float:
    """The same through one StageRuntime holding every layer, greedy, one token per forward."""
    kv = runtime.new_session()  # type: ignore[attr-defined]
    logits = runtime.forward(kv, 0, token_ids=ids)  # type: ignore[attr-defined]
    position, start = len(ids), time.perf_counter()
    for _ in range(tokens - 1):
        token = torch.tensor([int(logits[-1].argmax())])
        logits = runtime.forward(kv, position, token_ids=token)  # type: ignore[attr-defined]
        position += 1
    return (tokens - 1) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--port", type=int, default=18731)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from inferencemesh.modeling.runtime import StageRuntime

    torch.set_num_threads(args.threads)
    results: dict = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
                                 "torch": torch.__version__},
                     "tokens": args.tokens, "rounds": args.rounds, "families": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for family in SHAPES:
            path = write_checkpoint(Path(tmp), family)
            peer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            layers = SHAPES[family]["num_hidden_layers"]
            runtime = StageRuntime(path, 0, layers, dtype="float32", device="cpu", max_context=512)
            params = sum(t.numel() for t in peer.parameters())
            ids = torch.randint(5, 4000, (32,), generator=torch.Generator().manual_seed(1))
            rates: dict[str, list[float]] = {"transformers": [], "stage": [], "serve": []}
            for _ in range(args.rounds):  # interleaved: the machine is noisy
                rates["transformers"].append(generate_rate(peer, ids, args.tokens))
                rates["stage"].append(stage_rate(runtime, ids, args.tokens))
            del peer, runtime
            with serving(args.port, "--model", str(path), "--stages", "2", "--dtype", "float32",
                         "--speculative", "none") as base:
                for _ in range(args.rounds):
                    rates["serve"].append(decode_rate(base, "def fibonacci(n):", args.tokens))
            best = {k: max(v) for k, v in rates.items()}
            results["families"][family] = {
                "shape": SHAPES[family], "parameters": params,
                "tokens_per_s": {k: round(v, 2) for k, v in best.items()},
                "runs": {k: [round(x, 2) for x in v] for k, v in rates.items()},
                "stage_over_transformers": round(best["stage"] / best["transformers"], 3),
                "serve_over_transformers": round(best["serve"] / best["transformers"], 3),
            }
            print(f"{family:10} {params / 1e6:5.1f}M params  transformers {best['transformers']:6.1f} tok/s  "
                  f"stage {best['stage']:6.1f} tok/s ({best['stage'] / best['transformers']:.2f}x)  "
                  f"serve 2 stages {best['serve']:6.1f} tok/s ({best['serve'] / best['transformers']:.2f}x)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
