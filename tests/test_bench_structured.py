"""`inferencemesh bench --structured`, tiny: free and json_schema-constrained decoding side by side
over a 2-stage mesh of the bundled model, with and without speculation."""

from __future__ import annotations

import json

import pytest

from inferencemesh.programs import cli


def test_structured_bench_reports_constrained_against_free(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--structured", "--stages", "2", "--speculative", "none,ngram", "--new-tokens", "6",
                     "--repeats", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["speculative"], r["output"]) for r in report["results"]] == [
        ("none", "free"), ("none", "json_schema"), ("ngram", "free"), ("ngram", "json_schema")]
    for r in report["results"]:
        assert r["runs"] == 4 and r["decode_tokens_per_s"] > 0 and 1 <= r["mean_tokens"] <= 6
        assert (r["output"] == "json_schema") == ("mask_ms_p99" in r)
    none, ngram = report["structured"]
    assert none["json_schema_vs_free"] == round(none["json_schema_decode_tokens_per_s"]
                                                / none["free_decode_tokens_per_s"], 3)
    assert "acceptance_rate_free" not in none and 0 <= ngram["acceptance_rate_json_schema"] <= 1
    assert 0 < none["mask_ms_p99"] < 1000


def test_structured_bench_refuses_a_vocabulary_narrower_than_its_tokenizer(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # the shape's checkpoint is cached under ~/.cache
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", "--structured", "--shape", "llama-tiny", "--dtype", "float32", "--stages", "1"])
    assert exited.value.code == 2 and "cover its tokenizer" in capsys.readouterr().err
