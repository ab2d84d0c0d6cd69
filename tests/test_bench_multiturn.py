"""`inferencemesh bench --multi-turn`: the prefix cache on and off over real stage processes, on
a tiny random model: the stages' counters show the prompt tokens the cache saved, and both engines
answer the same."""

from __future__ import annotations

import json

from inferencemesh.programs import cli
from inferencemesh.programs.bench.multiturn import CONVERSATION_TURNS, CONVERSATIONS, SYSTEM_TOKENS, TURN_TOKENS


def test_multi_turn_bench_reports_the_cache_on_and_off(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # the shape's checkpoint is cached under ~/.cache
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--shape", "llama-tiny", "--dtype", "float32", "--stages", "2", "--multi-turn",
                     "--turns", "2", "--new-tokens", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (entry,) = report["results"]
    assert entry["stages"] == 2 and report["same_answers_stages_2"] is True
    turns = entry["conversation"]["turns"]
    assert [t["turn"] for t in turns] == [1, 2] and turns[0]["prompt_tokens"] == SYSTEM_TOKENS + TURN_TOKENS
    assert all(t["ttft_s_on"] > 0 and t["ttft_s_off"] > 0 for t in turns)
    (shared,) = entry["shared_system_prompt"]
    assert shared["conversations"] == CONVERSATIONS
    # Without the cache every turn computes its whole prompt; with it, each conversation's first
    # turn forks the warmed system prompt and later turns fork the conversation so far.
    assert shared["prompt_tokens_computed_off"] >= CONVERSATIONS * CONVERSATION_TURNS * SYSTEM_TOKENS
    assert shared["prompt_tokens_computed_on"] < 0.2 * shared["prompt_tokens_computed_off"]
    assert report[f"shared_prompt_tokens_on_over_off_{CONVERSATIONS}_conversations_stages_2"] == shared["on_over_off"]
    assert entry["repeat"]["same_answers"] and report["repeat_ttft_over_cold_stages_2"] > 0
    # the repeat reused the first one's full blocks: the last stage computed only the rest
    assert 0 < entry["repeat"]["repeat_positions_computed"] < entry["repeat"]["prompt_tokens"] // 2
