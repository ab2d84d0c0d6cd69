"""The OpenAI surface third-party tools use, over a real stage process: lm-evaluation-harness
(loglikelihood and generate_until, batched), and every request field of OpenAI's schemas plus
the vLLM extras honoured (checked by behaviour) or refused with a 400 naming it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch
from fixture_engine import serve
from mesh_helpers import start_mesh
from openai_spec import COMPLETION_STREAM_CHUNK, errors
from transformers import AutoModelForCausalLM, AutoTokenizer

from inferencemesh.bundled import DEFAULT_MODEL, bundled_path
from inferencemesh.frontend.engine.engine import EngineOptions, PipelineEngine
from inferencemesh.frontend.engine.pipeline import GrpcPipeline
from inferencemesh.frontend.openai.app import create_app
from inferencemesh.frontend.openai.protocol import FIXED, REFUSED

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


# --- every request field: honoured (by behaviour) or refused naming it ------------------------


def spec_fields(schema: str) -> set[str]:
    import yaml

    schemas = yaml.load((Path(__file__).parent / "openai/openapi.yaml").read_text(), Loader=yaml.CSafeLoader)
    schemas = schemas["components"]["schemas"]

    def props(name: str) -> set[str]:
        node = schemas[name]
        out = set(node.get("properties", {}))
        for part in node.get("allOf", []):
            out |= props(part["$ref"].split("/")[-1]) if "$ref" in part else set(part.get("properties", {}))
        return out

    return props(schema)


class Api:
    """Posts with the defaults of this test (greedy, 8 tokens, EOS ignored: comparable lengths)."""

    def __init__(self, http: httpx.Client, path: str) -> None:
        self.http, self.path, self.chat = http, path, path.endswith("chat/completions")

    def body(self, fields: dict) -> dict:
        base = {"model": NAME, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        base.update({"messages": [{"role": "user", "content": PROMPT}]} if self.chat else {"prompt": PROMPT})
        return {k: v for k, v in {**base, **fields}.items() if v is not None}

    def ok(self, **fields) -> dict:
        r = self.http.post(self.path, json=self.body(fields))
        assert r.status_code == 200, (fields, r.text)
        if not fields.get("stream"):
            check(r.json(), "CreateChatCompletionResponse" if self.chat else "CreateCompletionResponse")
        return r.json() if not fields.get("stream") else r.text

    def text(self, **fields) -> str:
        choice = self.ok(**fields)["choices"][0]
        return choice["message"]["content"] if self.chat else choice["text"]

    def refused(self, field: str, value) -> None:
        r = self.http.post(self.path, json=self.body({field: value}))
        assert r.status_code == 400, (field, value, r.text)
        check(r.json(), "ErrorResponse")
        assert (r.json()["error"]["param"] or "").split(".")[0] == field, (field, r.json())


def greedy_reference(model, ids: list[int], new: int, presence: float = 0.0, frequency: float = 0.0) -> list[int]:
    """OpenAI's penalty formula, written out here independently of inferencemesh.sampling."""
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(new):
            logits = model(torch.tensor([ids + out])).logits[0, -1].float()
            for token in set(out):
                logits[token] -= frequency * out.count(token) + presence
            out.append(int(logits.argmax()))
    return out


def prompt_ids(api: Api, tokenizer) -> list[int]:
    if api.chat:
        return tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                                       add_generation_prompt=True), add_special_tokens=False).input_ids
    return tokenizer(PROMPT).input_ids


LANGUAGE = {"type": "object", "properties": {"lang": {"enum": ["python", "rust"]}}, "required": ["lang"],
            "additionalProperties": False}
# Structured output, each field with a constraint whose every output is easy to check (vLLM's fields
# on both endpoints, OpenAI's response_format too).
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "language", "strict": True, "schema": LANGUAGE}}
STRUCTURED = {
    "guided_choice": (["yes", "no"], lambda text: text in ("yes", "no")),
    "guided_regex": ("[0-9]{3}", lambda text: re.fullmatch("[0-9]{3}", text) is not None),
    "guided_json": (LANGUAGE, lambda text: json.loads(text)["lang"] in ("python", "rust")),
    "guided_grammar": ('start: "alpha" | "beta"', lambda text: text in ("alpha", "beta")),
    "structured_outputs": ({"choice": ["on", "off"]}, lambda text: text in ("on", "off")),
}


def honoured_checks(api: Api, tokenizer, model) -> dict:
    """Per field, a behavioural check (each could fail if the field were ignored)."""
    greedy = api.text()
    ids = prompt_ids(api, tokenizer)
    decode = lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True)  # noqa: E731
    eos = tokenizer.eos_token_id

    def penalty(name: str) -> None:
        for value in (-2.0, 2.0):  # negative: repeat what was said
            expected = decode(greedy_reference(model, ids, 24, **{name.split("_")[0]: value}))
            assert expected != api.text(max_tokens=24) and api.text(max_tokens=24, **{name: value}) == expected

    def stop_token_ids() -> None:
        first = greedy_reference(model, ids, 8)
        assert api.ok(stop_token_ids=[first[2]])["usage"]["completion_tokens"] == 2
        with_min = api.ok(stop_token_ids=[first[2]], min_tokens=5)["usage"]["completion_tokens"]
        assert with_min >= 5  # and min_tokens masked the stop token until then

    def include_stop() -> None:
        first = greedy_reference(model, ids, 8)
        kept = api.ok(stop_token_ids=[first[2]], include_stop_str_in_output=True)
        assert kept["usage"]["completion_tokens"] == 3 and api.text(stop_token_ids=[first[2]]) == decode(first[:2])
        stop = decode(first)[3:6]
        assert api.text(stop=stop, include_stop_str_in_output=True).endswith(stop)

    def ignore_eos() -> None:
        assert api.ok(ignore_eos=None, logit_bias={str(eos): 100})["usage"]["completion_tokens"] == 0
        assert api.ok(ignore_eos=True, logit_bias={str(eos): 100})["usage"]["completion_tokens"] == 8

    def logprobs() -> None:
        if api.chat:
            content = api.ok(logprobs=True, top_logprobs=3)["choices"][0]["logprobs"]["content"]
            assert len(content) == 8 and all(len(c["top_logprobs"]) == 3 and c["logprob"] <= 0 for c in content)
        else:
            lp = api.ok(logprobs=3)["choices"][0]["logprobs"]
            assert len(lp["tokens"]) == 8 and all(len(t) <= 4 for t in lp["top_logprobs"])

    def stream() -> None:
        raw = api.ok(stream=True, stream_options={"include_usage": True})
        events = [json.loads(b[6:]) for b in raw.split("\n\n") if b.startswith("data: {")]
        schema = "CreateChatCompletionStreamResponse" if api.chat else COMPLETION_STREAM_CHUNK
        for event in events:
            check(event, schema)
        pieces = [c["delta"].get("content", "") if api.chat else c["text"] for e in events for c in e["choices"]]
        assert "".join(pieces) == greedy and events[-1]["usage"]["completion_tokens"] == 8

    def expect(condition: bool) -> None:
        assert condition

    def n() -> None:
        body = api.ok(n=3)  # greedy: three times the one answer; usage counts the prompt once
        texts = [c["message"]["content"] if api.chat else c["text"] for c in body["choices"]]
        assert [c["index"] for c in body["choices"]] == [0, 1, 2] and texts == [greedy] * 3
        assert body["usage"]["completion_tokens"] == 24 and body["usage"]["prompt_tokens"] == len(ids)
        choices = lambda: [c["message"]["content"] if api.chat else c["text"]  # noqa: E731
                           for c in api.ok(n=3, **sampled)["choices"]]
        seeded = choices()
        assert seeded == choices() and len(set(seeded)) > 1 and seeded[0] == api.text(**sampled)

    sampled = {"temperature": 1.5, "seed": 5}
    checks = {
        "model": lambda: expect(api.http.post(api.path, json=api.body({"model": "gpt-4o"})).status_code == 404),
        "frequency_penalty": lambda: penalty("frequency_penalty"),
        "presence_penalty": lambda: penalty("presence_penalty"),
        "logit_bias": lambda: expect(api.text(logit_bias={str(ids[-1]): 100}) == decode([ids[-1]] * 8)),
        "logprobs": logprobs, "top_logprobs": logprobs,
        "max_tokens": lambda: expect(api.ok(max_tokens=3)["usage"]["completion_tokens"] == 3),
        "n": n,
        "seed": lambda: expect(api.text(**sampled) == api.text(**sampled) != api.text(temperature=1.5, seed=6)),
        "temperature": lambda: expect(api.text(**sampled) != greedy),
        "top_p": lambda: expect(api.text(top_p=1e-9, **sampled) == greedy),
        "top_k": lambda: expect(api.text(top_k=1, **sampled) == greedy),
        "stop": lambda: expect(api.ok(stop=greedy[3:6])["choices"][0]["finish_reason"] == "stop"),
        "stream": stream, "stream_options": stream,
        "repetition_penalty": lambda: expect(api.text(repetition_penalty=2.0) != greedy),
        "min_tokens": stop_token_ids, "stop_token_ids": stop_token_ids,
        "include_stop_str_in_output": include_stop, "ignore_eos": ignore_eos,
    }
    if api.chat:
        checks["max_completion_tokens"] = lambda: expect(
            api.ok(max_tokens=None, max_completion_tokens=2)["usage"]["completion_tokens"] == 2)
        checks["messages"] = lambda: expect(api.text(messages=[{"role": "user", "content": "x"}]) != greedy)
    else:
        checks["prompt"] = lambda: expect(api.text(prompt=ids) == greedy)
        checks["echo"] = lambda: expect(api.text(echo=True) == PROMPT + greedy)
        checks["add_special_tokens"] = lambda: expect(api.ok(add_special_tokens=False)["usage"]["prompt_tokens"] == len(
            tokenizer(PROMPT, add_special_tokens=False).input_ids))

    def constrained(field: str, value: object, valid: Callable[[str], bool]) -> None:
        # EOS ends a constrained output (so it is not ignored); a free-text format is no constraint
        assert valid(api.text(ignore_eos=None, max_tokens=24, **{field: value})), field

    for field, (value, valid) in STRUCTURED.items():
        checks[field] = partial(constrained, field, value, valid)
    if api.chat:
        checks.update(tool_checks(api, greedy))
    checks["response_format"] = lambda: (expect(api.text(response_format={"type": "text"}) == greedy),
                                         constrained("response_format", SCHEMA_FORMAT, STRUCTURED["guided_json"][1]))
    return checks


# Two functions whose arguments are bounded, so that a call always ends within the test's tokens.
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
    "additionalProperties": False}, "strict": True}} for name in ("inc", "dec")]


def tool_checks(api: Api, greedy: str) -> dict:
    """tools, tool_choice and parallel_tool_calls, each with a check that fails if it is ignored."""
    def calls(**fields) -> tuple[str, list[dict]]:
        choice = api.ok(tools=TOOLS, ignore_eos=None, max_tokens=60, **fields)["choices"][0]
        return choice["finish_reason"], choice["message"].get("tool_calls") or []

    def tools() -> None:  # required: the answer is a call to one of the tools, its arguments valid
        finish, made = calls(tool_choice="required", parallel_tool_calls=False)
        assert finish == "tool_calls" and len(made) == 1 and made[0]["function"]["name"] in ("inc", "dec")
        jsonschema.validate(json.loads(made[0]["function"]["arguments"]), TOOLS[0]["function"]["parameters"])

    def tool_choice() -> None:
        for name in ("inc", "dec"):  # a named function is the one called, once
            finish, made = calls(tool_choice={"type": "function", "function": {"name": name}})
            assert finish == "tool_calls" and [c["function"]["name"] for c in made] == [name]
        # none: no call, and the tools stay out of the prompt (the answer is the tool-less one)
        assert api.text(tools=TOOLS, tool_choice="none") == greedy

    def parallel_tool_calls() -> None:  # the bundled model, greedy, calls again and again unless told not to
        assert len(calls(tool_choice="required", parallel_tool_calls=True)[1]) > 1
        assert len(calls(tool_choice="required", parallel_tool_calls=False)[1]) == 1

    return {"tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": parallel_tool_calls}


LABELS = {"user": "someone", "metadata": {"k": "v"}, "safety_identifier": "x", "prompt_cache_key": "k",
          "prompt_cache_retention": "24h", "prompt_cache_options": {}, "service_tier": "auto", "request_id": "r-1"}
# A value of each field that asks for what we do (accepted) and one that does not (refused).
ACCEPTED_REFUSED = {
    "best_of": (1, 2), "suffix": ("", "x"),
    "store": (False, True), "modalities": (["text"], ["text", "audio"]),
    "skip_special_tokens": (True, False), "spaces_between_special_tokens": (True, False),
    "add_generation_prompt": (True, False), "echo": (False, True),
}
OTHER_REFUSED = {"audio": {"voice": "alloy", "format": "mp3"}, "functions": [{"name": "f"}], "function_call": "auto",
                 "prediction": {"type": "content", "content": "x"},
                 "reasoning_effort": "low", "verbosity": "low", "web_search_options": {}, "moderation": {}}


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()


@pytest.mark.parametrize(("path", "schema"), [("/v1/completions", "CreateCompletionRequest"),
                                              ("/v1/chat/completions", "CreateChatCompletionRequest")])
def test_every_field_is_honoured_or_refused(http, tokenizer, model, path: str, schema: str) -> None:
    api = Api(http, path)
    greedy_text = api.text()
    ids = prompt_ids(api, tokenizer)
    checks = honoured_checks(api, tokenizer, model)
    vllm_extras = {"top_k", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
                   "include_stop_str_in_output", "response_format", *STRUCTURED} | set(FIXED) | set(REFUSED)
    fields = spec_fields(schema) | vllm_extras
    for field in sorted(fields):
        if field in checks:
            checks[field]()
        elif field in LABELS:
            assert api.text(**{field: LABELS[field]}) == api.text(), field
        elif field in ACCEPTED_REFUSED or field in FIXED:
            accepted, refused = ACCEPTED_REFUSED.get(field, (FIXED.get(field), "other"))
            if not (api.chat and field == "echo"):
                api.ok(**{field: accepted})
            api.refused(field, refused)
        else:
            assert field in REFUSED or field in OTHER_REFUSED, f"{field}: neither honoured nor refused"
            api.refused(field, OTHER_REFUSED.get(field, "x"))
    if not api.chat:  # a batch of prompts, streamed and not
        batch = api.ok(prompt=[ids, ids, ids])
        assert [c["text"] for c in batch["choices"]] == [greedy_text] * 3 and batch["usage"]["completion_tokens"] == 24
        streamed = [json.loads(b[6:]) for b in api.ok(prompt=[ids, ids], stream=True).split("\n\n")
                    if b.startswith("data: {")]
        assert ["".join(c["text"] for e in streamed for c in e["choices"] if c["index"] == i)
                for i in (0, 1)] == [greedy_text] * 2
