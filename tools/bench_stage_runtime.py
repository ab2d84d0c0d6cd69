"""Decode speed of one in-process StageRuntime against transformers generate(), same model, same CPU.

    python tools/bench_stage_runtime.py --threads 2 --dtypes bfloat16,float32

A random Llama (hidden 768, 12 layers, 12 heads, intermediate 2048, vocab 32000: ~134M
parameters) is written once under --model-dir. Each round times transformers' greedy
generate() and the runtime's greedy loop (prefill, then one forward per token) on the same
prompt, interleaved, so load from other processes hits both alike. Reported per dtype: median
and best tokens/s of each and their ratios, the runtime's time per output token, and whether
both produced the same tokens. Also the runtime's own per-call cost on a tiny model (where the
weights cost nothing), i.e. what a decode step adds beyond the matmuls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

SHAPE = dict(
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    intermediate_size=2048,
    vocab_size=32000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


def ensure_model(directory: Path, shape: dict) -> Path:
    if (directory / "config.json").exists():
        return directory
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape))
    model.save_pretrained(directory, max_shard_size="200MB")  # several shards, like a hub repo
    return directory


def hf_generate(model, prompt: torch.Tensor, new_tokens: int) -> tuple[float, list[int]]:
    start = time.perf_counter()
    out = model.generate(prompt[None], max_new_tokens=new_tokens, do_sample=False)
    return time.perf_counter() - start, out[0, len(prompt) :].tolist()


def runtime_generate(runtime, prompt: torch.Tensor, new_tokens: int) -> tuple[float, list[int], float]:
    """Greedy loop: returns total seconds, tokens, and seconds per decode step (TPOT)."""
    start = time.perf_counter()
    kv = runtime.new_session()
    logits = runtime.forward(kv, 0, token_ids=prompt)
    first = time.perf_counter()
    tokens: list[int] = []
    pos = len(prompt)
    token = logits.argmax(-1)
    tokens.append(int(token))
    while len(tokens) < new_tokens:
        logits = runtime.forward(kv, pos, token_ids=token)
        pos += 1
        token = logits.argmax(-1)
        tokens.append(int(token))
    end = time.perf_counter()
    kv.release()
    return end - start, tokens, (end - first) / max(1, new_tokens - 1)


def per_call_overhead_us(rounds: int = 300) -> float:
    """Microseconds per decode step per layer on a model too small for its matmuls to matter.

    Measured on one thread: the Python and small-op cost of a step, without OpenMP hand-offs.
    """
    import tempfile

    from inferencemesh.stage.runtime import StageRuntime
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = dict(SHAPE, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4)
    tiny.update(vocab_size=256, num_hidden_layers=4)
    with tempfile.TemporaryDirectory() as tmp:
        LlamaForCausalLM(LlamaConfig(**tiny)).save_pretrained(tmp)
        rt = StageRuntime(tmp, 0, 4, dtype="float32")
    kv = rt.new_session()
    rt.forward(kv, 0, token_ids=torch.arange(16))
    token = torch.tensor([1])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    best = float("inf")
    for _ in range(3):
        kv.truncate(16)
        start = time.perf_counter()
        for i in range(rounds):
            rt.forward(kv, 16 + i, token_ids=token)
        best = min(best, (time.perf_counter() - start) / rounds)
    torch.set_num_threads(threads)
    return best * 1e6 / 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/inferencemesh-bench-llama150m"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from inferencemesh.stage.runtime import StageRuntime
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model_dir = ensure_model(args.model_dir, SHAPE)
    prompt = torch.randint(0, SHAPE["vocab_size"], (args.prompt,), generator=torch.Generator().manual_seed(0))
    report = {"threads": args.threads, "prompt": args.prompt, "new_tokens": args.new_tokens, "results": []}
    for dtype in args.dtypes.split(","):
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        hf.generation_config.pad_token_id = 0
        hf.generation_config.eos_token_id = None  # always the full count of new tokens, like the loop
        rt = StageRuntime(model_dir, 0, SHAPE["num_hidden_layers"], dtype=dtype)
        hf_generate(hf, prompt, 4), runtime_generate(rt, prompt, 4)  # warm-up
        hf_rates, rt_rates, tpots = [], [], []
        for _ in range(args.rounds):
            seconds, hf_tokens = hf_generate(hf, prompt, args.new_tokens)
            hf_rates.append(args.new_tokens / seconds)
            seconds, rt_tokens, tpot = runtime_generate(rt, prompt, args.new_tokens)
            rt_rates.append(args.new_tokens / seconds)
            tpots.append(tpot * 1e3)
        entry = {
            "dtype": dtype,
            "hf_generate_tok_s": {"median": statistics.median(hf_rates), "best": max(hf_rates)},
            "stage_runtime_tok_s": {"median": statistics.median(rt_rates), "best": max(rt_rates)},
            "ratio_median": statistics.median(rt_rates) / statistics.median(hf_rates),
            "ratio_best": max(rt_rates) / max(hf_rates),
            "stage_tpot_ms_median": statistics.median(tpots),
            "same_tokens": hf_tokens == rt_tokens,
        }
        report["results"].append(entry)
        print(json.dumps(entry))
        del hf, rt
    report["step_overhead_us_per_layer_1_thread"] = per_call_overhead_us()
    print(json.dumps({"step_overhead_us_per_layer_1_thread": report["step_overhead_us_per_layer_1_thread"]}))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
