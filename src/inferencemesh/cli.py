"""The `inferencemesh` command: one entry point for every program the project runs.

    inferencemesh serve      local mesh: N stage processes + the frontend on loopback
    inferencemesh stage      one stage server (what a stage pod runs)
    inferencemesh frontend   the OpenAI-compatible frontend (what the frontend pod runs)
    inferencemesh plan       print the memory-planned layer ranges
    inferencemesh bench      throughput / latency benchmarks, JSON out
    inferencemesh operator   the Kubernetes operator (kopf)
"""

from __future__ import annotations

import argparse
import sys

DTYPES = ["auto", "float32", "float16", "bfloat16"]
WIRE_DTYPES = ["float32", "float16", "bfloat16"]
SPECULATIVE = ["auto", "draft", "ngram", "none"]
# The frontend's torch threads (its only tensor work is the draft model). One: a small draft's
# ops gain nothing from a second thread, and an OpenMP team's idle workers spin on a core that
# a CPU stage next to the frontend needs (measured on 2 cores, bundled models, 2 stages: the
# first stage's VERIFY frames took 12.5 ms with 2 frontend threads, 4.7 ms with 1).
DRAFT_THREADS = 1
# Most tokens one stage forward pass takes from waiting DECODE/VERIFY frames of different sessions.
MAX_BATCH_TOKENS = 256


def _add_model_args(p: argparse.ArgumentParser, *, required: bool) -> None:
    p.add_argument("--model", required=required, default=None,
                   help="local model directory or hub id (default: the bundled code model)")
    p.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="compute dtype (auto: the checkpoint's)")
    p.add_argument("--cache-dir", default=None, help="where hub downloads go (HF_HUB_CACHE by default)")


def _add_runtime_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-context", type=int, default=2048, help="longest session (prompt + output) in tokens")
    p.add_argument("--max-sessions", type=int, default=16, help="concurrent sessions a stage holds")
    p.add_argument("--wire-dtype", choices=WIRE_DTYPES, default=None,
                   help="dtype of activations between stages (default: the compute dtype)")
    p.add_argument("--debug-telemetry", action="store_true", help="per-token timings and debug attributes")
    p.add_argument("--tls-dir", default=None,
                   help="mutual TLS between frontend and stages: a directory with tls.crt, tls.key, ca.crt")


def _add_batching_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-batch-tokens", type=int, default=MAX_BATCH_TOKENS,
                   help="most tokens of waiting DECODE/VERIFY frames (of different sessions) a stage runs in one pass")


def _add_speculative_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", choices=SPECULATIVE, default=None,
                   help="speculation strategy (default: the model package's, else auto)")
    p.add_argument("--draft", default=None, help="draft model directory or hub id (implies --speculative draft)")
    p.add_argument("--no-draft", action="store_true", help="ignore a draft declared by the model package")
    p.add_argument("--window", default=None,
                   help="speculation window: a number (fixed) or adaptive:INITIAL:MIN:MAX")
    p.add_argument("--draft-threads", type=int, default=DRAFT_THREADS,
                   help="CPU threads of the frontend process, which runs the draft model")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferencemesh", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run a whole mesh locally: stages + frontend on loopback")
    _add_model_args(serve, required=False)
    _add_runtime_args(serve)
    _add_speculative_args(serve)
    _add_batching_args(serve)
    serve.add_argument("--stages", type=int, default=2, help="number of stage processes")
    serve.add_argument("--stage-memory", default=None, help="per-stage memory budgets, e.g. 16GiB,24GiB")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="the OpenAI endpoint's port")
    serve.add_argument("--base-stage-port", type=int, default=0, help="first stage gRPC port (0: pick free ports)")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])

    stage = sub.add_parser("stage", help="serve one layer range over gRPC (the stage pod's program)")
    _add_model_args(stage, required=True)
    _add_runtime_args(stage)
    _add_batching_args(stage)
    stage.add_argument("--layers", required=True, help="START:END, end exclusive (e.g. 0:16)")
    stage.add_argument("--stage-index", type=int, required=True)
    stage.add_argument("--num-stages", type=int, required=True)
    stage.add_argument("--host", default="0.0.0.0")
    stage.add_argument("--port", type=int, default=50051, help="gRPC port (stage service + grpc.health.v1)")
    stage.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port (0: off)")
    stage.add_argument("--downstream", default=None, help="HOST:PORT of the next stage (absent on the last stage)")
    stage.add_argument("--session-ttl", type=float, default=300.0, help="seconds before an idle session is dropped")
    stage.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])

    frontend = sub.add_parser("frontend", help="the OpenAI-compatible endpoint (the frontend pod's program)")
    _add_model_args(frontend, required=True)
    _add_runtime_args(frontend)
    _add_speculative_args(frontend)
    frontend.add_argument("--stage-addresses", required=True,
                          help="comma-separated HOST:PORT of every stage, in pipeline order")
    frontend.add_argument("--host", default="0.0.0.0")
    frontend.add_argument("--port", type=int, default=8000)
    frontend.add_argument("--served-model-name", default=None)
    frontend.add_argument("--api-key-env", default="INFERENCEMESH_API_KEY",
                          help="environment variable holding the API key (unset or empty: no auth)")
    frontend.add_argument("--max-body-bytes", type=int, default=1024 * 1024)
    frontend.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                          help="where the draft model runs")

    plan = sub.add_parser("plan", help="print the memory-planned layer ranges")
    _add_model_args(plan, required=False)
    _add_runtime_args(plan)
    plan.add_argument("--stages", default="2", help="a number, or auto (needs --stage-memory)")
    plan.add_argument("--stage-memory", default=None, help="per-stage memory, e.g. 16GiB,24GiB (one for all)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")

    bench = sub.add_parser("bench", help="benchmarks: tokens/s, TPOT, TTFT, per-hop overhead; JSON out")
    _add_model_args(bench, required=False)
    bench.add_argument("--shape", default=None, help="random-weight model of a preset shape (e.g. llama-150m)")
    bench.add_argument("--stages", default="1,2,4")
    bench.add_argument("--speculative", default="none", help="comma-separated: none,ngram,draft,auto")
    bench.add_argument("--prompts", default="code", help="comma-separated prompt sets: code,prose")
    bench.add_argument("--new-tokens", type=int, default=64)
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--json", dest="json_out", default=None, help="write the results here")

    op = sub.add_parser("operator", help="run the Kubernetes operator")
    op.add_argument("--namespace", action="append", default=None, help="watch only these namespaces")
    op.add_argument("--standalone", action="store_true", help="no peering (single replica)")
    op.add_argument("--liveness", default="http://0.0.0.0:8080/healthz")
    op.add_argument("--metrics-port", type=int, default=9090)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Imports are per command: `inferencemesh plan` must not pay for torch's start-up.
    if args.command == "serve":
        from inferencemesh.launcher import run_serve

        return run_serve(args)
    if args.command == "stage":
        from inferencemesh.stage.server import run_stage

        return run_stage(args)
    if args.command == "frontend":
        from inferencemesh.frontend.main import run_frontend

        return run_frontend(args)
    if args.command == "plan":
        from inferencemesh.plan_command import run_plan

        return run_plan(args)
    if args.command == "bench":
        from inferencemesh.bench import run_bench

        return run_bench(args)
    if args.command == "operator":
        from inferencemesh.operator.main import run_operator

        return run_operator(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
