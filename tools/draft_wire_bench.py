"""What a sampled VERIFY frame carries on every hop for the draft's distributions, dense (f32
[k, vocab], Frame field 12 until it was retired) against sparse (Frame.draft_q: sampling.draft_row's
rows), and what the sparse rows cost in acceptance on the bundled models; and what a constrained
frame's token masks take, as bitsets against token_masks.py's compact rows.

    PYTHONPATH=src python tools/draft_wire_bench.py docs/benchmarks/draft-wire-bytes.json [--mask-vocab 150000]

- bytes: the VERIFY frame of a window of k drafts as the frontend builds it (ids, a 1,024-token
  context's block table), at a vocabulary of 151,936 (Qwen's) and 4,096 (the bundled models'). The
  dense size is exact (the bytes field's tag, length and payload); the sparse size is the frame's
  own ByteSize, at the most a row lists (a flat q: MAX_DRAFT_TOKENS) and, at 4,096, for the bundled
  draft's real rows at temperature 0.8.
- acceptance: teacher-forced along text the target samples at temperature 0.8 from code prompts,
  the expected acceptance of a draft token, sum_v min(p(v), q(v)), with q the draft's whole
  distribution (before) and the row it now sends and draws from (after). Exact expectations, no
  sampling noise.
- masks: grammar_bench.py's walk of each of its JSON schemas (uniform among allowed tokens), one mask
  row a step, on the bundled tokenizer and, with --mask-vocab, on a byte-level BPE of that size trained
  here (about 3 minutes idle, 12 loaded): bytes a row as a bitset and as packed now, the microseconds
  to pack and unpack a row, and to build and unpack its bitset frame as before (header and words).
- host: milliseconds for a window on the frontend (drawing the drafts, building the frame's bytes),
  at an intermediate stage (parse and re-serialize) and at the last stage (parse, read the rows),
  dense and sparse interleaved, one thread (indicative on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import struct
import time
from pathlib import Path
from typing import Any

import grammar_bench  # beside this script in tools/: its schemas, walk and trained tokenizers
import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from inferencemesh.bundled import DEFAULT_MODEL, DRAFT_MODEL, bundled_path
from inferencemesh.frontend.engine.grammar import SessionGrammar, grammar_tokenizer
from inferencemesh.frontend.openai.structured_outputs import constraint_from_request
from inferencemesh.protocol import codec
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol.transport import KV_BLOCK_TOKENS, MAX_DRAFT_TOKENS
from inferencemesh.sampling import DRAFT_TAIL_MASS, DraftRow, SamplingParams, draft_row, draw, probabilities
from inferencemesh.token_masks import allowed_tokens, mask_words, pack_token_masks, unpack_token_masks

K = 5
TEMPERATURE = 0.8
VOCABS = (151_936, 4_096)
CONTEXT = 1024
PROMPTS = ("import os\n\ndef ", "class Queue:\n    def __init__(self", "    for key, value in ")


def varint_size(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def frame(vocab: int, draft_q: pb.DraftDistributions | None = None) -> pb.Frame:
    """The VERIFY frame of K drafts as session.py builds it (no Sampling: it travels when it changes)."""
    return pb.Frame(session_id="cmpl-" + "a" * 32, request_id="cmpl-" + "a" * 32, kind=pb.VERIFY,
                    pos_start=CONTEXT - K - 1, token_count=K + 1, token_ids=[vocab - 1] * (K + 1),
                    seq=123_456, kv_blocks=list(range(CONTEXT // KV_BLOCK_TOKENS)), draft_q=draft_q)


def dense_frame_bytes(vocab: int) -> int:
    payload = K * vocab * 4
    return frame(vocab).ByteSize() + 1 + varint_size(payload) + payload  # field 12: tag, length, payload


def flat_rows(vocab: int) -> list[DraftRow]:
    return [draft_row(torch.full((vocab,), 1.0 / vocab)) for _ in range(K)]


def real_distributions() -> tuple[torch.Tensor, torch.Tensor]:
    """(p, q) at temperature 0.8, [positions, 4096], along the target's own samples from PROMPTS."""
    tokenizer = AutoTokenizer.from_pretrained(str(bundled_path(DEFAULT_MODEL)))
    target = AutoModelForCausalLM.from_pretrained(str(bundled_path(DEFAULT_MODEL)), dtype=torch.float32)
    draft = AutoModelForCausalLM.from_pretrained(str(bundled_path(DRAFT_MODEL)), dtype=torch.float32)
    params = SamplingParams(temperature=TEMPERATURE)
    ps, qs = [], []
    torch.manual_seed(0)
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            text = target.generate(ids, do_sample=True, temperature=TEMPERATURE, top_k=0, max_new_tokens=128,
                                   pad_token_id=tokenizer.eos_token_id)
            start = ids.shape[1] - 1
            ps.append(probabilities(target(text).logits[0, start:-1], params))
            qs.append(probabilities(draft(text).logits[0, start:-1], params))
    return torch.cat(ps), torch.cat(qs)


def as_dense(row: DraftRow) -> torch.Tensor:
    return torch.full((row.vocab,), row.spread).index_put_((row.ids,), row.probs)


def acceptance(p: torch.Tensor, q: torch.Tensor) -> dict[str, Any]:
    rows = [draft_row(qi) for qi in q]
    sparse = torch.stack([as_dense(r) for r in rows])
    listed = [r.ids.numel() for r in rows]
    window_bytes = [frame(q.shape[-1], codec.encode_draft_q(rows[i:i + K])).ByteSize()
                    for i in range(0, len(rows) - K + 1, K)]
    return {
        "positions": q.shape[0],
        "acceptance_whole_q": round(float(torch.minimum(p, q).sum(-1).mean()), 4),
        "acceptance_sent_rows": round(float(torch.minimum(p, sparse).sum(-1).mean()), 4),
        "listed_tokens_per_row": {"mean": round(statistics.fmean(listed), 1), "min": min(listed),
                                  "max": max(listed)},
        "remainder_mean": round(statistics.fmean(r.remainder for r in rows), 4),
        "verify_frame_bytes_real_rows": {"mean": round(statistics.fmean(window_bytes)), "max": max(window_bytes)},
    }


def host_ms(vocab: int, reps: int = 15) -> dict[str, dict[str, float]]:
    """Milliseconds for a window of K drafts: the frontend drawing each draft token and building the
    frame's bytes, an intermediate stage parsing and re-serializing the frame, the last stage parsing
    it and reading the rows; dense as before (a draw from q, rows as one f32 payload), sparse now."""
    q = torch.softmax(torch.randn(K, vocab, generator=torch.Generator().manual_seed(1)) * 3, -1)
    gen = torch.Generator().manual_seed(2)
    times: dict[str, dict[str, list[float]]] = {form: {"frontend": [], "hop": [], "last_stage": []}
                                                for form in ("dense", "sparse")}

    def dense() -> tuple[bytes, float]:
        for row in q:
            int(torch.multinomial(row, 1, generator=gen))
        payload = q.contiguous().numpy().tobytes()  # through a bytes field of the same size as field 12
        return frame(vocab).SerializeToString() + pb.Frame(token_masks=payload).SerializeToString(), 0.0

    def sparse() -> tuple[bytes, float]:
        rows = [draft_row(row) for row in q]
        for row in rows:
            draw(row, gen)
        return frame(vocab, codec.encode_draft_q(rows)).SerializeToString(), 0.0

    def read_dense(wire: bytes) -> None:
        probs = torch.frombuffer(bytearray(pb.Frame.FromString(wire).token_masks), dtype=torch.float32)
        assert bool(torch.isfinite(probs).all()) and not bool((probs < 0).any())

    def read_sparse(wire: bytes) -> None:
        codec.decode_draft_q(pb.Frame.FromString(wire).draft_q, K, vocab)

    for _ in range(reps):  # interleaved
        for form, make, read in (("dense", dense, read_dense), ("sparse", sparse, read_sparse)):
            t0 = time.perf_counter()
            wire, _ = make()
            t1 = time.perf_counter()
            wire = pb.Frame.FromString(wire).SerializeToString()
            t2 = time.perf_counter()
            read(wire)
            t3 = time.perf_counter()
            for name, seconds in (("frontend", t1 - t0), ("hop", t2 - t1), ("last_stage", t3 - t2)):
                times[form][name].append(seconds)
    return {form: {name: round(statistics.median(v) * 1e3, 3) for name, v in parts.items()}
            for form, parts in times.items()}


def mask_rows(label: str, hf: Any, vocab: int, steps: int = 100) -> dict[str, Any]:
    """Bytes and pack/unpack time of one mask row a step along grammar_bench's walk of each schema."""
    tokenizer = grammar_tokenizer(hf, vocab)
    texts = [hf.decode([i]) for i in range(len(hf))]
    eos = tokenizer.eos_token_ids[0]
    schemas = {}
    for name, schema in grammar_bench.SCHEMAS.items():
        constraint = constraint_from_request(guided_json=schema)
        assert constraint is not None
        grammar, rng = SessionGrammar(constraint, tokenizer), np.random.default_rng(0)
        sizes, pack_s, unpack_s, bitset_s = [], [], [], []
        for step in range(steps):
            masks, _ = grammar.window_masks([])
            row = np.ascontiguousarray(masks[:1].numpy())
            pack_token_masks(row, vocab)  # both forms timed warm: the first touch of a fresh mask is a cache miss
            for form in (step % 2, 1 - step % 2):  # which goes first alternates
                if form:
                    t0 = time.perf_counter()
                    frame = pack_token_masks(row, vocab)
                    t1 = time.perf_counter()
                    unpack_token_masks(frame, vocab)
                    pack_s.append(t1 - t0)
                    unpack_s.append(time.perf_counter() - t1)
                else:  # the bitset frame as the packer made it before (header and words), and its unpacking
                    t2 = time.perf_counter()
                    unpack_token_masks(struct.pack("<II", 1, vocab) + row.astype("<i4").tobytes(), vocab)
                    bitset_s.append(time.perf_counter() - t2)
            sizes.append(len(frame) - 8)
            token = grammar_bench.pick(rng, allowed_tokens(masks[0]), texts, eos, step)
            grammar.commit([token])
            if token == eos:
                grammar = SessionGrammar(constraint, tokenizer)
        schemas[name] = {"bytes_per_row": round(statistics.fmean(sizes)), "compact_rows": round(
                             sum(s < 4 * mask_words(vocab) for s in sizes) / steps, 2),
                         "pack_us_p50": round(statistics.median(pack_s) * 1e6, 1),
                         "unpack_us_p50": round(statistics.median(unpack_s) * 1e6, 1),
                         "pack_and_unpack_us_p50": round(statistics.median(
                             a + b for a, b in zip(pack_s, unpack_s, strict=True)) * 1e6, 1),
                         "as_bitsets_pack_and_unpack_us_p50": round(statistics.median(bitset_s) * 1e6, 1)}
    return {"tokenizer": label, "vocab_size": vocab, "bitset_bytes_per_row": 4 * mask_words(vocab),
            "rows": steps, "schemas": schemas}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--mask-vocab", type=int, default=0, help="also walk a BPE of this size trained here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    by_vocab = []
    for vocab in VOCABS:
        sparse_max = frame(vocab, codec.encode_draft_q(flat_rows(vocab))).ByteSize()
        dense = dense_frame_bytes(vocab)
        by_vocab.append({"vocab_size": vocab, "drafts": K, "verify_frame_bytes_dense": dense,
                         "verify_frame_bytes_sparse_at_most": sparse_max,
                         "ratio": round(dense / sparse_max, 1), "host": host_ms(vocab)})
        print(json.dumps(by_vocab[-1]))
    p, q = real_distributions()
    bundled = {"models": [DEFAULT_MODEL, DRAFT_MODEL], "temperature": TEMPERATURE, **acceptance(p, q)}
    bundled["verify_frame_bytes_dense"] = dense_frame_bytes(q.shape[-1])
    print(json.dumps(bundled))
    masks = [mask_rows("bundled", AutoTokenizer.from_pretrained(str(bundled_path(DEFAULT_MODEL))), 4096)]
    if args.mask_vocab:
        hf = grammar_bench.trained_tokenizer(args.mask_vocab)
        masks.append(mask_rows(f"byte-level BPE trained on this Python's sources, {len(hf)} tokens", hf, len(hf)))
    print(json.dumps(masks))
    result = {
        "what": "bytes per hop of a sampled VERIFY frame's draft distributions, dense (before) and sparse "
                "(Frame.draft_q, after); acceptance of the rows the draft now sends, on the bundled models; "
                "token mask rows as bitsets (before) and packed now (rows of few allowed or forbidden ids as lists)",
        "command": "PYTHONPATH=src python tools/draft_wire_bench.py docs/benchmarks/draft-wire-bytes.json "
                   "--mask-vocab 150000",
        "max_draft_tokens": MAX_DRAFT_TOKENS, "draft_tail_mass": DRAFT_TAIL_MASS,
        "context_tokens": CONTEXT, "python": platform.python_version(), "torch": torch.__version__,
        "note": "bytes are exact (protobuf ByteSize); host times are medians on a shared 2-core machine, one "
                "thread, indicative only; the dense form's host time goes through a bytes field of its size",
        "by_vocab": by_vocab, "bundled": bundled, "token_masks": masks,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
