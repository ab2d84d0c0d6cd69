"""The config types: every field survives config -> argv -> the real CLI parser -> config, and
the operator's pod arguments and `serve`'s child processes parse back to what they meant."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from inferencemesh import config as cfg
from inferencemesh.config import (
    DEFAULT_KV_CONTEXTS,
    FrontendConfig,
    OperatorConfig,
    PlanConfig,
    ServeConfig,
    StageConfig,
    kv_pool_tokens,
)
from inferencemesh.flags import ConfigError, derive, from_args, to_argv
from inferencemesh.programs.bench import config as bench_cfg
from inferencemesh.programs.bench.config import BenchConfig
from inferencemesh.programs.cli import build_parser
from inferencemesh.programs.local_stages import frontend_config, stage_template

PROGRAMS = {"serve": ServeConfig, "stage": StageConfig, "frontend": FrontendConfig, "operator": OperatorConfig,
            "plan": PlanConfig, "bench": BenchConfig}


def parse(command: str, argv: list[str]):
    return from_args(PROGRAMS[command], build_parser().parse_args([command, *argv]))


def off_default(f: dataclasses.Field, cls: type):
    """A valid value for field `f` that differs from its default, derived from its declaration."""
    flag = f.metadata["flag"]
    hint = typing.get_type_hints(cls)[f.name]
    if flag.switch:
        return not f.default
    if flag.listed:  # a comma-separated tuple: two items, not the default
        if flag.choices:
            return tuple(c for c in flag.choices if c not in (f.default or ()))[:2]
        if f.name == "stage_threads":
            return ("default", "1")
        return (2, 3)
    if flag.choices:
        return next(c for c in reversed(flag.choices) if c != f.default)
    if f.name in ("layers", "first_stage_layers"):
        return (3, 7)
    if f.name == "namespace":
        return ("team-a", "team-b")
    if f.name == "stages" and cls is PlanConfig:
        return "auto"
    if f.name == "stage_addresses":
        return ("a.ns.svc:50051", "b.ns.svc:50051")
    if hint == tuple[str, ...]:  # another comma-separated list of names
        return (f"{f.name}-a", f"{f.name}-b")
    if hint in (int, int | None):
        return (f.default if isinstance(f.default, int) else 0) + 3
    if hint is float:
        return f.default + 1.5
    return f"value-of-{f.name}"


# Fields that contradict each other off their defaults (each pair's refusal has a test): the
# all-off-default config keeps the first at its default, and it gets a round trip of its own with
# the second back at its default.
CONFLICTS = {"multi_turn": "structured"}  # test_the_benches_are_one_at_a_time


def non_default_config(cls: type):
    values = {f.name: off_default(f, cls) for f in dataclasses.fields(cls)}
    if cls is StageConfig:
        values.update(stage_index=1, num_stages=values["num_stages"] + 2)
    for first, second in CONFLICTS.items():
        if first in values and second in values:
            values[first] = cls.__dataclass_fields__[first].default
    return cls(**values)


@pytest.mark.parametrize("command", sorted(PROGRAMS))
def test_every_field_round_trips_through_the_cli(command: str) -> None:
    config = non_default_config(PROGRAMS[command])
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    unchanged = {name for name, value in dataclasses.asdict(config).items() if value == defaults[name]}
    assert unchanged <= set(CONFLICTS), "every field must differ from its default, or the test proves nothing"
    assert parse(command, to_argv(config)) == config
    for first in unchanged:
        second = CONFLICTS[first]
        switched = dataclasses.replace(config, **{first: off_default(config.__dataclass_fields__[first], type(config)),
                                                  second: defaults[second]})
        assert parse(command, to_argv(switched)) == switched


def test_the_benches_are_one_at_a_time() -> None:
    with pytest.raises(ConfigError, match="separate benchmarks"):
        parse("bench", ["--multi-turn", "--structured"])


@pytest.mark.parametrize("command", ["frontend", "serve", "stage"])
def test_the_kv_pool_is_sized_once_for_every_program(command: str) -> None:
    """--kv-cache-tokens reaches each program's config, and kv_pool_tokens gives the pool every
    side of a stream uses (the stage allocates it, the frontend gives it out, the plan sizes it)."""
    args = {"frontend": ["--model", "m", "--stage-addresses", "h:1"], "serve": ["--model", "m"],
            "stage": ["--model", "m", "--layers", "0:1", "--stage-index", "0", "--num-stages", "1"]}[command]
    config = parse(command, [*args, "--kv-cache-tokens", "4096", "--max-context", "512"])
    assert kv_pool_tokens(config.kv_cache_tokens, config.max_context) == 4096
    default = parse(command, [*args, "--max-context", "512"])
    assert kv_pool_tokens(default.kv_cache_tokens, default.max_context) == DEFAULT_KV_CONTEXTS * 512
    with pytest.raises(ConfigError, match="--kv-cache-tokens must be 0 or more"):
        parse(command, [*args, "--kv-cache-tokens", "-1"])


@pytest.mark.parametrize("command", sorted(PROGRAMS))
def test_defaults_round_trip_and_agree_with_the_parser(command: str) -> None:
    cls = PROGRAMS[command]
    required = {"model": "m", "layers": (0, 2), "stage_index": 0, "num_stages": 1, "stage_addresses": ("h:1",)}
    config = cls(**{k: v for k, v in required.items() if k in cls.__dataclass_fields__})
    assert parse(command, to_argv(config)) == config


def test_one_default_per_setting() -> None:
    """The values that drifted apart once (max_sessions, the batch-token budget) live in config.py."""
    import inspect

    from inferencemesh import planner
    from inferencemesh.frontend.engine.pipeline import GrpcPipeline

    assert StageConfig.__dataclass_fields__["max_sessions"].default == cfg.DEFAULT_MAX_SESSIONS
    assert ServeConfig.__dataclass_fields__["max_batch_tokens"].default == cfg.DEFAULT_MAX_BATCH_TOKENS
    assert inspect.signature(GrpcPipeline).parameters["max_batch_tokens"].default == cfg.DEFAULT_MAX_BATCH_TOKENS
    planner_default = inspect.signature(planner.PlanInputs.from_checkpoint).parameters["kv_tokens"].default
    assert planner_default == kv_pool_tokens(0, cfg.DEFAULT_MAX_CONTEXT)


def test_serve_derives_its_children_from_its_own_config() -> None:
    from inferencemesh.planner import StagePlan
    from inferencemesh.programs.local_stages import LocalStages

    serve = parse("serve", ["--max-context", "900", "--max-sessions", "5", "--dtype", "float32",
                            "--speculative", "ngram", "--window", "3", "--max-batch-tokens", "64", "--port", "8123"])
    plan = [StagePlan(0, 0, 3, 0, 0, 0, None), StagePlan(1, 3, 8, 0, 0, 0, None)]
    stages = LocalStages(stage_template("/m", serve), plan)
    for i, process in enumerate(stages.processes):
        child = parse("stage", process.argv[process.argv.index("stage") + 1:])
        assert child == stages.configs[i]
        assert (child.max_context, child.max_sessions, child.dtype) == (900, 5, "float32")
        assert child.layers == (plan[i].layer_start, plan[i].layer_end) and child.stage_index == i
    assert stages.configs[0].downstream == stages.addresses[1] and stages.configs[1].downstream is None
    frontend = frontend_config(serve, "/m", stages)
    assert parse("frontend", to_argv(frontend)) == frontend
    assert (frontend.speculative, frontend.window, frontend.port, frontend.max_batch_tokens) == ("ngram", "3", 8123, 64)
    assert frontend.stage_addresses == tuple(stages.addresses) and frontend.first_stage_layers is None


def test_an_embedded_first_stage_is_the_frontends_and_the_processes_are_the_rest() -> None:
    """serve's default: stage 0 in the frontend. The processes are stages 1.., and the stage
    config the frontend derives for its embedded stage is the one a stage-0 process would get."""
    from inferencemesh.planner import StagePlan
    from inferencemesh.programs.local_stages import LocalStages

    serve = parse("serve", ["--max-context", "900", "--dtype", "float32", "--max-batch-tokens", "64"])
    assert serve.embed_first_stage and not parse("serve", ["--no-embed-first-stage"]).embed_first_stage
    plan = [StagePlan(0, 0, 3, 0, 0, 0, None), StagePlan(1, 3, 5, 0, 0, 0, None), StagePlan(2, 5, 8, 0, 0, 0, None)]
    stages = LocalStages(stage_template("/m", serve, threads=2), plan, embed_first=True)
    assert [c.stage_index for c in stages.configs] == [1, 2] and len(stages.processes) == 2
    assert all(c.num_stages == 3 for c in stages.configs)
    frontend = frontend_config(serve, "/m", stages, threads=2)
    assert parse("frontend", to_argv(frontend)) == frontend
    assert frontend.first_stage_layers == (0, 3) and frontend.stage_addresses == tuple(stages.addresses)
    separate = LocalStages(stage_template("/m", serve, threads=2), plan)
    expected = dataclasses.replace(separate.configs[0], host="", port=0, metrics_port=0,
                                   downstream=stages.addresses[0])
    assert frontend.first_stage() == expected
    assert dataclasses.replace(frontend, first_stage_layers=None).first_stage() is None


def test_mistakes_are_one_line_errors(capsys) -> None:
    from inferencemesh.programs.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["stage", "--model", "m", "--layers", "4:2", "--stage-index", "0", "--num-stages", "1"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == "inferencemesh stage: error: --layers 4:2: need 0 <= START < END"
    with pytest.raises(ConfigError, match="needs --downstream"):
        StageConfig(model="m", layers=(0, 1), stage_index=0, num_stages=2).check()
    with pytest.raises(ConfigError, match="--threads sizes the embedded first stage"):
        FrontendConfig(model="m", stage_addresses=("h:1",), threads=2).check()
    with pytest.raises(ConfigError, match="names no stage"):
        FrontendConfig(model="m", stage_addresses=()).check()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["stage", "--model", "m", "--layers", "x", "--stage-index", "0",
                                   "--num-stages", "1"])


def test_the_crd_defaults_are_the_programs_defaults() -> None:
    """The CRD is the operator's source of truth; where it defaults a program setting, it agrees."""
    from pathlib import Path

    import yaml

    crd = yaml.safe_load((Path(__file__).parents[1] / "crds/inferencemesh.io_inferencemeshes.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert spec["contextLength"]["default"] == cfg.DEFAULT_MAX_CONTEXT
    assert spec["maxSessions"]["default"] == cfg.DEFAULT_MAX_SESSIONS
    assert spec["kvCacheTokens"]["default"] == cfg.StageConfig.__dataclass_fields__["kv_cache_tokens"].default == 0
    assert spec["prefixCache"]["default"] is cfg.FrontendConfig.__dataclass_fields__["prefix_cache"].default is True
    # frontend.maxBatchTokens has no schema default (the deprecated stages.maxBatchTokens must stay
    # visible when set); its text names the programs' default, which the typed spec applies.
    budget = spec["frontend"]["properties"]["maxBatchTokens"]
    assert "default" not in budget and f"(default {cfg.DEFAULT_MAX_BATCH_TOKENS})" in budget["description"]
    assert spec["frontend"]["properties"]["service"]["properties"]["port"]["default"] == cfg.FRONTEND_PORT


def test_every_process_names_the_model_as_clients_do() -> None:
    from inferencemesh.bundled import served_name

    assert served_name(None) == "imesh-code-target"
    assert served_name("bundled://imesh-code-draft") == "imesh-code-draft"
    assert served_name("/models/llama-3/") == "llama-3"
    assert served_name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert served_name("Qwen/Qwen2.5-0.5B-Instruct", "qwen") == "qwen"
    # serve hands the name to its stages: both sides' metrics carry the same label.
    serve = ServeConfig(served_model_name="coder")
    stage = derive(StageConfig, serve, layers=(0, 1), stage_index=0, num_stages=1, model="m")
    assert stage.served_model_name == "coder"


def test_comma_separated_flags_are_checked_item_by_item(capsys) -> None:
    """bench's lists are parsed where they are declared: a typo is a usage error before anything loads."""
    bench = parse("bench", ["--stages", "1,2", "--speculative", "none,ngram", "--concurrency", "1,8",
                            "--stage-threads", "default,1"])
    assert (bench.stages, bench.speculative, bench.concurrency, bench.stage_threads) == (
        (1, 2), ("none", "ngram"), (1, 8), ("default", "1"))
    for argv in (["--stages", "two"], ["--speculative", "none,magic"], ["--first-stage", "remote"],
                 ["--stage-threads", "0"]):
        with pytest.raises(SystemExit):
            parse("bench", argv)
    with pytest.raises(ConfigError, match="--stages counts must be at least 1"):
        parse("bench", ["--stages", "0,2"])


def test_the_bench_choices_are_what_the_bench_runs() -> None:
    from inferencemesh.programs.bench.mesh import FIRST_STAGE_LABELS
    from inferencemesh.programs.bench.models import PROMPTS

    assert tuple(PROMPTS) == bench_cfg.BENCH_PROMPT_SETS
    assert tuple(FIRST_STAGE_LABELS) == bench_cfg.FIRST_STAGE_FORMS
