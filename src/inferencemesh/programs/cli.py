"""The `inferencemesh` command: one entry point for every program the project runs.

    inferencemesh serve      local mesh: N stage processes + the frontend on loopback
    inferencemesh stage      one stage server (what a stage pod runs)
    inferencemesh frontend   the OpenAI-compatible frontend (what the frontend pod runs)
    inferencemesh plan       print the memory-planned layer ranges
    inferencemesh bench      throughput / latency benchmarks, JSON out
    inferencemesh operator   the Kubernetes operator (kopf)

The flags of serve, stage and frontend come from their config types (config.py), which also
render them for child processes and pods.
"""

from __future__ import annotations

import argparse
import sys

from inferencemesh.checkpoint import CheckpointError
from inferencemesh.config import (
    DEFAULT_SPECULATIVE_DISABLE_BY_BATCH_SIZE,
    ConfigError,
    FrontendConfig,
    ModelOptions,
    OperatorConfig,
    RuntimeOptions,
    ServeConfig,
    SpeculativeOptions,
    StageConfig,
    add_arguments,
    from_args,
)
from inferencemesh.planner import PlanError
from inferencemesh.programs.process import check_ports, exit_on_stop_signals, relay_hangup_as_terminate, watch_lifeline

PROGRAMS = {"serve": ServeConfig, "stage": StageConfig, "frontend": FrontendConfig, "operator": OperatorConfig}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferencemesh", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    add_arguments(ServeConfig, sub.add_parser(
        "serve", help="run a whole mesh locally: stages + frontend on loopback"))
    add_arguments(StageConfig, sub.add_parser(
        "stage", help="serve one layer range over gRPC (the stage pod's program)"))
    add_arguments(FrontendConfig, sub.add_parser(
        "frontend", help="the OpenAI-compatible endpoint (the frontend pod's program)"))

    plan = sub.add_parser("plan", help="print the memory-planned layer ranges")
    add_arguments(ModelOptions, plan)
    add_arguments(RuntimeOptions, plan)
    plan.add_argument("--stages", default="2", help="a number, or auto (needs --stage-memory)")
    plan.add_argument("--stage-memory", default=None, help="per-stage memory, e.g. 16GiB,24GiB (one for all)")
    plan.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"],
                      help="where the stages run (a CPU stage keeps its KV cache in float32)")
    plan.add_argument("--embed-first-stage", action="store_true",
                      help="plan for a frontend that holds the first stage (serve's default; spec.frontend."
                           "embedFirstStage): stage 0's memory then holds the frontend's draft model too")
    add_arguments(SpeculativeOptions, plan)  # which draft the frontend loads, for --embed-first-stage
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")

    bench = sub.add_parser("bench", help="benchmarks: tokens/s, TPOT, TTFT, per-hop overhead; JSON out")
    add_arguments(ModelOptions, bench)
    bench.add_argument("--shape", default=None, help="random-weight model of a preset shape (e.g. llama-150m)")
    bench.add_argument("--stages", default="1,2,4")
    bench.add_argument("--speculative", default="none", help="comma-separated: none,ngram,draft,auto")
    bench.add_argument("--prompts", default="code", help="comma-separated prompt sets: code,prose")
    bench.add_argument("--new-tokens", type=int, default=64)
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--concurrency", default=None,
                       help="comma-separated stream counts (e.g. 1,8,32): bursts of concurrent streams per stage "
                            "count, aggregate tok/s, TTFT and ITL percentiles, and the hf-generate-batch peer")
    bench.add_argument("--attention", default="auto",
                       help="with --concurrency, comma-separated batched attention forms of the stages to compare: "
                            "auto,per-session,padded")
    bench.add_argument("--stage-threads", default="default",
                       help="with --concurrency, comma-separated OpenMP threads of the stage processes to compare "
                            "(default: as serve starts them, each its share of the cores), e.g. default,1")
    bench.add_argument("--first-stage", default="embedded",
                       help="comma-separated: where a mesh's first stage runs, embedded (in the frontend, here the "
                            "bench process: serve's default) and/or process (a stage process of its own)")
    bench.add_argument("--speculative-disable-by-batch-size", type=int,
                       default=DEFAULT_SPECULATIVE_DISABLE_BY_BATCH_SIZE,
                       help="with --concurrency, no speculation while this many streams run, as the frontend "
                            "(0: always speculate)")
    bench.add_argument("--json", dest="json_out", default=None, help="write the results here")

    add_arguments(OperatorConfig, sub.add_parser("operator", help="run the Kubernetes operator"))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    watch_lifeline()  # started by serve or bench: die with that parent
    try:
        return _run(args)
    except (ConfigError, CheckpointError, PlanError) as err:  # a user's mistake (a taken port too): one line
        parser.exit(2, f"inferencemesh {args.command}: error: {err}\n")
    except KeyboardInterrupt:  # Ctrl-C while a program had no handler of its own (plan, bench)
        return 130


def _run(args: argparse.Namespace) -> int:
    # Imports are per command: `inferencemesh plan` must not pay for torch's start-up.
    if args.command in PROGRAMS:
        config = from_args(PROGRAMS[args.command], args)
        check_ports(config.ports())  # before anything loads: a taken port is one line, not minutes later
        if args.command == "serve":
            from inferencemesh.programs.serve import run_serve

            return run_serve(config)
        if args.command == "stage":
            from inferencemesh.programs.stage import run_stage

            return run_stage(config)
        if args.command == "operator":
            from inferencemesh.programs.operator import run_operator

            return run_operator(config)
        from inferencemesh.programs.frontend import run_frontend

        relay_hangup_as_terminate()  # uvicorn handles SIGTERM (and SIGINT) itself, SIGHUP not
        return run_frontend(config)
    if args.command == "plan":
        from inferencemesh.programs.plan import run_plan

        return run_plan(args)
    if args.command == "bench":
        from inferencemesh.programs.bench import run_bench

        exit_on_stop_signals()  # its meshes' `finally` stops their stage processes
        return run_bench(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
