"""A second model family on the real cluster: a mixture-of-experts checkpoint from a PVC, served exact.

The rest of e2e/ serves the bundled Llama, which ships inside the images. This test shows the path
a user takes with a model of their own and another architecture:

  1. transformers writes a small random Qwen3-MoE checkpoint (4 layers, 4 experts, top-2) with
     its own config class and save_pretrained, beside the bundled model's tokenizer;
  2. the checkpoint goes onto a PersistentVolume (hostPath on the test node), bound to a claim in
     the mesh's namespace;
  3. an InferenceMesh names the claim (spec.model.pvc) and, since the operator never mounts a
     claim, the checkpoint's byte layout (spec.model.layout), computed here by the project's own
     checkpoint reader and planner;
  4. once Ready, a client pod sends greedy completions to the frontend's Service DNS name, and
     each text must equal transformers' own greedy generate() on the same files (float32).

It needs to run on the cluster's node (tools/cluster/up.sh's cluster, which sets
IMESH_E2E_CONTAINERD_ADDRESS): the test writes the volume's files itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from imesh_e2e import (
    PROMPTS,
    apply,
    delete_mesh,
    frontend_pod,
    get_json,
    mesh,
    mesh_doc,
    run_client_pod,
    wait_for,
    wait_ready,
)
from model_volume import CLIENT, add_tokenizer_and_open, claim_on, layout_of, node_folder

NAME = "moe"
SERVED = "tiny-qwen3-moe"
MAX_TOKENS = 24
# Tiny, but a real MoE: every layer routes each token to 2 of 4 experts. initializer_range 0.5
# makes the random logits large, so greedy output varies with the prompt and argmax ties (which
# float32 summation order could break either way) do not happen.
MOE_CONFIG = dict(
    vocab_size=4096,  # the bundled tokenizer's vocabulary (ids 0..4095)
    hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=4,
    max_position_embeddings=2048, initializer_range=0.5, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=0, pad_token_id=3,  # the bundled tokenizer's <|endoftext|> and <|pad|>
)


def write_checkpoint(path: Path) -> None:
    """A random Qwen3-MoE in safetensors, written by transformers itself, plus a tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_moe", **MOE_CONFIG)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    add_tokenizer_and_open(path)


def reference_texts(path: Path) -> dict[str, dict]:
    """transformers' greedy generate() on the checkpoint, tokenised and decoded as the frontend does
    (prompt with the tokenizer's special tokens; generation ends at the end-of-turn tokens the
    frontend stops on; text without special tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inferencemesh.frontend.openai.jobs import END_OF_TURN_TOKENS

    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab = tokenizer.get_vocab()
    stops = sorted({vocab[t] for t in END_OF_TURN_TOKENS if t in vocab} | {tokenizer.eos_token_id})
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        with torch.no_grad():
            seq = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)[0, len(ids):].tolist()
        stopped = bool(seq) and seq[-1] in stops
        new = seq[:-1] if stopped else seq
        out[prompt] = {"text": tokenizer.decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False),
                       "tokens": len(new), "finish_reason": "stop" if stopped else "length"}
    return out


@pytest.fixture(scope="module")
def checkpoint(settings: dict) -> Iterator[Path]:
    with node_folder(settings, "moe") as root:
        write_checkpoint(root / SERVED)
        yield root


@pytest.fixture(scope="module")
def claim(checkpoint: Path, mesh_namespace: str) -> Iterator[str]:
    with claim_on(mesh_namespace, "moe", checkpoint) as pvc:
        yield pvc


def test_moe_checkpoint_from_a_pvc_serves_transformers_greedy_text(settings: dict, mesh_namespace: str,
                                                                   checkpoint: Path, claim: str) -> None:
    ns, model_dir = mesh_namespace, checkpoint / SERVED
    expected = reference_texts(model_dir)
    # Guard the guard: a model that answered every prompt alike would prove little.
    assert len({r["text"] for r in expected.values()}) == len(PROMPTS), expected

    doc = mesh_doc(settings, NAME, small=True)
    doc["spec"]["model"] = {
        "name": SERVED, "servedModelName": SERVED, "dtype": "float32",
        "pvc": {"claimName": claim, "subPath": SERVED},  # mounted read-only at /models in every pod
        "layout": layout_of(model_dir),
    }
    doc["spec"]["stages"]["count"] = 2
    apply(ns, doc)
    try:
        wait_ready(ns, NAME, settings["timeout"])
        status = mesh(ns, NAME)["status"]
        (a, b), (c, d) = [(s["layerStart"], s["layerEnd"]) for s in status["stages"]]  # two stages, planned
        assert a == 0 and b == c and d == MOE_CONFIG["num_hidden_layers"], status["stages"]
        # One pipeline (spec.replicas defaults to the example's 1): the claim is mounted by its pods.
        assert status["pipelinesSummary"] == "1/1", status.get("pipelines")

        image = settings["frontend_image"] or frontend_pod(ns, NAME)["spec"]["containers"][0]["image"]
        got = run_client_pod(ns, "imesh-e2e-moe-client", image, settings["pull_policy"], status["endpoint"],
                             command=["python", "-c", CLIENT, status["endpoint"], SERVED, str(MAX_TOKENS),
                                      *PROMPTS])
        assert got == expected, json.dumps({"mesh": got, "transformers": expected}, indent=1)
    finally:
        delete_mesh(ns, NAME)
        # The claim's fixture deletes it next; wait for the pods that mount it to go first.
        wait_for(lambda: not get_json("pods", "-n", ns, "-l", f"inferencemesh.io/mesh={NAME}")["items"], 180,
                 "the MoE mesh's pods to be collected")
