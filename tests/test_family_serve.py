"""A model of another family than the bundled Llama, as a user serves it: `inferencemesh serve` on a
random Qwen3-MoE checkpoint (written by transformers itself, with the bundled tokenizer), at 3
stages, the same checkpoint as its own draft, the official openai client. The text equals
transformers' greedy generate() on the same files, and the draft's proposals are the target's
tokens (accepted)."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
import torch
from mesh_helpers import serving
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from inferencemesh.bundled import DEFAULT_MODEL, bundled_path

pytestmark = pytest.mark.slow

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n"]
TOKENS = 16
# Every layer routes each token to 2 of 4 experts; initializer_range 0.5 makes the random logits
# large, so greedy output varies with the prompt and has no near ties.
MOE = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=6,
           max_position_embeddings=2048, initializer_range=0.5, bos_token_id=0, eos_token_id=0, pad_token_id=3)


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    bundled = bundled_path(DEFAULT_MODEL)
    path = tmp_path_factory.mktemp("moe") / "tiny-qwen3-moe"
    vocab = AutoConfig.from_pretrained(bundled).vocab_size
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", vocab_size=vocab, **MOE),
                                             dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(bundled / name, path / name)
    return path


def test_a_moe_served_at_3_stages_with_itself_as_draft_equals_generate(moe: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(moe)
    reference = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32).eval()
    expected = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = reference.generate(ids, max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False)
        expected.append(tokenizer.decode(out[0, ids.shape[1]:]))
    with serving("--model", str(moe), "--stages", "3", "--dtype", "float32", "--draft", str(moe),
                 "--window", "4") as (base, _, lines):
        assert any("runs through the stage runtime" in line for line in lines), "".join(lines)
        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        model = client.models.list().data[0].id
        for prompt, want in zip(PROMPTS, expected, strict=True):
            done = client.completions.create(model=model, prompt=prompt, max_tokens=TOKENS, temperature=0,
                                             extra_body={"ignore_eos": True})
            assert done.choices[0].text == want, prompt
            streamed = "".join(c.choices[0].text for c in client.completions.create(
                model=model, prompt=prompt, max_tokens=TOKENS, temperature=0, stream=True,
                extra_body={"ignore_eos": True}) if c.choices)
            assert streamed == want, prompt
        samples = {s.name: s.value for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text)
                   for s in family.samples}
        proposed = samples["inferencemesh_spec_decode_num_draft_tokens_total"]
        accepted = samples["inferencemesh_spec_decode_num_accepted_tokens_total"]
        assert proposed > 0 and accepted == proposed, (proposed, accepted)  # the draft is the target
