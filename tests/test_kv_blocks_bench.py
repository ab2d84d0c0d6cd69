"""tools/kv_blocks_bench.py's own logic, without a server: its arguments, the flags each tree's serve
gets, the Prometheus text it reads, the multi-turn bench's ratios, and the summary (medians over
rounds, new ÷ old, the issue's targets passed or failed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import kv_blocks_bench as bench  # noqa: E402 - tools/ is not a package
import kv_blocks_scenarios as sc  # noqa: E402

EXPOSITION = """\
# HELP inferencemesh_prefix_cache_queries_total Prompt tokens looked up in the prefix cache.
# TYPE inferencemesh_prefix_cache_queries_total counter
inferencemesh_prefix_cache_queries_total{model_name="m"} 1500.0
inferencemesh_prefix_cache_queries_created{model_name="m"} 1.7e+09
# HELP inferencemesh_stage_tokens_total Tokens computed.
# TYPE inferencemesh_stage_tokens_total counter
inferencemesh_stage_tokens_total{model_name="m",stage="0"} 40.0
inferencemesh_stage_tokens_total{model_name="m",stage="1"} 60.0
# HELP inferencemesh_num_requests_running Requests running.
# TYPE inferencemesh_num_requests_running gauge
inferencemesh_num_requests_running{model_name="m"} 7.0
"""


def test_arguments_default_to_every_scenario_over_two_rounds_and_refuse_nonsense() -> None:
    args = bench.parse_args(["--old-src", "a/src", "--new-src", "b/src"])
    assert args.rounds == 2 and args.scenario == list(bench.SCENARIOS) and args.json is None
    picked = bench.parse_args(["--old-src", "a", "--new-src", "b", "--scenario", "burst16", "--scenario", "mixed"])
    assert picked.scenario == ["burst16", "mixed"]
    for bad in (["--rounds", "0"], ["--scenario", "nope"], ["--model", "x", "--shape", "llama-150m"], []):
        with pytest.raises(SystemExit):
            bench.parse_args(["--old-src", "a", "--new-src", "b", *bad] if bad else ["--old-src", "a"])


def test_each_tree_gets_two_stages_the_scenarios_flags_and_only_its_own_extra_flags() -> None:
    args = bench.parse_args(["--old-src", "a", "--new-src", "b", "--old-serve-args", "--max-sessions 8",
                             "--new-serve-args", "--kv-cache-tokens 4096", "--dtype", "float32"])
    model, bench_model = bench.model_flags(args, None)
    assert model == bench_model == ["--dtype", "float32"]
    mixed = bench.SCENARIOS["mixed"]
    assert bench.serve_flags(args, "old", mixed, model) == [
        "--stages", "2", "--dtype", "float32", "--max-context", "4096", "--max-sessions", "8"]
    assert bench.serve_flags(args, "new", bench.SCENARIOS["decode1"], model) == [
        "--stages", "2", "--dtype", "float32", "--kv-cache-tokens", "4096"]
    shaped = bench.parse_args(["--old-src", "a", "--new-src", "b", "--shape", "llama-150m"])
    assert bench.model_flags(shaped, Path("/c/llama")) == (["--model", "/c/llama"], ["--shape", "llama-150m"])


def test_metrics_are_read_per_label_set_without_the_model_name_or_created_samples() -> None:
    before = sc.parse_metrics(EXPOSITION)
    assert sc.total(before, "inferencemesh_stage_tokens_total") == 100
    assert sc.total(before, "inferencemesh_stage_tokens_total", stage="1") == 60
    assert sc.total(before, "inferencemesh_prefix_cache_queries_created") == 0
    assert sc.total(before, "inferencemesh_num_preemptions_total") == 0  # absent on the old tree: 0
    after = sc.parse_metrics(EXPOSITION.replace('stage="0"} 40.0', 'stage="0"} 1540.0'))
    assert sc.delta(after, before, "inferencemesh_stage_tokens_total", stage="0") == 1500
    assert sc.delta(after, before, "inferencemesh_stage_tokens_total", stage="1") == 0


def test_a_stream_decodes_its_tokens_after_the_first_over_the_time_after_it() -> None:
    assert sc.Stream(sent=0.0, first=1.0, done=3.0, completion_tokens=9).decode_tok_s == 4.0
    assert sc.Stream(sent=0.0, first=1.0, done=1.0, completion_tokens=1).decode_tok_s == 0.0


def test_the_multi_turn_ratios_come_from_the_benchs_json() -> None:
    turns = [{"turn": t, "ttft_on_over_off": t / 100} for t in range(1, 7)]
    report = {"results": [{"conversation": {"turns": turns, "same_answers": True, "decode_on_over_off": 1.01},
                           "repeat": {"repeat_over_cold": 0.05, "same_answers": True},
                           "shared_system_prompt": [{"on_over_off": 0.0135}]}]}
    assert sc.multiturn_numbers(report) == {"repeat_over_cold": 0.05, "turn6_ttft_on_over_off": 0.06,
                                            "shared_prompt_on_over_off": 0.0135, "decode_on_over_off": 1.01,
                                            "same_answers": 1.0}


def test_the_summary_takes_medians_of_good_rounds_and_judges_the_targets() -> None:
    rounds: dict[str, list[dict[str, Any]]] = {
        "old": [{"tok_s": 100.0, "max_running": 16.0, "seconds": 9, "burst_walls_s": [1.0, 2.0]},
                {"tok_s": 120.0, "max_running": 16.0},
                {"error": "RuntimeError: serve exited"}],
        "new": [{"tok_s": 150.0, "max_running": 48.0}, {"tok_s": 190.0, "max_running": 47.0},
                {"tok_s": 170.0, "max_running": 48.0}]}
    result = bench.summarise(bench.SCENARIOS["concurrency48"], rounds)
    assert result["metrics"]["tok_s"] == {"old": 110.0, "new": 170.0, "ratio": pytest.approx(1.5455, abs=1e-4)}
    assert "seconds" not in result["metrics"] and "burst_walls_s" not in result["metrics"]  # raw, in the rounds
    assert result["rounds"]["old"][0]["burst_walls_s"] == [1.0, 2.0]
    checks = {c["metric"]: c for c in result["checks"]}
    assert checks["max_running"]["pass"] is True and checks["tok_s"]["pass"] is True
    assert result["errors"] == ["old round 3: RuntimeError: serve exited"]
    rounds["new"] = [{"tok_s": 160.0, "max_running": 40.0}]
    checks = {c["metric"]: c for c in bench.summarise(bench.SCENARIOS["concurrency48"], rounds)["checks"]}
    assert checks["max_running"]["pass"] is False and checks["tok_s"]["pass"] is False  # 160 / 110 < 1.5
    table = bench.table({"concurrency48": bench.summarise(bench.SCENARIOS["concurrency48"], rounds)})
    assert "FAIL" in table and "serve exited" in table


def test_a_target_on_a_tree_without_good_rounds_or_a_zero_old_value_is_undecided() -> None:
    failed: dict[str, list[dict[str, Any]]] = {"old": [{"computed_over_ideal": 12.7}], "new": [{"error": "boom"}]}
    burst = bench.summarise(bench.SCENARIOS["burst16"], failed)
    assert burst["metrics"]["computed_over_ideal"] == {"old": 12.7, "new": None, "ratio": None}
    assert burst["checks"][0]["pass"] is None
    hits: dict[str, list[dict[str, Any]]] = {"old": [{"hit_share": 0.0}], "new": [{"hit_share": 0.97}]}
    cancel = bench.summarise(bench.SCENARIOS["cancel_retry"], hits)
    assert cancel["metrics"]["hit_share"]["ratio"] is None and cancel["checks"][0]["pass"] is True
    assert bench.Check("x", "new", "<=", 3.0, "").holds(3.0, None) is True
    assert bench.Check("x", "ratio", ">=", 0.95, "").holds(None, 0.94) is False


def test_serves_defaults_are_read_from_its_help_wrapped_or_not() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="serve", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--max-context", type=int, default=2048, help="longest session")
    parser.add_argument("--max-sessions", type=int, default=256, help="requests generating at once (a scheduling "
                        "limit: their KV comes from the pool, --kv-cache-tokens) " * 2)
    parser.add_argument("--kv-cache-tokens", type=int, default=0, help="KV positions (0: 16 contexts)")
    parser.add_argument("--window", default="adaptive:4:1:8", help="speculation window")
    found = bench.help_defaults(parser.format_help(), ("max-context", "max-sessions", "kv-cache-tokens",
                                                       "prefix-cache-tokens"))
    assert found == {"max-context": "2048", "max-sessions": "256", "kv-cache-tokens": "0"}


def test_the_hit_cost_tool_measures_every_stage_of_a_split_and_writes_its_json(tmp_path) -> None:
    """tools/kv_hit_cost.py on the tiny shape: a row per stage (own blocks, shared blocks, the old
    FORK's copy), the frontend's match, and the report it printed written as JSON."""
    import kv_hit_cost

    out = tmp_path / "hit.json"
    assert kv_hit_cost.main(["--shape", "llama-tiny", "--dtype", "float32", "--rounds", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [s["layers"] for s in report["stages"]] == [[0, 1], [1, 2]]
    for stage in report["stages"]:
        assert stage["frame_over_own_blocks_ms"] > 0 and stage["frame_over_shared_blocks_ms"] > 0
        assert stage["old_fork_copy_ms"] > 0
        assert stage["hit_cost_ms"] == pytest.approx(stage["frame_over_shared_blocks_ms"]
                                                     - stage["frame_over_own_blocks_ms"], abs=1e-3)
    assert report["frontend_match_ms"] > 0 and report["cached_positions"] == kv_hit_cost.CACHED

