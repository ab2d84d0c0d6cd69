"""Test-wide settings, and the fast tier.

One compute thread for in-process models: stage processes started by tests use one thread too
(mesh_helpers.QUIET_THREADS); several processes share the CI machine's two cores, and
oversubscribed OpenMP threads spin.

The fast tier (`pytest --fast`, `bash tools/test.sh fast`) is FAST_TIER below, the one place
that says what it holds: the unit and in-process tests of the modules it names, never a test
marked `slow` or `k8s`. A test file not named there is in the full run only (which runs
everything): the fast tier stays fast by construction, and CI misses nothing. In the fast tier
a test that starts a process (a stage, `serve`, a control plane, any subprocess) fails with a
message saying so: such a test belongs to the full run, so leave it out (by `slow`, or by name
in FAST_TIER's exceptions).
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

TESTS = Path(__file__).resolve().parent
WHOLE: frozenset[str] = frozenset()  # a module with no test left out
# Test modules (paths under tests/) of the fast tier -> the tests of theirs left out of it, those
# that start processes: by name without parameters, or "[value]" for every test with a parameter
# of that value. Not named at all: modules whose tests mostly start processes (stages, serve,
# the CLI, control planes) or are all marked slow.
FAST_TIER: dict[str, frozenset[str]] = {
    "operator/test_frontend_probe.py": WHOLE,
    "operator/test_handlers.py": WHOLE,
    "operator/test_issuing.py": WHOLE,
    "operator/test_monitoring.py": frozenset({"test_dashboard_has_the_panels_and_valid_promql"}),
    "operator/test_pipelines.py": WHOLE,
    "operator/test_planning.py": frozenset({"test_the_layout_plan_prints_is_the_plan_of_the_checkpoint"}),
    "operator/test_reconcile.py": WHOLE,
    "operator/test_rollout_status.py": WHOLE,
    "operator/test_render.py": WHOLE,
    "operator/test_render_embedded.py": WHOLE,
    "operator/test_render_disruption.py": WHOLE,
    "operator/test_render_pipelines.py": WHOLE,
    "operator/test_spec.py": WHOLE,
    "operator/test_static.py": WHOLE,
    "operator/test_status.py": WHOLE,
    "operator/test_teardown.py": WHOLE,
    "test_batched_attention.py": WHOLE,
    "test_batching.py": WHOLE,
    "test_bench_concurrency.py": frozenset({"test_concurrency_bench_reports_every_configuration"}),
    "test_bench_llama_cpp.py": WHOLE,  # its real llama.cpp run is marked slow
    "test_bench_structured.py": frozenset({"test_structured_bench_reports_constrained_against_free"}),
    "test_block_table_kv.py": WHOLE,
    "test_bundled_models.py": frozenset({"test_both_models_load_offline_share_a_vocabulary_and_generate"}),
    "test_certificates.py": WHOLE,
    "test_chart_autoscaling.py": WHOLE,
    "test_chat_safety.py": WHOLE,
    "test_choice_text.py": WHOLE,
    "test_compute_dtype.py": frozenset({"test_a_stage_plan_and_serve_agree_on_a_bf16_checkpoint"}),
    "test_config.py": WHOLE,
    "test_connections.py": frozenset({"test_a_stream_on_a_stalled_stage_sends_keepalive_comments"}),
    "test_constrained_sampling.py": WHOLE,
    "test_constrained_speculation.py": WHOLE,
    "test_constraints.py": WHOLE,
    "test_cpus.py": WHOLE,
    "test_detokenize.py": WHOLE,
    "test_draft_isolation.py": frozenset({"test_a_poisoned_request_beside_innocent_ones_over_the_mesh"}),
    "test_draft_model.py": WHOLE,
    "test_draft_wire.py": WHOLE,
    "test_draft_vocab.py": frozenset({"test_a_draft_with_another_padding_verifies_sampled_windows_over_the_mesh"}),
    "test_families.py": frozenset({"test_the_models_command_lists_what_is_served"}),
    "test_frameworks.py": WHOLE,
    "test_frontend_api.py": WHOLE,
    "test_frontend_boundary.py": frozenset({"[mesh]"}),
    "test_frontend_metrics.py": frozenset({  # promtool
        "test_request_metrics_count_what_was_served", "test_speculative_metrics_and_separate_registries"}),
    "test_grammar.py": WHOLE,
    "test_hostile_checkpoints.py": frozenset({
        "test_a_stage_that_cannot_load_exits_at_once_with_its_reason",
        "test_plan_of_an_enormous_header_is_one_line_and_quick",
        "test_the_frontend_refuses_a_bad_tokenizer_in_one_line"}),
    "test_keepalive.py": WHOLE,
    "test_kv_blocks.py": WHOLE,
    "test_kv_blocks_bench.py": WHOLE,
    "test_layers.py": WHOLE,
    "test_lean_layers.py": WHOLE,
    "test_message_limit.py": WHOLE,
    "test_ngram.py": WHOLE,
    "test_no_unsafe_loading.py": WHOLE,
    "test_openai_errors.py": WHOLE,
    "test_openai_spec_copy.py": WHOLE,
    "test_planner.py": WHOLE,
    "test_protocol.py": frozenset({
        "test_generated_code_matches_proto", "test_protocol_modules_import_without_grpc_tools"}),
    "test_reproducibility.py": frozenset({"test_a_greedy_or_seeded_request_alone_is_the_same_every_time"}),
    "test_responses_api.py": WHOLE,
    "test_router.py": frozenset({
        "test_a_second_signal_stops_the_router_at_once", "test_importing_the_router_loads_no_torch",
        "test_metrics_parse_and_pass_promtool", "test_the_router_program_stops_on_sigterm_after_its_streams"}),
    "test_quantized_formats.py": WHOLE,
    "test_quantized_awq_gptq.py": WHOLE,
    "test_quantized_mxfp4.py": WHOLE,
    "test_quantization_flag.py": WHOLE,  # its one process-starting test is marked slow
    "test_router_kv.py": WHOLE,
    "test_router_policy.py": WHOLE,
    "test_router_transport.py": WHOLE,
    "test_sampling.py": WHOLE,
    "test_schemathesis.py": frozenset({"[mesh]"}),
    "test_speculation.py": WHOLE,
    "test_speculation_under_load.py": frozenset({"test_no_proposals_while_the_pipeline_is_busy_and_the_same_tokens"}),
    "test_speculative.py": WHOLE,
    "test_stage_isolation.py": WHOLE,
    "test_stage_loader.py": WHOLE,
    "test_stage_metrics_http.py": WHOLE,
    "test_stage_probes.py": WHOLE,
    "test_stage_pool.py": WHOLE,
    "test_stage_runtime.py": WHOLE,
    "test_step_scheduler.py": WHOLE,
    "test_stopping.py": WHOLE,
    "test_token_masks.py": WHOLE,
    "test_tools.py": WHOLE,
    "test_utility_routes.py": WHOLE,
}
FULL_RUN_ONLY = ("slow", "k8s")  # markers the fast tier never runs


class ProcessInFastTier(RuntimeError):
    """A fast-tier test started a process."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true",
                     help="the fast tier only: FAST_TIER in tests/conftest.py, no slow or k8s tests, no processes")


def module_of(item: pytest.Item) -> str | None:
    """The item's file as FAST_TIER names it (its path under tests/), or None outside tests/."""
    path = Path(str(item.fspath)).resolve()
    return path.relative_to(TESTS).as_posix() if path.is_relative_to(TESTS) else None


def exceptions_naming(item: pytest.Item) -> set[str]:
    """What a FAST_TIER exception may say to leave this test out: its name without parameters,
    or "[value]" for each value of its parameters (a parametrized fixture's "mesh", say)."""
    callspec = getattr(item, "callspec", None)
    values = {f"[{value}]" for value in callspec.params.values()} if callspec is not None else set()
    return {getattr(item, "originalname", item.name)} | values


def in_fast_tier(item: pytest.Item) -> bool:
    module = module_of(item)
    left_out = FAST_TIER.get(module) if module is not None else None
    return (left_out is not None and not left_out & exceptions_naming(item)
            and not any(item.get_closest_marker(marker) for marker in FULL_RUN_ONLY))


def stale_exceptions(items: list[pytest.Item]) -> list[str]:
    """FAST_TIER exceptions naming no test of a collected module (renamed or deleted tests)."""
    named: dict[str, set[str]] = {}
    for item in items:
        module = module_of(item)
        if module is not None:
            named.setdefault(module, set()).update(exceptions_naming(item))
    return [f"{module}::{name}" for module, names in named.items()
            for name in sorted(FAST_TIER.get(module, WHOLE) - names)]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--fast"):
        return
    stale = stale_exceptions(items)
    if stale:
        raise pytest.UsageError(f"tests/conftest.py FAST_TIER leaves out tests that do not exist: {stale}")
    fast = {item.nodeid for item in items if in_fast_tier(item)}
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in fast])
    items[:] = [item for item in items if item.nodeid in fast]


# The one process a fast-tier test may start: the frontend's grammar worker, part of the engine
# under test (it compiles grammars apart, within a CPU budget), not a server or a mesh.
ALLOWED_PROCESSES = ("grammar_worker",)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """In the fast tier, starting a process (other than ALLOWED_PROCESSES) fails the test, in its
    setup, call or teardown."""
    if not item.config.getoption("--fast"):
        yield
        return
    execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def refuse(what: object) -> None:
        raise ProcessInFastTier(f"{item.nodeid} starts a process ({what}): it belongs to the full run only "
                                "(leave it out of FAST_TIER in tests/conftest.py, or mark it slow)")

    def popen(self: subprocess.Popen, args: object, *rest: object, **kwargs: object) -> None:
        if not any(allowed in str(args) for allowed in ALLOWED_PROCESSES):
            refuse(args)
        execute_child(self, args, *rest, **kwargs)

    patched = {(subprocess.Popen, "_execute_child"): popen,
               (multiprocessing.process.BaseProcess, "start"): lambda *_: refuse("multiprocessing"),
               (os, "fork"): lambda: refuse("fork")}
    saved = {target: getattr(*target) for target in patched}
    for (owner, name), replacement in patched.items():
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for (owner, name), original in saved.items():
            setattr(owner, name, original)
