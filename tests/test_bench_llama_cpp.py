"""`inferencemesh bench --peer llama-cpp`: finding llama.cpp's converter, the GGUF type, the TPOT
ratios against llama.cpp at each split's share of the cores; and, where llama-cpp-python and the
converter are installed (the `llama-cpp` extra: not in CI, its build takes minutes), the bench
itself with llama.cpp beside our configurations."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from inferencemesh.cpus import share_of_cpus
from inferencemesh.flags import ConfigError
from inferencemesh.programs import cli
from inferencemesh.programs.bench.latency import llama_cpp_ratios
from inferencemesh.programs.bench.llama_cpp_peer import (
    CONVERTER,
    default_converter_home,
    find_converter,
    gguf_path,
    gguf_type,
    peer_label,
)


def test_the_converter_is_found_in_a_script_checkout_or_sdist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    sdist = default_converter_home("9.9.9")
    script = sdist / "vendor" / "llama.cpp" / CONVERTER
    with pytest.raises(ConfigError, match=r"llama-cpp-python==9\.9\.9.*tar xzf"):  # says how to get it
        find_converter(None, "9.9.9")
    script.parent.mkdir(parents=True)
    script.write_text("")
    assert find_converter(None, "9.9.9") == script.resolve()  # the installed version's sdist, by default
    for given in (sdist, script.parent, script):  # an sdist, a llama.cpp checkout, the script
        assert find_converter(str(given), "9.9.9") == script.resolve()
    with pytest.raises(ConfigError, match="--llama-cpp-converter"):
        find_converter(str(tmp_path / "elsewhere"), "9.9.9")


def test_the_gguf_type_is_the_bench_dtype_and_quantization_is_refused() -> None:
    assert [gguf_type(d, None) for d in ("float32", "bfloat16", "float16")] == ["f32", "bf16", "f16"]
    with pytest.raises(ConfigError, match="same weights"):
        gguf_type("bfloat16", "int8")


def test_the_cached_gguf_follows_the_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"12")
    converter = tmp_path / CONVERTER
    first = gguf_path(model, "f32", converter)
    assert first == gguf_path(model, "f32", converter)
    assert gguf_path(model, "bf16", converter) != first
    assert gguf_path(model, "f32", tmp_path / "other" / CONVERTER) != first
    (model / "model.safetensors").write_bytes(b"123")  # another checkpoint in the same place
    assert gguf_path(model, "f32", converter) != first


def entry(label: str, tpot: float, stages: int = 1, speculative: str = "none") -> dict:
    return {"label": label, "stages": stages, "speculative": speculative, "tpot_ms_median": tpot}


def test_tpot_ratios_divide_by_llama_cpp_at_the_threads_of_each_stage() -> None:
    share = share_of_cpus(2)
    bench_threads = share + 1  # the split's share differs from the bench's threads, as on a 2-core machine
    one_core = peer_label(share, bench_threads)
    results = [entry("hf-generate", 6.0), entry(peer_label(bench_threads, bench_threads), 2.0),
               entry(one_core, 4.0), entry("in-process-1-stage", 5.0),
               entry(f"in-process-1-stage[threads={share}]", 6.0), entry("embedded-2-stages", 8.0, stages=2),
               entry("embedded-2-stages+ngram", 3.0, stages=2, speculative="ngram")]
    assert llama_cpp_ratios(results) == {"tpot_vs_llama_cpp": {
        "hf-generate / llama-cpp": 3.0, "in-process-1-stage / llama-cpp": 2.5,
        f"in-process-1-stage[threads={share}] / {one_core}": 1.5, f"embedded-2-stages / {one_core}": 2.0}}
    # Where each stage of a split has the bench's threads, llama.cpp has one measurement for both.
    same = [entry("llama-cpp", 2.0), entry("in-process-1-stage", 3.0), entry("grpc-2-stages", 5.0, stages=2)]
    assert llama_cpp_ratios(same)["tpot_vs_llama_cpp"] == {"in-process-1-stage / llama-cpp": 1.5,
                                                           "grpc-2-stages / llama-cpp": 2.5}
    assert llama_cpp_ratios(results[:1] + results[3:]) == {}  # no llama.cpp peer measured: no ratios


def test_latency_bench_without_llama_cpp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The default peer alone, in process; --peer llama-cpp where llama-cpp-python is absent is one line."""
    monkeypatch.setenv("HOME", str(tmp_path))  # the shape's checkpoint is cached under ~/.cache
    out = tmp_path / "bench.json"
    argv = ["bench", "--shape", "llama-tiny", "--dtype", "float32", "--stages", "1", "--new-tokens", "3",
            "--repeats", "1"]
    assert cli.main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["label"] for r in report["results"]] == ["hf-generate", "in-process-1-stage"]
    assert "tpot_vs_llama_cpp" not in report and "llama_cpp_agreement" not in report
    assert len(report["load_average_before"]) == len(report["load_average_after"]) == 3
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as where the extra is not installed
    with pytest.raises(SystemExit) as exited:
        cli.main([*argv, "--peer", "llama-cpp"])
    assert exited.value.code == 2
    assert "pip install 'inferencemesh[llama-cpp]'" in capsys.readouterr().err


def installed_converter() -> Path | None:
    """The converter of the installed llama-cpp-python, at its default place in the real home."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    from inferencemesh.programs.bench.llama_cpp_peer import llama_cpp_version

    try:
        return find_converter(None, llama_cpp_version())
    except ConfigError:
        return None


CONVERTER_HERE = installed_converter()  # read before a test moves HOME


@pytest.mark.slow
@pytest.mark.skipif(CONVERTER_HERE is None, reason="llama-cpp-python and its sdist's converter are not installed "
                    "(pip install 'inferencemesh[llama-cpp]', then the sdist as README's Benchmarks say)")
def test_bench_measures_llama_cpp_beside_the_mesh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The bundled model: a trained one (llama-tiny's vocabulary is smaller than the tokenizer it
    # borrows, which llama.cpp's converter refuses). Its GGUF is cached under ~/.cache.
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # stage processes on a shared machine
    out = tmp_path / "bench.json"
    new_tokens = 12
    assert cli.main(["bench", "--dtype", "float32", "--stages", "1,2",
                     "--peer", "hf-generate,llama-cpp", "--llama-cpp-converter", str(CONVERTER_HERE),
                     "--new-tokens", str(new_tokens), "--repeats", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    by_label = {r["label"]: r for r in report["results"]}
    assert by_label["llama-cpp"]["gguf"] == "f32"
    assert list((tmp_path / ".cache" / "inferencemesh" / "bench" / "gguf").glob("imesh-code-target-*-f32.gguf"))
    for r in report["results"]:
        assert r["tpot_ms_median"] > 0 and r["runs"] == 4  # every prompt, every configuration
    ratios = report["tpot_vs_llama_cpp"]
    assert ratios["in-process-1-stage / llama-cpp"] == round(
        by_label["in-process-1-stage"]["tpot_ms_median"] / by_label["llama-cpp"]["tpot_ms_median"], 3)
    assert any(key.startswith("embedded-2-stages / llama-cpp") for key in ratios)
    # The same weights in float32, greedy on the same ids: llama.cpp decodes our tokens (at least
    # the first half on every prompt: two float32 implementations may part where logits nearly tie).
    agreement = report["llama_cpp_agreement"]
    assert agreement["new_tokens"] == new_tokens and len(agreement["common_prefix_tokens"]) == 4
    assert min(agreement["common_prefix_tokens"]) >= new_tokens // 2, agreement


@pytest.mark.parametrize("extra", [["--concurrency", "2"], ["--multi-turn"], ["--structured"],
                                   ["--llama-cpp-converter", "/nowhere"]])
def test_a_peer_another_bench_would_ignore_is_refused_before_anything_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], extra: list[str]) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # nothing may be written there: the refusal comes first
    peer = [] if extra[0] == "--llama-cpp-converter" else ["--peer", "llama-cpp"]
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", "--shape", "llama-tiny", *peer, *extra])
    assert exited.value.code == 2
    assert extra[0] in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
