"""`inferencemesh bench --concurrency`: bursts of concurrent streams through real stage
processes, and the batched transformers peer, on a tiny random model."""

from __future__ import annotations

import json

from inferencemesh.programs import cli
from inferencemesh.programs.bench.report import percentile


def test_concurrency_bench_reports_every_configuration(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # the shape's checkpoint is cached under ~/.cache
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # stage processes on a shared CI machine
    out = tmp_path / "bench.json"
    new_tokens = 5
    assert cli.main(["bench", "--shape", "llama-tiny", "--dtype", "float32", "--stages", "2",
                     "--concurrency", "1,8", "--speculative", "none,ngram", "--new-tokens", str(new_tokens),
                     "--repeats", "1", "--first-stage", "embedded,process",
                     "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    by_key = {(r["label"], r["concurrency"]): r for r in report["results"]}
    meshes = {f"{form}-2-stages{spec}" for form in ("grpc", "embedded") for spec in ("", "+ngram")}
    assert set(by_key) == {("hf-generate-batch", 8)} | {(label, c) for label in meshes for c in (1, 8)}
    for (_, concurrency), r in by_key.items():
        # Every stream got exactly the tokens it asked for (greedy, no stop tokens).
        assert r["tokens"] == r["tokens_requested"] == concurrency * new_tokens * r["bursts"]
        assert r["bursts"] == 1 and r["tokens_per_s"] > 0 and r["wall_s"] > 0
        assert 0 < r["ttft_ms_p50"] <= r["ttft_ms_p99"] <= 1000 * r["wall_s"]
        assert 0 < r["itl_ms_p50"] <= r["itl_ms_p99"] <= 1000 * r["wall_s"]
    ratio = by_key["grpc-2-stages", 8]["tokens_per_s"] / by_key["grpc-2-stages", 1]["tokens_per_s"]
    assert report["concurrency_8_vs_1_stages_2"] == round(ratio, 3)
    ratio = by_key["embedded-2-stages", 8]["tokens_per_s"] / by_key["embedded-2-stages", 1]["tokens_per_s"]
    assert report["concurrency_8_vs_1_embedded_stages_2"] == round(ratio, 3)
    assert "concurrency_8_vs_hf_generate_batch_stages_2" in report
    assert len(report["load_average_before"]) == 3


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) is None
