"""Attention of a batched decode pass over the stage's KV pool (modeling/kv_pool.py), on a stage
runtime of a preset shape: each session's blocks consecutive (its keys and values a view of the
pool) against scattered (one gather of its slots per layer), what a fragmented pool costs.

    python tools/attention_bench.py --shape llama-150m --sessions 1,4,8,32 --lengths 16,64,256,1024

Two measures per (sessions N, context length L), forms interleaved rep by rep so a noisy
machine's drift falls on both alike:
- layer: the attention steps of a pass as the runtime runs them (each layer's new keys and values
  written into their blocks, the gather where the blocks are scattered, then attention for the N
  queries), per layer, in microseconds;
- pass: a whole forward_batch of N decode frames through every layer of the stage, in ms.
Sessions' lengths spread over [L/2, L] (a batch's sessions are rarely equally long).

Where the stage takes the native attention over block tables (a float32 pool on a CPU:
native_kernels.paged_attention), both measures are taken for it too (`_native` in the JSON, and
its ratio to sdpa over the same tables), interleaved with the rest:

    python tools/attention_bench.py --dtype float32 --sessions 1,8 --lengths 256,1024

--kernels compares the bare kernels instead, with no runtime around them: per-session sdpa
calls, one padded call (caches gathered per layer) and one block-diagonal "varlen" call (caches
concatenated, a mask keeping each query to its own session's block).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from inferencemesh.checkpoint.read import read_local
from inferencemesh.modeling.attention import stage_attention
from inferencemesh.modeling.kv_pool import BlockTableKV, KVPool, PagedFrames
from inferencemesh.modeling.native_kernels import paged_attention
from inferencemesh.modeling.runtime import Segment, StageRuntime, _PackedCache
from inferencemesh.programs.bench.models import make_shape_model
from inferencemesh.protocol.transport import KV_BLOCK_TOKENS

FORMS = ("view", "gather")  # each session's blocks consecutive, or scattered over the pool


def lengths_for(sessions: int, longest: int) -> list[int]:
    """Sessions' cache lengths spread evenly over [longest / 2, longest]."""
    low = max(1, longest // 2)
    return [longest - (i * (longest - low)) // max(1, sessions - 1) for i in range(sessions)]


def filled_pool(rt: StageRuntime, lengths: list[int]) -> tuple[KVPool, dict[str, list[list[int]]]]:
    """A pool holding random keys and values, and each session's block table per form: the same
    blocks, in order (view) or shuffled (gather)."""
    each = [-(-(n + 1) // KV_BLOCK_TOKENS) for n in lengths]  # room for the decoded token
    pool = rt.new_pool(sum(each))
    pool.store.normal_()
    order = torch.randperm(sum(each), generator=torch.Generator().manual_seed(0)).tolist()
    tables: dict[str, list[list[int]]] = {"view": [], "gather": []}
    first = 0
    for count in each:
        tables["view"].append(list(range(first, first + count)))
        tables["gather"].append(order[first : first + count])
        first += count
    return pool, tables


def segments_of(pool: KVPool, tables: list[list[int]], lengths: list[int], feed: list[torch.Tensor]) -> list[Segment]:
    return [Segment(BlockTableKV(pool, table, n, 1), n, x) for table, n, x in zip(tables, lengths, feed, strict=True)]


def time_layer(rt: StageRuntime, pool: KVPool, tables: list[list[int]], lengths: list[int], reps: int,
               native: bool = False) -> float:
    """Median microseconds per layer of a pass's attention steps over N decode queries (native: through
    the native attention over the block tables, else sdpa as stage_attention calls it)."""
    modules = [layer.self_attn for layer in rt._layers]
    n = len(tables)
    heads = rt.config.num_attention_heads
    q = torch.randn(1, heads, n, rt._head_dim, dtype=rt.dtype)
    k_new = torch.randn(1, rt._kv_heads, n, rt._head_dim, dtype=rt.dtype)
    v_new = torch.randn_like(k_new)
    samples = []
    for _ in range(reps):
        started = time.perf_counter_ns()
        segments = segments_of(pool, tables, lengths, [torch.zeros(1, dtype=torch.long)] * n)
        for seg in segments:
            seg.kv.begin(seg.pos_start, 1)
        if native:  # what a lean layer does with the pass's PagedFrames
            paged = PagedFrames.of([seg.kv for seg in segments])
            assert paged is not None
            for index, module in enumerate(modules, start=rt.layer_start):
                paged_attention(q.transpose(1, 2), k_new.transpose(1, 2), v_new.transpose(1, 2), paged.layer(index),
                                paged.pool.block_tokens, paged.tables, paged.frames, module.scaling)
        else:
            cache = _PackedCache(rt, segments, [1] * n)
            for index, module in enumerate(modules, start=rt.layer_start):
                key, value = cache.update(k_new, v_new, index)
                stage_attention(module, q, key, value, None, dropout=0.0, scaling=module.scaling)
        samples.append((time.perf_counter_ns() - started) / 1e3 / len(modules))
    return statistics.median(samples)


def time_pass(rt: StageRuntime, pool: KVPool, tables: list[list[int]], lengths: list[int], reps: int,
              native: bool = False) -> float:
    """Median milliseconds of a whole forward_batch of N decode frames (each at its session's length),
    the lean layers attending natively or through sdpa."""
    takes_native, rt._paged = rt._paged, native
    gen = torch.Generator().manual_seed(0)
    feed = [torch.randint(0, rt.vocab_size, (1,), generator=gen) if rt.is_first
            else torch.randn(1, rt.hidden_size, generator=gen) for _ in tables]
    samples = []
    for _ in range(reps):
        segments = segments_of(pool, tables, lengths, feed)
        started = time.perf_counter_ns()
        rt.forward_batch(segments)
        samples.append((time.perf_counter_ns() - started) / 1e6)
    rt._paged = takes_native
    return statistics.median(samples)


def kernel_forms(q: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """The three bare forms of decode attention for queries q [1, heads, N, d] over N caches."""
    import torch.nn.functional as F

    n, heads, head_dim = len(caches), q.shape[1], q.shape[3]
    lengths = [k.shape[2] for k, _ in caches]
    longest = max(lengths)
    key_mask = (torch.arange(longest)[None] < torch.tensor(lengths)[:, None])[:, None, None]
    owner = torch.repeat_interleave(torch.arange(n), torch.tensor(lengths))
    block_mask = (owner[None] == torch.arange(n)[:, None])[None, None]

    def per_session() -> torch.Tensor:
        return torch.cat([F.scaled_dot_product_attention(qi, k, v)
                          for qi, (k, v) in zip(q.split(1, dim=2), caches, strict=True)], dim=2)

    def padded() -> torch.Tensor:
        keys = torch.zeros(n, heads, longest, head_dim)
        values = torch.zeros(n, heads, longest, head_dim)
        for i, (k, v) in enumerate(caches):
            keys[i, :, : k.shape[2]] = k[0]
            values[i, :, : v.shape[2]] = v[0]
        out = F.scaled_dot_product_attention(q[0].transpose(0, 1)[:, :, None], keys, values, attn_mask=key_mask)
        return out[:, :, 0].transpose(0, 1)[None]

    def block_diagonal() -> torch.Tensor:
        keys = torch.cat([k for k, _ in caches], dim=2)
        values = torch.cat([v for _, v in caches], dim=2)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=block_mask)

    return {"per_session": per_session, "padded": padded, "block_diagonal": block_diagonal}


def time_kernels(sessions: list[int], lengths: list[int], heads: int, head_dim: int, reps: int) -> list[dict]:
    """Median microseconds of one layer's decode attention, one query per session, three ways."""
    rows = []
    print(f"{'N':>3} {'L':>5} | {'per-session':>11} {'padded':>8} {'block-diag':>10}  (us, bare kernels)")
    for n in sessions:
        for longest in lengths:
            caches = [(torch.randn(1, heads, m, head_dim), torch.randn(1, heads, m, head_dim))
                      for m in lengths_for(n, longest)]
            forms = kernel_forms(torch.randn(1, heads, n, head_dim), caches)
            want = forms["per_session"]()
            row = {"sessions": n, "longest": longest}
            for name, fn in forms.items():
                torch.testing.assert_close(fn(), want)  # the same attention, three ways
                samples = []
                for _ in range(reps):
                    started = time.perf_counter_ns()
                    fn()
                    samples.append((time.perf_counter_ns() - started) / 1e3)
                row[f"kernel_us_{name}"] = round(statistics.median(samples), 1)
            rows.append(row)
            print(f"{n:>3} {longest:>5} | {row['kernel_us_per_session']:>11.1f} {row['kernel_us_padded']:>8.1f} "
                  f"{row['kernel_us_block_diagonal']:>10.1f}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama-150m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--sessions", default="1,4,8,32")
    parser.add_argument("--lengths", default="16,64,256,1024")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a stage process's own)")
    parser.add_argument("--reps", type=int, default=30, help="samples per form and point (medians reported)")
    parser.add_argument("--no-pass", action="store_true", help="skip the whole-pass measure")
    parser.add_argument("--kernels", action="store_true", help="bare kernels: per-session, padded, block-diagonal")
    parser.add_argument("--json", dest="json_out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    model_dir = make_shape_model(args.shape, args.dtype)
    sessions = [int(s) for s in args.sessions.split(",")]
    lengths = [int(s) for s in args.lengths.split(",")]
    load = os.getloadavg()
    if args.kernels:
        config = read_local(model_dir)
        rows = time_kernels(sessions, lengths, int(config.config["num_attention_heads"]), config.head_dim,
                            max(args.reps, 30))
        report = {"shape": args.shape, "threads": args.threads, "torch": torch.__version__, "kernels": True,
                  "load_average_before": [round(x, 2) for x in load],
                  "load_average_after": [round(x, 2) for x in os.getloadavg()], "rows": rows}
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
        return
    rt = StageRuntime(model_dir, 0, read_local(model_dir).num_layers, dtype=args.dtype, max_context=max(lengths) + 8)
    print(f"attention bench: {args.shape} {args.dtype} ({len(rt._layers)} layers), {args.threads} thread(s), "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    print(f"{'N':>3} {'L':>5} | {'layer view':>12} {'layer gather':>12} {'ratio':>6} | "
          f"{'pass view':>11} {'pass gather':>11} {'ratio':>6}")
    rows = []
    native = rt._paged  # the stage takes the native attention: measured beside sdpa
    ways = [(form, False) for form in FORMS] + ([(form, True) for form in FORMS] if native else [])
    for n in sessions:
        for longest in lengths:
            spread = lengths_for(n, longest)
            pool, tables = filled_pool(rt, spread)
            layer: dict[tuple[str, bool], list[float]] = {way: [] for way in ways}
            whole: dict[tuple[str, bool], list[float]] = {way: [] for way in ways}
            for _ in range(3):  # rounds of every form, interleaved
                for form, natively in ways:
                    layer[form, natively].append(time_layer(rt, pool, tables[form], spread, args.reps, natively))
                    if not args.no_pass:
                        whole[form, natively].append(time_pass(rt, pool, tables[form], spread,
                                                               max(3, args.reps // 5), natively))
            row = {"sessions": n, "longest": longest,
                   **{f"layer_us_{f}{'_native' * m}": round(statistics.median(layer[f, m]), 1) for f, m in ways}}
            row["layer_ratio_gather"] = round(row["layer_us_gather"] / row["layer_us_view"], 3)
            if not args.no_pass:
                row.update({f"pass_ms_{f}{'_native' * m}": round(statistics.median(whole[f, m]), 2) for f, m in ways})
                row["pass_ratio_gather"] = round(row["pass_ms_gather"] / row["pass_ms_view"], 3)
            for f in FORMS if native else ():  # native ÷ sdpa over the same tables
                row[f"layer_ratio_native_{f}"] = round(row[f"layer_us_{f}_native"] / row[f"layer_us_{f}"], 3)
                if not args.no_pass:
                    row[f"pass_ratio_native_{f}"] = round(row[f"pass_ms_{f}_native"] / row[f"pass_ms_{f}"], 3)
            rows.append(row)
            print(f"{n:>3} {longest:>5} | {row['layer_us_view']:>10.1f}us {row['layer_us_gather']:>10.1f}us "
                  f"{row['layer_ratio_gather']:>6.2f} | " + (
                      f"{row['pass_ms_view']:>9.2f}ms {row['pass_ms_gather']:>9.2f}ms "
                      f"{row['pass_ratio_gather']:>6.2f}" if not args.no_pass else "") + (
                      f" | native: layer {row['layer_us_view_native']:.1f}us / {row['layer_us_gather_native']:.1f}us"
                      + (f", pass {row['pass_ms_view_native']:.2f}ms / {row['pass_ms_gather_native']:.2f}ms"
                         if not args.no_pass else "") if native else ""), flush=True)
    report = {"shape": args.shape, "dtype": args.dtype, "threads": args.threads, "torch": torch.__version__,
              "load_average_before": [round(x, 2) for x in load],
              "load_average_after": [round(x, 2) for x in os.getloadavg()], "rows": rows}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
