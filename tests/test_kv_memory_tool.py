"""tools/kv_memory.py on a real 2-stage mesh (stage processes: not in the fast tier)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import kv_memory  # noqa: E402 - tools/ is not a package


def test_the_memory_tool_finds_the_pool_holding_the_live_tokens_and_their_tails_only(tmp_path) -> None:
    """tools/kv_memory.py on the tiny shape, a real 2-stage mesh: blocks held always cover the live
    positions (ratio >= 1) and exceed them by less than a block per running session."""
    out = tmp_path / "memory.json"
    assert kv_memory.main(["--shape", "llama-tiny", "--requests", "6", "--new-tokens", "8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["samples"] > 0 and report["most_running"] >= 2
    assert 1.0 <= report["held_over_live_mean"] <= report["held_over_live_max"]
    assert report["held_over_live_max"] < 1 + 16 * 6 / report["prompt_tokens"][0]
