"""The OpenAI surface third-party tools use, over a real stage process: lm-evaluation-harness
(loglikelihood and generate_until, batched), and every request field of OpenAI's schemas plus
the vLLM extras honoured (checked by behaviour) or refused with a 400 naming it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from fixture_engine import serve
from mesh_helpers import start_mesh
from openai_spec import COMPLETION_STREAM_CHUNK, errors
from transformers import AutoModelForCausalLM, AutoTokenizer

from inferencemesh.bundled import DEFAULT_MODEL, bundled_path
from inferencemesh.frontend.app import create_app
from inferencemesh.frontend.engine import EngineOptions, PipelineEngine
from inferencemesh.frontend.pipeline import GrpcPipeline

TARGET = bundled_path(DEFAULT_MODEL)
NAME = "imesh-code-target"
TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"
PROMPT = "def read_lines(path):\n    with open(path) as f:\n"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TARGET)


@pytest.fixture(scope="module")
def url(tokenizer) -> Iterator[str]:
    mesh = start_mesh(TARGET, 1, max_context=512, dtype="float32")
    try:
        engine = PipelineEngine(GrpcPipeline(mesh.addresses), EngineOptions(NAME, max_context=512))
        with serve(create_app(engine, tokenizer, served_model_name=NAME)) as base:
            yield base
    finally:
        mesh.stop()


@pytest.fixture()
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=120) as client:
        yield client


def check(body: object, schema: str) -> None:
    problems = errors(body, schema)
    assert not problems, f"{schema}: {problems}\n{json.dumps(body)[:1500]}"


# --- lm-evaluation-harness ------------------------------------------------------------------


def choice_scores(model, tokenizer, doc: dict) -> list[float]:
    """What a loglikelihood task computes, with transformers directly: sum of each choice's logprobs
    (tokenized as lm-eval does: trailing spaces of the context go to the choice; the context's own
    tokens, then the rest of the whole's)."""
    text = doc["context"].rstrip()
    spaces = doc["context"][len(text):]
    context = tokenizer(text).input_ids
    scores = []
    for choice in doc["choices"]:
        whole = context + tokenizer(text + spaces + choice).input_ids[len(context):]
        with torch.inference_mode():
            lp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
        scores.append(sum(float(lp[i - 1, whole[i]]) for i in range(len(context), len(whole))))
    return scores


def samples(out: Path, task: str) -> list[dict]:
    path = next(out.rglob(f"samples_{task}_*.jsonl"))
    return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])


def hf_until_newline(model, tokenizer, prompt: str, new_tokens: int) -> str:
    ids = tokenizer(prompt).input_ids
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True).split("\n")[0]


def test_lm_eval_local_completions(url: str, tokenizer, tmp_path: Path) -> None:
    """Batches of 4 prompts per request (token ids for scoring, text for generation)."""
    out = tmp_path / "results"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    args = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
            f"model={NAME},base_url={url}/v1/completions,tokenizer_backend=huggingface,tokenizer={TARGET},"
            "num_concurrent=1,max_retries=1,tokenized_requests=True",
            "--tasks", "imesh_code_mc,imesh_code_gen", "--include_path", str(TASKS), "--batch_size", "4",
            "--output_path", str(out), "--log_samples"]
    done = subprocess.run(args, cwd=TASKS, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    print(json.dumps(results, indent=1))  # the numbers, for the record
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    # Every loglikelihood lm-eval received is transformers' own, and so is its accuracy.
    docs = [json.loads(line) for line in (TASKS / "imesh_code_mc.jsonl").read_text().splitlines()]
    mc = samples(out, "imesh_code_mc")
    correct = 0
    for doc, sample in zip(docs, mc, strict=True):
        expected = choice_scores(model, tokenizer, doc)
        got = [float(r[0][0]) for r in sample["resps"]]
        assert got == pytest.approx(expected, abs=1e-3), (doc, got, expected)
        correct += max(range(len(expected)), key=expected.__getitem__) == doc["answer"]
    assert results["imesh_code_mc"]["acc,none"] == pytest.approx(correct / len(docs))
    # Generation: greedy, cut at the task's stop string, as transformers generates it.
    gen = samples(out, "imesh_code_gen")
    prompts = [json.loads(line)["prompt"] for line in (TASKS / "imesh_code_gen.jsonl").read_text().splitlines()]
    assert [s["resps"][0][0] for s in gen] == [hf_until_newline(model, tokenizer, p, 16) for p in prompts]
    assert 0.0 <= results["imesh_code_gen"]["exact_match,none"] <= 1.0
