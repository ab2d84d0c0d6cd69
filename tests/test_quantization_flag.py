"""`--quantization` (and spec.model.quantization) end to end: a 16-bit checkpoint quantized as its
stages load it, in `serve`'s real processes (the embedded first stage and a stage process, beside
a 16-bit draft), planned by the bytes the stages then hold (`plan`, the operator's plan and
layout), rendered into every pod the operator makes and read back by the programs' own parser;
and a checkpoint quantized already refused in one line."""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
from pathlib import Path

import httpx
import pytest
import torch
from mesh_helpers import serving
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from inferencemesh.bundled import DEFAULT_MODEL, bundled_path
from inferencemesh.checkpoint.errors import CheckpointError
from inferencemesh.checkpoint.quantization import LOAD_METHODS, SERVED_FORMATS
from inferencemesh.config import FrontendConfig, StageConfig
from inferencemesh.flags import from_args
from inferencemesh.modeling.families import QUANTIZED_FORMATS
from inferencemesh.modeling.quantized import QuantizedLinear
from inferencemesh.modeling.runtime import StageRuntime
from inferencemesh.operator.modelfacts import ModelFacts
from inferencemesh.operator.names import LABEL_REVISION
from inferencemesh.operator.planning import make_plan
from inferencemesh.operator.spec import parse_spec
from inferencemesh.programs.cli import PROGRAMS, build_parser, main
from inferencemesh.programs.plan import run_plan
from inferencemesh.programs.serve import run_serve

sys.path.insert(0, str(Path(__file__).parent / "operator"))
from render_fixtures import children, container  # noqa: E402

PROMPT, TOKENS = "def fibonacci(n):", 12


def run(command: str, *flags: str) -> str:
    """`inferencemesh plan` or `serve` with these flags, in this process (what the command runs after
    its parser: a subprocess would spend seconds importing transformers): its stdout."""
    config = from_args(PROGRAMS[command][0], build_parser().parse_args([command, *flags]))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        {"plan": run_plan, "serve": run_serve}[command](config)
    return out.getvalue()


def plan_json(*flags: str) -> dict:
    return json.loads(run("plan", "--json", "--device", "cpu", *flags))


def reference_greedy(method: str) -> str:
    """The bundled model's greedy completion in this process: one StageRuntime over every layer,
    quantized at load as the stages quantize it, float32 as serve is told to compute."""
    model = bundled_path(DEFAULT_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(model)
    runtime = StageRuntime(model, 0, 8, dtype="float32", device="cpu", max_context=64, quantization=method)
    assert isinstance(runtime._layers[0].mlp.down_proj, QuantizedLinear)
    kv, ids = runtime.new_session(), tokenizer(PROMPT).input_ids
    logits, got = runtime.forward(kv, 0, token_ids=torch.tensor(ids)), []
    for _ in range(TOKENS):
        got.append(int(logits[-1].argmax()))
        logits = runtime.forward(kv, len(ids) + len(got) - 1, token_ids=torch.tensor(got[-1:]))
    return tokenizer.decode(got)


@pytest.mark.slow
def test_serve_quantized_answers_as_the_quantized_runtime_and_its_stages_hold_the_planned_bytes() -> None:
    want = reference_greedy("int8")
    plan = plan_json("--quantization", "int8", "--dtype", "float32", "--max-sessions", "4")
    bf16 = plan_json("--dtype", "float32", "--max-sessions", "4")
    flags = ("--quantization", "int8", "--stages", "2", "--dtype", "float32", "--device", "cpu")
    with serving(*flags) as (base, _, lines):
        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        model = client.models.list().data[0].id
        done = client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert done.choices[0].text == want
        # The 16-bit draft beside the quantized target: loaded as it is (its lean forward), and proposing.
        assert any("imesh-code-draft (llama) runs the lean forward" in line for line in lines), "".join(lines)
        samples = {s.name: s.value for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text)
                   for s in family.samples}
        assert samples["inferencemesh_spec_decode_num_draft_tokens_total"] > 0
        # Each stage (stage 0 in the frontend, stage 1 a process of its own) says what its weights hold.
        assert any("imesh-code-target, int8 quantized at load" in line for line in lines), "".join(lines)
        held = {int(m[1]): int(m[2]) for line in lines
                if (m := re.search(r"stage (\d+) ready: .* weights (\d+) bytes \(int8 at load\)", line))}
    assert sorted(held) == [0, 1], "".join(lines)
    for stage, plain in zip(plan["stages"], bf16["stages"], strict=True):
        assert held[stage["index"]] == stage["weight_bytes"] < plain["weight_bytes"]


def test_plan_counts_int4_as_fewer_bytes_per_stage_and_the_layout_too() -> None:
    plain, int4 = plan_json("--dtype", "bfloat16"), plan_json("--dtype", "bfloat16", "--quantization", "int4")
    assert int4["quantization"] == "int4" and plain["quantization"] is None
    for q, p in zip(int4["stages"], plain["stages"], strict=True):
        assert (q["layer_start"], q["layer_end"]) == (p["layer_start"], p["layer_end"])
        assert q["weight_bytes"] < 0.6 * p["weight_bytes"], (q, p)
    layouts = [plan_json("--dtype", "bfloat16", "--layout", *flags)["layout"] for flags in ((), ("--quantization",
                                                                                                 "int4"))]
    assert layouts[1]["layerBytes"] < 0.3 * layouts[0]["layerBytes"]
    # the bundled model's embedding is tied to its head: quantized too, as a table (and as a head)
    assert layouts[1]["embedBytes"] < 0.3 * layouts[0]["embedBytes"]


def test_the_operator_plans_spec_model_quantization_by_the_quantized_bytes() -> None:
    def planned(**model: str) -> list[int]:
        spec = parse_spec({"model": {"name": f"bundled://{DEFAULT_MODEL}", "dtype": "bfloat16", **model},
                           "stages": {"count": 2}})
        return [s.weight_bytes for s in make_plan(spec, ModelFacts().info(spec)).stages]

    plain, int8 = planned(), planned(quantization="int8")
    assert all(q < 0.7 * p for q, p in zip(int8, plain, strict=True)), (int8, plain)
    assert int8 == [s["weight_bytes"] for s in plan_json("--dtype", "bfloat16", "--quantization", "int8")["stages"]]


@pytest.mark.parametrize("embedded", [False, True])
def test_every_pod_gets_quantization_and_its_program_reads_it_back(embedded: bool) -> None:
    spec = {"model": {"name": f"bundled://{DEFAULT_MODEL}", "quantization": "int4"},
            "frontend": {"embedFirstStage": embedded}}
    objs = children(spec)
    pods = [o for (kind, _), o in objs.items() if kind == "Deployment" and "-p0-" in o["metadata"]["name"]]
    assert len(pods) == 4 - embedded  # three stages (two with stage 0 in the frontend), the frontend
    parser = build_parser()
    for pod in pods:
        args = container(pod)["args"]
        config = from_args({"stage": StageConfig, "frontend": FrontendConfig}[args[0]], parser.parse_args(args))
        assert config.quantization == "int4", args
        if isinstance(config, FrontendConfig) and embedded:
            first = config.first_stage()
            assert first is not None and first.quantization == "int4"  # the embedded stage quantizes too
    unset = children({"model": {"name": f"bundled://{DEFAULT_MODEL}"}, "frontend": {"embedFirstStage": embedded}})
    assert not any("--quantization" in container(o)["args"] for (kind, _), o in unset.items()
                   if kind == "Deployment" and "-p0-" in o["metadata"]["name"])
    # Another quantization is another revision of the pipeline (its pods roll), none leaves it as it was.
    assert revision_of(pods[0]) != revision_of(unset[("Deployment", pods[0]["metadata"]["name"])])


def revision_of(obj: dict) -> str:
    return obj["metadata"]["labels"][LABEL_REVISION]


def test_a_checkpoint_quantized_already_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    """By plan and serve (before any process starts) and by the operator, in the loader's terms."""
    from test_quantized_formats import write_quantized
    from tiny_models import write_tiny_model

    base = write_tiny_model(tmp_path / "base", "llama", num_layers=2, shards=1, dtype=torch.bfloat16)
    fp8 = write_quantized(base, tmp_path, "fp8-block")
    for command in ("plan", "serve"):
        with pytest.raises(SystemExit) as stopped:
            run(command, "--model", str(fp8), "--quantization", "int8", "--device", "cpu")
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert "quantized already (fp8)" in err and "without --quantization" in err, err
    spec = parse_spec({"model": {"name": str(fp8), "quantization": "fp8"}})
    with pytest.raises(CheckpointError, match="quantized already"):
        ModelFacts().info(spec)


def test_models_lists_every_format_served_beside_the_families(capsys) -> None:
    named = " ".join(name for name, _ in QUANTIZED_FORMATS)
    assert all(fmt in named for fmt in SERVED_FORMATS) and all(m in named for m in LOAD_METHODS)
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert out.index("Per-family differences") < out.index("Quantized weights")
    assert all(name in out for name, _ in QUANTIZED_FORMATS) and "GGUF" in out
