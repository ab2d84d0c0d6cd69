"""The bundled models load offline with plain transformers and are fit for their jobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from inferencemesh.bundled import DEFAULT_MODEL, DRAFT_MODEL, bundled_path

OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def test_both_models_load_offline_share_a_vocabulary_and_generate() -> None:
    code = f"""
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from inferencemesh.bundled import bundled_path
target_dir, draft_dir = bundled_path({DEFAULT_MODEL!r}), bundled_path({DRAFT_MODEL!r})
tok, draft_tok = AutoTokenizer.from_pretrained(target_dir), AutoTokenizer.from_pretrained(draft_dir)
assert tok.get_vocab() == draft_tok.get_vocab(), "draft and target vocabularies differ"
assert tok.eos_token is not None and tok.chat_template
target = AutoModelForCausalLM.from_pretrained(target_dir)
draft = AutoModelForCausalLM.from_pretrained(draft_dir)
assert target.config.vocab_size == draft.config.vocab_size == len(tok)
assert target.config.num_hidden_layers >= 8 and draft.config.num_hidden_layers < target.config.num_hidden_layers
ids = tok("def add(a, b):\\n", return_tensors="pt").input_ids
out = target.generate(ids, max_new_tokens=16, do_sample=False)
text = tok.decode(out[0, ids.shape[1]:])
assert out.shape[1] > ids.shape[1] and text.strip(), text
print(repr(text))
"""
    run = subprocess.run([sys.executable, "-c", code], env=OFFLINE, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


def test_target_is_big_enough_and_draft_much_cheaper() -> None:
    target = json.loads((bundled_path(DEFAULT_MODEL) / "config.json").read_text())
    draft = json.loads((bundled_path(DRAFT_MODEL) / "config.json").read_text())

    def per_token_params(c: dict) -> int:  # matmul weights a decode step touches
        h, i, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
        kv = h * c["num_key_value_heads"] // c["num_attention_heads"]
        return layers * (2 * h * h + 2 * h * kv + 3 * h * i) + h * c["vocab_size"]

    ratio = per_token_params(target) / per_token_params(draft)
    assert 5 <= ratio <= 10, f"draft is {ratio:.1f}x cheaper per token"
    assert 4000 <= target["vocab_size"] <= 8192


def test_package_declares_the_draft() -> None:
    package = json.loads((bundled_path(DEFAULT_MODEL) / "model-package.json").read_text())
    spec = package["generation"]["speculative_decoding"]
    strategy = spec["strategies"][spec["default"]]
    assert strategy["type"] == "draft-model"
    assert (bundled_path(DEFAULT_MODEL) / strategy["draft_model"]).resolve() == bundled_path(DRAFT_MODEL).resolve()
    assert strategy["window_policy"] == {"default": "adaptive", "initial_window": 4, "min_window": 1, "max_window": 8}


@pytest.mark.parametrize("name", [DEFAULT_MODEL, DRAFT_MODEL])
def test_model_cards_report_the_facts(name: str) -> None:
    card = (bundled_path(name) / "README.md").read_text()
    for fact in ("seed", "corpus", "steps", "tokens seen", "held-out loss", "unigram baseline", "agreement",
                 "Greedy sample"):
        assert fact in card, f"{name} card lacks {fact!r}"


def test_weights_are_safetensors_in_half_precision_and_small() -> None:
    total = 0
    for name in (DEFAULT_MODEL, DRAFT_MODEL):
        files = list(bundled_path(name).iterdir())
        assert not [f for f in files if f.suffix in (".bin", ".pt", ".pth")]
        weights = bundled_path(name) / "model.safetensors"
        total += weights.stat().st_size
        assert json.loads((bundled_path(name) / "config.json").read_text())["dtype"] in ("bfloat16", "float16")
    assert total <= 40 * 1024 * 1024
