"""What constrained decoding costs the frontend: compile time per schema, mask time per step, and
window_masks for a window of 4 drafts, on the bundled tokenizer (4,096 tokens) and on byte-level
BPE tokenizers trained here on the Python standard library to real-model sizes (no hub access).

    PYTHONPATH=src python tools/grammar_bench.py docs/benchmarks/grammar-masks.json [--vocabs 32000,150000]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Any

import llguidance
import numpy as np
import tokenizers
import transformers

from inferencemesh.bundled import DEFAULT_MODEL, bundled_path
from inferencemesh.frontend.engine.constraints import Constraint
from inferencemesh.frontend.engine.grammar import GrammarTokenizer, SessionGrammar, grammar_tokenizer
from inferencemesh.frontend.openai.structured_outputs import constraint_from_request
from inferencemesh.token_masks import allowed_tokens

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "openai-strict": {
        "type": "object",
        "properties": {
            "answer": {"type": "string"},
            "confidence": {"anyOf": [{"type": "number", "minimum": 0, "maximum": 1}, {"type": "null"}]},
            "steps": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"why": {"type": "string"}, "ok": {"type": "boolean"}},
                    "required": ["why", "ok"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["answer", "confidence", "steps"],
        "additionalProperties": False,
    },
    "recursive-defs": {
        "$ref": "#/$defs/node",
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "label": {"type": "string", "pattern": "^[a-z]{1,12}$"},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                },
                "required": ["id", "label"],
            }
        },
    },
    "enum-200": {
        "type": "object",
        "properties": {"city": {"enum": [f"city-{i:03d}" for i in range(200)]}, "n": {"type": "integer"}},
        "required": ["city", "n"],
    },
}
WALK_SCHEMA = "openai-strict"
STEPS = 200
WINDOW = 4


def trained_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE of up to vocab_size tokens trained on this Python's sources (the standard
    library, then installed packages: enough text for ~150k merges)."""
    paths = sysconfig.get_paths()
    files = sorted(str(p) for p in Path(paths["stdlib"]).rglob("*.py"))
    files += sorted(str(p) for p in Path(paths["purelib"]).rglob("*.py"))[:20_000]
    model = tokenizers.Tokenizer(tokenizers.models.BPE())
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = (Path(f).read_text(encoding="utf-8", errors="ignore") for f in files)
    model.train_from_iterator(texts, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, eos_token="<|endoftext|>")


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "mean_us": round(statistics.fmean(ordered) * 1e6, 1),
        "p50_us": round(ordered[len(ordered) // 2] * 1e6, 1),
        "p99_us": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e6, 1),
        "max_us": round(ordered[-1] * 1e6, 1),
        "n": len(ordered),
    }


def pick(rng: np.random.Generator, ids: np.ndarray, texts: list[str], eos: int, step: int) -> int:
    """Uniform among allowed tokens that are not blank; past 60 steps EOS, then closing tokens."""
    if step > 60 and eos in ids:
        return eos
    closing = [i for i in ids if texts[i].strip() and set(texts[i]) <= set('"]}, ')] if step > 60 else []
    solid = closing or [i for i in ids if i < len(texts) and texts[i].strip()]
    return int(rng.choice(solid or ids))


def bench_vocabulary(label: str, hf: Any, vocab_size: int) -> dict[str, Any]:
    started = time.perf_counter()
    tokenizer = grammar_tokenizer(hf, vocab_size)
    build_s = time.perf_counter() - started
    texts = [hf.decode([i]) for i in range(len(hf))]
    eos = tokenizer.eos_token_ids[0]

    compile_ms: dict[str, dict[str, float]] = {}
    constraints: dict[str, Constraint] = {}
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        constraint = constraint_from_request(guided_json=schema)
        t1 = time.perf_counter()
        assert constraint is not None
        SessionGrammar(constraint, tokenizer)
        t2 = time.perf_counter()
        constraints[name] = constraint
        compile_ms[name] = {"validate_ms": round((t1 - t0) * 1e3, 2), "matcher_ms": round((t2 - t1) * 1e3, 2)}

    rng = np.random.default_rng(0)
    mask_s: list[float] = []
    window_s: list[float] = []
    draft_mask_s: list[float] = []
    grammar = SessionGrammar(constraints[WALK_SCHEMA], tokenizer)
    walks = 0
    while len(mask_s) < STEPS:
        t0 = time.perf_counter()
        masks, _ = grammar.window_masks([])
        mask_s.append(time.perf_counter() - t0)
        # a window of WINDOW drafts the grammar allows (the case where every mask is computed)
        drafts: list[int] = []
        for i in range(WINDOW):
            t0 = time.perf_counter()
            after = grammar.mask_after(drafts)
            draft_mask_s.append(time.perf_counter() - t0)
            assert after is not None
            token = pick(rng, allowed_tokens(after[0]), texts, eos, len(mask_s) + i)
            if token == eos:
                break
            drafts.append(token)
        t0 = time.perf_counter()
        _, usable = grammar.window_masks(drafts)
        if len(drafts) == WINDOW:
            window_s.append(time.perf_counter() - t0)
        token = pick(rng, allowed_tokens(masks[0]), texts, eos, len(mask_s))
        grammar.commit([token])
        if token == eos:
            walks += 1
            grammar = SessionGrammar(constraints[WALK_SCHEMA], tokenizer)

    return {
        "label": label,
        "vocab_size": vocab_size,
        "tokenizer_build_s": round(build_s, 3),
        "compile": compile_ms,
        "mask_per_step": percentiles(mask_s),
        "mask_after_drafts": percentiles(draft_mask_s),
        f"window_masks_{WINDOW}_drafts": percentiles(window_s),
        "walk_schema": WALK_SCHEMA,
        "walks_finished": walks,
        "gil": gil_check(constraints[WALK_SCHEMA], tokenizer),
    }


def gil_check(constraint: Constraint, tokenizer: GrammarTokenizer) -> dict[str, float]:
    """A pure-Python loop's time alone and while another thread computes masks nonstop: if the
    mask computation held the GIL, the loop would slow by about the masks' share of the time."""
    grammar = SessionGrammar(constraint, tokenizer)
    grammar.commit(tokenizer.ll.tokenize_str('{"answer": "the quick brown'))

    def loop() -> float:
        t0 = time.perf_counter()
        total = 0
        for i in range(3_000_000):
            total += i
        return time.perf_counter() - t0

    alone = loop()
    stop = threading.Event()
    computed = [0]

    def masks() -> None:
        while not stop.is_set():
            grammar.window_masks([])
            computed[0] += 1

    thread = threading.Thread(target=masks)
    thread.start()
    time.sleep(0.05)
    with_masks = loop()
    stop.set()
    thread.join()
    return {
        "python_loop_alone_s": round(alone, 3),
        "python_loop_with_mask_thread_s": round(with_masks, 3),
        "masks_computed_meanwhile": computed[0],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("output", type=Path, help="where to write the JSON results")
    parser.add_argument("--vocabs", default="32000,150000", help="trained BPE sizes, comma-separated ('' for none)")
    args = parser.parse_args(argv)

    results: list[dict[str, Any]] = []
    bundled = transformers.AutoTokenizer.from_pretrained(bundled_path(DEFAULT_MODEL))
    results.append(bench_vocabulary(f"bundled {DEFAULT_MODEL}", bundled, 4096))
    print(json.dumps(results[-1], indent=1), flush=True)
    for size in [int(v) for v in args.vocabs.split(",") if v]:
        t0 = time.perf_counter()
        hf = trained_tokenizer(size)
        trained_s = time.perf_counter() - t0
        result = bench_vocabulary(f"byte-level BPE trained on this Python's sources, {len(hf)} tokens", hf, len(hf))
        result["trained_in_s"] = round(trained_s, 1)
        results.append(result)
        print(json.dumps(results[-1], indent=1), flush=True)

    report = {
        "what": "llguidance token-mask cost for constrained decoding (frontend/engine/grammar.py), CPU, one thread",
        "llguidance": llguidance.__version__,
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "cpus": len(__import__("os").sched_getaffinity(0)),
        "steps": STEPS,
        "results": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
