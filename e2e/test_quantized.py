"""A quantized checkpoint from a PersistentVolume on the real cluster, kept quantized in 2 stage
pods and exact against a local `inferencemesh serve` of the same folder (issue 36); the stage
image's native CPU kernels load in its pods.

The checkpoint is the bundled model quantized W4A16 (INT4 weights, groups of 32, compressed-tensors'
`pack-quantized`, the format llm-compressor writes), made by compressed-tensors' own compressor as
the unit tests make it (tests/test_quantized_formats.py). It goes onto a PersistentVolume; the mesh
names the claim and the layout `inferencemesh plan --layout` computes for it, which counts the
packed bytes. Both sides compute the same integer kernels in the same dtype, so the greedy texts
must be equal, token for token.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from imesh_e2e import (
    PROMPTS,
    REPO,
    apply,
    delete_mesh,
    exec_python,
    frontend_pod,
    get_json,
    local_serve,
    mesh,
    mesh_doc,
    run_client_pod,
    stage_pod,
    wait_for,
    wait_ready,
)
from model_volume import BUNDLED, CLIENT, add_tokenizer_and_open, claim_on, layout_of, node_folder

NAME = "quant"
SERVED = "imesh-code-w4a16"
FORMAT = "w4a16"  # tests/test_quantized_formats.py's name for compressed-tensors W4A16, groups of 32
MAX_TOKENS = 24
DTYPE = "float32"  # the CPU stages' compute dtype for a 16-bit checkpoint on a node without bf16 units


def write_checkpoint(root: Path) -> Path:
    """The bundled model quantized by compressed-tensors, with the bundled tokenizer."""
    sys.path.insert(0, str(REPO / "tests"))
    from test_quantized_formats import write_quantized

    path = write_quantized(BUNDLED, root, FORMAT)
    path = path.rename(root / SERVED)
    add_tokenizer_and_open(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(settings: dict) -> Iterator[Path]:
    with node_folder(settings, "quant") as root:
        yield write_checkpoint(root)


@pytest.fixture(scope="module")
def claim(checkpoint: Path, mesh_namespace: str) -> Iterator[str]:
    with claim_on(mesh_namespace, "quant", checkpoint.parent) as pvc:
        yield pvc


def local_texts(model_dir: Path) -> dict[str, dict]:
    """The same prompts through a local 2-stage `serve` of the folder."""
    from openai import OpenAI

    out = {}
    with local_serve(DTYPE, stages=2, model=str(model_dir)) as base:
        client = OpenAI(base_url=base, api_key="unused", timeout=300, max_retries=0)
        for prompt in PROMPTS:
            reply = client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                              max_tokens=MAX_TOKENS, temperature=0)
            out[prompt] = {"text": reply.choices[0].text, "tokens": reply.usage.completion_tokens,
                           "finish_reason": reply.choices[0].finish_reason}
    return out


def test_a_quantized_checkpoint_from_a_pvc_serves_what_local_serve_does(settings: dict, mesh_namespace: str,
                                                                       checkpoint: Path, claim: str) -> None:
    ns = mesh_namespace
    expected = local_texts(checkpoint)
    assert len({r["text"] for r in expected.values()}) == len(PROMPTS), expected  # the prompts tell apart
    layout = layout_of(checkpoint, DTYPE)
    bf16 = layout_of(BUNDLED, DTYPE)
    # planned by its real bytes: INT4 weights and their scales, well under the 16-bit layers
    assert layout["layerBytes"] < 0.5 * bf16["layerBytes"], (layout, bf16)

    doc = mesh_doc(settings, NAME, small=True)
    doc["spec"]["model"] = {"name": SERVED, "servedModelName": SERVED, "dtype": DTYPE,
                            "pvc": {"claimName": claim, "subPath": SERVED}, "layout": layout}
    doc["spec"]["stages"]["count"] = 2
    apply(ns, doc)
    try:
        wait_ready(ns, NAME, settings["timeout"])
        status = mesh(ns, NAME)["status"]
        assert len(status["stages"]) == 2, status["stages"]
        # the image's native CPU kernels, compiled when it was built, load in a stage pod (which
        # has no compiler) as they do in this process
        from inferencemesh.modeling import native_kernels

        pod = stage_pod(ns, NAME, 0)["metadata"]["name"]
        found = exec_python(ns, pod, "from inferencemesh.modeling import native_kernels as n; "
                                     "print(n.library() is not None, n.bfloat16_dots())")
        assert found.returncode == 0, found.stderr
        assert found.stdout.split() == [str(native_kernels.library() is not None), str(native_kernels.bfloat16_dots())]
        image = settings["frontend_image"] or frontend_pod(ns, NAME)["spec"]["containers"][0]["image"]
        got = run_client_pod(ns, "imesh-e2e-quant-client", image, settings["pull_policy"], status["endpoint"],
                             command=["python", "-c", CLIENT, status["endpoint"], SERVED, str(MAX_TOKENS), *PROMPTS])
        assert got == expected, json.dumps({"mesh": got, "local serve": expected}, indent=1)
    finally:
        delete_mesh(ns, NAME)
        wait_for(lambda: not get_json("pods", "-n", ns, "-l", f"inferencemesh.io/mesh={NAME}")["items"], 180,
                 "the quantized mesh's pods to be collected")
