"""The `inferencemesh` command: one entry point for every program the project runs.

    inferencemesh serve      local mesh: N stage processes + the frontend on loopback
    inferencemesh stage      one stage server (what a stage pod runs)
    inferencemesh frontend   the OpenAI-compatible frontend (what the frontend pod runs)
    inferencemesh plan       print the memory-planned layer ranges
    inferencemesh bench      throughput / latency benchmarks, JSON out
    inferencemesh operator   the Kubernetes operator (kopf)
    inferencemesh router     one endpoint over N replicas' frontends, prefix-aware

Every command's flags come from its config type (config.py), which also renders them for
child processes and pods.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from typing import Any, NoReturn

from inferencemesh.checkpoint.errors import CheckpointError
from inferencemesh.config import (
    API_KEY_ENV,
    FrontendConfig,
    OperatorConfig,
    PlanConfig,
    RouterConfig,
    ServeConfig,
    StageConfig,
)
from inferencemesh.flags import ConfigError, add_arguments, from_args
from inferencemesh.planner import PlanError
from inferencemesh.programs.bench.config import BenchConfig
from inferencemesh.programs.process import (
    LoadFailed,
    check_ports,
    exit_on_stop_signals,
    prepare_process,
    relay_hangup_as_terminate,
    set_up_process,
    write_termination_message,
)

# Each command, its config type and its one-line help.
PROGRAMS: dict[str, tuple[type, str]] = {
    "serve": (ServeConfig, "run a whole mesh locally: stages + frontend on loopback"),
    "stage": (StageConfig, "serve one layer range over gRPC (the stage pod's program)"),
    "frontend": (FrontendConfig, "the OpenAI-compatible endpoint (the frontend pod's program)"),
    "plan": (PlanConfig, "print the memory-planned layer ranges"),
    "bench": (BenchConfig, "benchmarks: tokens/s, TPOT, TTFT, per-hop overhead; JSON out"),
    "operator": (OperatorConfig, "run the Kubernetes operator"),
    "router": (RouterConfig, "one endpoint over N replicas' frontends, each request to the replica likeliest "
                             "to hold its prefix"),
}


# What a command's --help says after its options.
EPILOGS = {
    "serve": f"The API key: unless --api-key-env names another variable, `{API_KEY_ENV}=KEY inferencemesh serve` "
             "makes every request but /health, /ready and /metrics need 'Authorization: Bearer KEY' (the OpenAI "
             "clients' api_key); without it the endpoint is open to whoever reaches --host:--port.",
}


class Parser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' too), whose exits on an error (a bad flag, and main's
    one-line errors) also leave their line in the termination message (a pod's status)."""

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if status and message:
            write_termination_message(message)
        super().exit(status, message)


class DefaultsShown(argparse.HelpFormatter):
    """Each option's help ends with its default, as the program would run without the flag
    (unless the help already says what its absence means: "(default: ..." or "(0: ...")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or action.required or default is argparse.SUPPRESS
                or isinstance(action, argparse._HelpAction) or "(default" in text):
            return text
        if isinstance(default, bool):
            shown = "on" if default else "off"
        elif default is None or default == ():
            shown = "unset"
        elif isinstance(default, tuple):
            shown = ",".join(str(item) for item in default)
        else:
            shown = str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="inferencemesh", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command, (config_type, help_text) in PROGRAMS.items():
        add_arguments(config_type, sub.add_parser(command, help=help_text, description=help_text,
                                                  epilog=EPILOGS.get(command), formatter_class=DefaultsShown))
    sub.add_parser("models", help="list the model families and quantized formats served (from "
                                  "modeling/families.py)")
    return parser


def print_models() -> int:
    """The families served and the per-family hooks, from the one table (modeling/families.py)."""
    from inferencemesh.modeling import families

    table = families.family_table()
    served = sorted(name for name, why in table["refusals"].items() if why is None)
    refused = len(table["refusals"]) - len(served)
    print("Verified exact at 1, 2 and 3 stages, as target and as draft (tests/test_families.py):")
    print(textwrap.fill(", ".join(families.VERIFIED), 100, initial_indent="  ", subsequent_indent="  "))
    print(f"Pass the family check, served by the same general path (transformers {table['transformers']}'s "
          "causal-LM families with the standard layout; a checkpoint's tensor names are checked too):")
    print(textwrap.fill(", ".join(served), 100, initial_indent="  ", subsequent_indent="  "))
    print("Decided from a checkpoint's own config (their default configs build no model):")
    print(textwrap.fill(", ".join(table["undecided"]), 100, initial_indent="  ", subsequent_indent="  "))
    print(f"The other {refused} are refused with the reason by `inferencemesh plan --model M` (and serve, the "
          "stages, the operator). docs/families.md has the survey of every family.")
    print("Per-family differences:")
    for hook in families.HOOKS:
        print(f"  {hook.name:<24} {hook.example:<30} {hook.what} [{hook.where}]")
    print("Quantized weights, kept quantized in every stage and planned by their bytes (the dense linear "
          "layers of any family above; checked on Llama):")
    for name, weights in families.QUANTIZED_FORMATS:
        print(textwrap.fill(weights, 100, initial_indent=f"  {name:<36} ", subsequent_indent=" " * 39))
    print(f"Refused at plan with what to give instead: {', '.join(not_served())}; MoE experts "
          "quantized other than MXFP4, quantized embeddings, activation and KV cache quantization.")
    return 0


def not_served() -> list[str]:
    """The quantized formats refused by name (checkpoint/quantization.py's own list)."""
    from inferencemesh.checkpoint.quantization import _NOT_SERVED

    return list(dict.fromkeys(_NOT_SERVED.values()))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "models":
        return print_models()
    prepare_process(args.command)  # before torch loads; started by serve or bench: die with that parent
    try:
        return _run(args)
    except (ConfigError, CheckpointError, PlanError) as err:  # a user's mistake (a taken port too): one line
        parser.exit(2, f"inferencemesh {args.command}: error: {err}\n")
    except LoadFailed as err:  # its model could not be loaded: one line, and an exit a supervisor sees at once
        message = f"inferencemesh {args.command}: error: {err}\n"
        write_termination_message(message)
        sys.stderr.write(message)
        sys.stderr.flush()
        sys.stdout.flush()
        # Without the interpreter's teardown: with gRPC's threads still winding down it can abort
        # (SIGABRT, "terminate called without an active exception", seen once in CI), and the exit
        # code is what the supervisor reads.
        os._exit(1)
    except KeyboardInterrupt:  # Ctrl-C while a program had no handler of its own (plan, bench)
        return 130
    except Exception as err:  # a bug: the traceback on stderr, its one-line summary in the termination message
        write_termination_message(f"inferencemesh {args.command}: unexpected error: {type(err).__name__}: {err}")
        raise


def _run(args: argparse.Namespace) -> int:
    config: Any = from_args(PROGRAMS[args.command][0], args)  # the command's own config type
    ports = getattr(config, "ports", None)
    if ports is not None:
        check_ports(ports())  # before anything loads: a taken port is one line, not minutes later
    set_up_process(args.command, threads=_torch_threads(args.command, config),
                   debug=getattr(config, "debug_telemetry", False))
    # Imports are per command: `inferencemesh plan` must not pay for torch's start-up.
    if args.command == "serve":
        from inferencemesh.programs.serve import run_serve

        return run_serve(config)
    if args.command == "stage":
        from inferencemesh.programs.stage import run_stage

        return run_stage(config)
    if args.command == "frontend":
        from inferencemesh.programs.frontend import run_frontend

        relay_hangup_as_terminate()  # uvicorn handles SIGTERM (and SIGINT) itself, SIGHUP not
        return run_frontend(config)
    if args.command == "plan":
        from inferencemesh.programs.plan import run_plan

        return run_plan(config)
    if args.command == "bench":
        from inferencemesh.programs.bench.run import run_bench

        exit_on_stop_signals()  # its meshes' `finally` stops their stage processes
        return run_bench(config)
    if args.command == "operator":
        from inferencemesh.programs.operator import run_operator

        return run_operator(config)
    if args.command == "router":
        from inferencemesh.programs.router import run_router

        relay_hangup_as_terminate()  # uvicorn handles SIGTERM (and SIGINT) itself, SIGHUP not
        return run_router(config)
    raise AssertionError(args.command)


def _torch_threads(command: str, config: Any) -> int | None:
    """The torch threads of a program that computes: a stage's from its config, the frontend's
    from its embedded stage or draft; None leaves torch's own (bench sets its per configuration)."""
    if command == "stage":
        from inferencemesh.cpus import compute_threads

        return compute_threads(config.threads, config.device)
    if command == "frontend":
        from inferencemesh.programs.frontend import compute_threads_of

        return compute_threads_of(config)
    return None


if __name__ == "__main__":
    sys.exit(main())
