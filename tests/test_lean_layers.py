"""The lean decoder layers (modeling/lean_layers.py): adopted exactly where they compute what
transformers' layer does, and equal to the transformers-layer runtime through a stage's real
paths: a prefill, decode steps over a block table that is neither consecutive nor one view (a
gather, then spans), and a batched pass of several sessions."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from test_families import write  # noqa: E402  (the families' tiny random checkpoints)

from inferencemesh.modeling.kv_pool import BlockTableKV
from inferencemesh.modeling.lean_layers import LeanLayer, Probe
from inferencemesh.modeling.loader import load_stage
from inferencemesh.modeling.runtime import Segment, StageRuntime

LEAN_FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lean")


def runtimes(path: Path) -> tuple[StageRuntime, StageRuntime]:
    return tuple(StageRuntime(path, 0, 4, dtype="float32", device="cpu", max_context=128, lean=lean)  # type: ignore[return-value]
                 for lean in (True, False))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Summation order, not another computation: float32's rounding at the logits' scale."""
    return float((got - want).abs().max() / want.abs().max())


def decode(rt: StageRuntime, blocks: list[int], prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """A prefill, then greedy steps, each a frame over the pool as a stage runs it: the logits."""
    pool = rt.new_pool(32, block_tokens=4)
    rows = [rt.forward(BlockTableKV(pool, blocks, 0, len(prompt)), 0, token_ids=prompt)]
    pos = len(prompt)
    for _ in range(steps):
        token = torch.tensor([int(rows[-1][-1].argmax())])
        rows.append(rt.forward(BlockTableKV(pool, blocks, pos, 1), pos, token_ids=token))
        pos += 1
    return torch.cat(rows)


@pytest.mark.parametrize("family", LEAN_FAMILIES)
def test_lean_layers_are_adopted_and_equal_transformers_layers(root, family) -> None:
    lean, plain = runtimes(write(root, family))
    assert all(layer is not None for layer in lean._lean) and not any(plain._lean)
    prompt = torch.randint(3, 320, (10,), generator=torch.Generator().manual_seed(1))
    # Blocks out of order: the reads are gathers; the pool's runs are read span by span beyond
    # SPLIT_MIN_POSITIONS, which these short contexts never reach (test_block_table_kv covers it).
    blocks = [7, 3, 12, 5, 9, 1, 20]
    got, want = decode(lean, blocks, prompt, 12), decode(plain, blocks, prompt, 12)
    assert relative_error(got, want) < 1e-5
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def test_a_batched_pass_of_lean_layers_equals_transformers_layers(root) -> None:
    lean, plain = runtimes(write(root, "qwen3"))
    ids = [torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9, 1)]
    outs = []
    for rt in (lean, plain):
        pool = rt.new_pool(32, block_tokens=4)
        tables = [[0, 1, 2], [9, 4, 6], [15]]
        for blocks, prompt in zip(tables[:2], ids[:2], strict=True):  # two sessions hold a context already
            rt.forward(BlockTableKV(pool, blocks, 0, len(prompt)), 0, token_ids=prompt)
        segments = [Segment(BlockTableKV(pool, tables[0], 5, 2), 5, torch.tensor([4, 8]), logits="all"),
                    Segment(BlockTableKV(pool, tables[1], 9, 1), 9, torch.tensor([11])),
                    Segment(BlockTableKV(pool, tables[2], 0, 1), 0, ids[2])]
        outs.append(torch.cat(rt.forward_batch(segments)))  # type: ignore[arg-type]
    assert relative_error(outs[0], outs[1]) < 1e-5


@pytest.mark.parametrize("family", ["gemma2", "granite", "gpt_oss"])
def test_layers_of_another_shape_stay_transformers(root, family) -> None:
    """Soft-capped scores, multipliers around the residual, sinks: layers the lean form does not cover."""
    lean, _ = runtimes(write(root, family))
    assert not any(lean._lean)


def test_a_lean_layer_that_differs_from_its_layer_is_not_adopted(root, caplog) -> None:
    path = write(root, "llama")
    rt = StageRuntime(path, 0, 4, dtype="float32", device="cpu", max_context=128, lean=False)  # its rotary
    layer = load_stage(path, 0, 4, dtype="float32", device="cpu").layers[0]  # as loaded: nn.Linear
    rope = lambda x, start, count: rt._rope(x, start, count, None)  # noqa: E731
    probe = Probe.of(layer, rope)  # what the layer computes before anything of it is fused
    lean = LeanLayer(layer)
    assert lean.qkv.fused is not None  # float32 on the CPU: one fused matrix, in the layer's place too
    assert probe.same_output(lean) and Probe.of(layer, rope).same_output(lean)
    with torch.inference_mode():
        lean.input_norm[0][:1].mul_(1.5)  # one feature of the input norm off (the layer's own weight)
    with caplog.at_level(logging.WARNING, logger="inferencemesh.modeling.lean_layers"):
        assert not probe.same_output(lean)
    assert "differs from transformers'" in caplog.text


def test_an_adopted_layer_holds_its_projection_weights_once(root) -> None:
    """The fused matmuls take the linear layers' places: no nn.Linear is left holding a weight,
    and transformers' forward of the layer, through the slices, still computes the layer."""
    lean, plain = runtimes(write(root, "llama"))
    layer, fused = lean._layers[0], lean._lean[0]
    assert fused is not None and fused.qkv.fused is not None and fused.gate_up.fused is not None
    assert not [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    assert layer.self_attn.q_proj.fused is fused.qkv.fused and layer.mlp.up_proj.fused is fused.gate_up.fused
    assert layer.self_attn.o_proj is fused.o_proj.fused and layer.mlp.down_proj is fused.down_proj.fused
    x = torch.randn(1, 3, layer.input_layernorm.weight.shape[0], generator=torch.Generator().manual_seed(2))
    cos, sin = lean._rope(x, 0, 3, None)
    with torch.inference_mode():
        ours = layer(x, attention_mask=None, position_ids=torch.arange(3)[None], use_cache=False,
                     position_embeddings=(cos, sin))
        theirs = plain._layers[0](x, attention_mask=None, position_ids=torch.arange(3)[None], use_cache=False,
                                  position_embeddings=(cos, sin))
    ours, theirs = (o[0] if isinstance(o, tuple) else o for o in (ours, theirs))
    assert relative_error(ours, theirs) < 1e-5


def test_a_tied_head_is_packed_once_and_its_embedding_reads_the_same_vectors(root) -> None:
    """qwen2 here ties its head to its embedding: one stage holding both packs the matrix once, and
    the embedding reads its columns, the vectors the checkpoint's embedding holds."""
    path = write(root, "qwen2")
    rt = StageRuntime(path, 0, 4, dtype="float32", device="cpu", max_context=128)
    from transformers import AutoModelForCausalLM

    embedding = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).get_input_embeddings().weight
    ids = torch.tensor([0, 7, 319, 7])
    assert torch.equal(rt._embed(ids), embedding[ids])  # type: ignore[misc]
    assert rt._lm_head.packed.data_ptr() == rt._embed.columns.data_ptr()  # type: ignore[union-attr]


def test_where_nothing_packs_the_projections_are_fused_as_plain_matrices(root, monkeypatch) -> None:
    """A GPU's path (and a CPU's 16-bit one without oneDNN's units): the fused weights are one plain
    matrix each, computed by F.linear, and the layer equals transformers' layer as before."""
    from inferencemesh.modeling import lean_layers

    monkeypatch.setattr(lean_layers, "packs_weight", lambda weight: False)
    path = write(root, "qwen2")  # biases on q/k/v: the fused bias too
    lean = StageRuntime(path, 0, 4, dtype="float32", device="cpu", max_context=128, lean=True)
    monkeypatch.undo()
    plain = StageRuntime(path, 0, 4, dtype="float32", device="cpu", max_context=128, lean=False)
    layer = lean._lean[0]
    assert layer is not None and type(layer.qkv.fused).__name__ == "_Fused"
    assert layer.qkv.fused.fused_bias is not None and layer.o_proj.fused is None  # one module: itself
    prompt = torch.randint(3, 320, (7,), generator=torch.Generator().manual_seed(3))
    blocks = [4, 0, 9]
    got, want = decode(lean, blocks, prompt, 5), decode(plain, blocks, prompt, 5)
    assert relative_error(got, want) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_one_roll_is_transformers_rotary_bit_for_bit(dtype: torch.dtype) -> None:
    """x * cos + roll(x) * signed_sin against transformers' x * cos + rotate_half(x) * sin: the
    same products and sum (the sign is exact), so the same bits, queries and keys as one tensor."""
    from transformers.models.llama.modeling_llama import rotate_half

    from inferencemesh.modeling.lean_layers import _rotate, _signed_sin

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 5, 12, 64, generator=gen).to(dtype)
    cos, sin = (torch.randn(1, 5, 1, 64, generator=gen).to(dtype) for _ in range(2))
    assert torch.equal(_rotate(x, cos, _signed_sin(sin)), x * cos + rotate_half(x) * sin)
