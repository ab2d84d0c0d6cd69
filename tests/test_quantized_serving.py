"""What a request can ask of a quantized target works unchanged, in one real `inferencemesh serve
--stages 2 --quantization int4` of the bundled model (its stages hold INT4 weights, the package's
bf16 draft model proposes against them), through the official openai client: speculation (greedy
text and logprobs are the INT4 model's own, computed in this process a token at a time, not the
16-bit model's, and the draft's proposals were verified and kept), the prefix cache (a prompt sent
again reuses its blocks and answers the same), a strict json_schema, and n > 1 with a seed (choice
j is what a request alone with its derived seed draws). Then the reverse: the 16-bit target with
an INT4 draft (`--draft DIR` of a W4A16 checkpoint), through the engine and the speculation
`serve --draft` resolves, in this process (no second server).

float32 compute, as the serve tests that compare with a reference do: serve's INT4 weights are
the in-process runtime's bit for bit (quantizing at load is deterministic); only the matmuls'
batch shapes differ, hence ATOL on logprobs."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
import torch
from mesh_helpers import collect, serving
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from speculation_rounds import Rounds, assert_speculated
from transformers import AutoTokenizer

from inferencemesh.bundled import DEFAULT_MODEL, DRAFT_MODEL, bundled_path
from inferencemesh.config import SpeculativeOptions
from inferencemesh.frontend.engine.api import choice_seed
from inferencemesh.frontend.engine.engine import EngineOptions, PipelineEngine
from inferencemesh.frontend.engine.metrics import FrontendMetrics
from inferencemesh.frontend.engine.proposers.build import Speculation, resolve_speculation
from inferencemesh.modeling.quantized import QuantizedLinear
from inferencemesh.modeling.runtime import StageRuntime
from inferencemesh.programs.mesh import in_process_pipeline

pytestmark = pytest.mark.slow

TARGET = bundled_path(DEFAULT_MODEL)
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main():\n"]
TOKENS = 12
# The prefix cache's prompt: several full KV blocks (16 tokens each) to reuse.
LONG = "".join(f"def add_{i}(a, b):\n    return a + {i} * b\n\n" for i in range(6))
# A logprob computed in another batch shape (a verify window's rows, a cached prompt's shorter
# tail) differs in float32's last bits: about 1e-5 in the logits (README, `seed`).
ATOL = 1e-4
SCHEMA: dict[str, Any] = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "port": {"type": "integer", "minimum": 1, "maximum": 65535},
    "protocol": {"enum": ["http", "grpc"]}},
    "required": ["name", "port", "protocol"], "additionalProperties": False}


class Served:
    def __init__(self, base: str, lines: list[str]) -> None:
        self.base, self.lines = base, lines
        self.client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        self.model = self.client.models.list().data[0].id

    def samples(self) -> dict[str, float]:
        """The frontend's metrics (one model: no label needed to tell samples apart)."""
        text = httpx.get(f"{self.base}/metrics", timeout=10).text
        return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serving("--stages", "2", "--quantization", "int4", "--dtype", "float32", "--device", "cpu") as (
            base, _, lines):
        yield Served(base, lines)


def greedy(prompts: list[str], quantization: str | None) -> list[tuple[str, list[float]]]:
    """Each prompt's greedy completion and its tokens' logprobs by the target alone in this process
    (no draft): one StageRuntime over every layer, quantized at load as serve's stages quantize it,
    a token a step."""
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    runtime = StageRuntime(TARGET, 0, 8, dtype="float32", device="cpu", max_context=128, quantization=quantization)
    assert isinstance(runtime._layers[0].mlp.down_proj, QuantizedLinear) == (quantization is not None)
    out = []
    for prompt in prompts:
        kv, ids = runtime.new_session(), tokenizer(prompt).input_ids
        logits, got, logprobs = runtime.forward(kv, 0, token_ids=torch.tensor(ids)), [], []
        for _ in range(TOKENS):
            got.append(int(logits[-1].argmax()))
            logprobs.append(float(torch.log_softmax(logits[-1].float(), -1)[got[-1]]))
            logits = runtime.forward(kv, len(ids) + len(got) - 1, token_ids=torch.tensor(got[-1:]))
        out.append((str(tokenizer.decode(got)), logprobs))
    return out


def test_speculation_with_a_bf16_draft_is_exact_on_the_int4_target(served: Served) -> None:
    assert any("imesh-code-target, int4 quantized at load" in line for line in served.lines), "".join(served.lines)
    # The draft is not quantized: it runs its lean forward, which refuses quantized layers.
    assert any("imesh-code-draft (llama) runs the lean forward" in line for line in served.lines)
    before = served.samples()
    got = []
    for prompt in PROMPTS:
        choice = served.client.completions.create(model=served.model, prompt=prompt, max_tokens=TOKENS,
                                                  temperature=0, logprobs=1,
                                                  extra_body={"ignore_eos": True}).choices[0]
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        got.append((choice.text, choice.logprobs.token_logprobs))
    after = served.samples()
    int4, plain = greedy(PROMPTS, "int4"), greedy(PROMPTS, None)
    for (text, logprobs), (want, wanted), (_, unquantized) in zip(got, int4, plain, strict=True):
        assert text == want
        assert max(abs(a - b) for a, b in zip(logprobs, wanted, strict=True)) < ATOL, (logprobs, wanted)
        # The INT4 target's own numbers: far from the 16-bit model's (its greedy text may agree).
        assert max(abs(a - b) for a, b in zip(logprobs, unquantized, strict=True)) > 10 * ATOL
    drafted, accepted = (after[name] - before.get(name, 0.0) for name in (
        "inferencemesh_spec_decode_num_draft_tokens_total", "inferencemesh_spec_decode_num_accepted_tokens_total"))
    # Drafts verified and some kept: the equality above went through speculation's accept path.
    assert drafted > 0 and accepted > 0, (drafted, accepted)


def test_a_prompt_sent_again_reuses_its_blocks_and_answers_the_same(served: Served) -> None:
    prompt = f"# {time.time()}\n{LONG}"  # new to the cache
    first, again = (served.client.completions.create(model=served.model, prompt=prompt, max_tokens=8, temperature=0,
                                                     logprobs=2) for _ in range(2))
    assert first.usage is not None and again.usage is not None
    assert first.usage.prompt_tokens_details is not None and again.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens or 0
    assert 16 <= cached < again.usage.prompt_tokens, (cached, again.usage)
    assert again.choices[0].text == first.choices[0].text
    a, b = first.choices[0].logprobs, again.choices[0].logprobs
    assert a is not None and b is not None and a.tokens == b.tokens
    assert a.token_logprobs is not None and b.token_logprobs is not None
    assert all(abs(x - y) < ATOL for x, y in zip(a.token_logprobs, b.token_logprobs, strict=True))


def test_a_strict_json_schema_is_followed(served: Served) -> None:
    done = served.client.chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": "Describe the service as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "service", "strict": True, "schema": SCHEMA}},
        max_completion_tokens=80, temperature=0)
    assert done.choices[0].finish_reason == "stop", done.choices[0].message.content
    jsonschema.validate(json.loads(done.choices[0].message.content or ""), SCHEMA)


def test_seeded_choices_are_each_their_seed_alone(served: Served) -> None:
    def sample(n: int, seed: int) -> list[str]:
        done = served.client.completions.create(model=served.model, prompt=PROMPTS[0], max_tokens=8, temperature=1.0,
                                                n=n, seed=seed, extra_body={"top_k": 40})
        return [c.text for c in sorted(done.choices, key=lambda c: c.index)]

    texts = sample(3, 2024)
    # Choice 0 keeps the request's seed; choice j draws what a request alone with its derived seed draws.
    assert texts == [sample(1, choice_seed(2024, j))[0] for j in range(3)]
    assert len(set(texts)) > 1  # different seeds, different samples


def test_an_int4_draft_against_the_16_bit_target_is_exact(tmp_path_factory: pytest.TempPathFactory) -> None:
    """`--quantization` leaves the draft as it is; a draft quantized already (W4A16, made from the
    bundled draft by compressed-tensors) is given by `--draft DIR`: it loads through the stage
    runtime, proposes, and the greedy output is the target's without speculation."""
    from test_quantized_formats import write_quantized

    root = tmp_path_factory.mktemp("qdraft")
    draft = write_quantized(bundled_path(DRAFT_MODEL), root, "w4a16")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the vocabulary check reads the draft's tokenizer
        shutil.copy(bundled_path(DRAFT_MODEL) / name, draft / name)
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    runtime = StageRuntime(TARGET, 0, 8, dtype="float32", device="cpu", max_context=256)
    prompt = tokenizer(PROMPTS[1]).input_ids

    def run(options: SpeculativeOptions) -> tuple[list[int], Rounds, Speculation]:
        metrics = FrontendMetrics("t")
        setup = resolve_speculation(options, TARGET, tokenizer, metrics, dtype="float32", device="cpu",
                                    max_context=256)

        async def go() -> list[int]:
            engine = PipelineEngine(in_process_pipeline([runtime]), EngineOptions("t", max_context=256),
                                    proposer_for=setup.proposer_for, metrics=metrics)
            try:
                return await collect(engine, prompt, 24, temperature=0.0)
            finally:
                await engine.close()

        return asyncio.run(go()), Rounds.counted(metrics), setup

    plain, none, _ = run(SpeculativeOptions(speculative="none"))
    drafted, rounds, setup = run(SpeculativeOptions(draft=str(draft)))
    assert setup.strategy == "draft", setup.choice.reason
    assert setup.draft is not None and setup.draft.form == "stage"  # its INT4 layers, by the stage runtime
    assert drafted == plain
    assert_speculated("none", [none])
    assert_speculated("draft", [rounds])
