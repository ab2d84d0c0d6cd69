"""The stage runtime against transformers: exact greedy generation through 1-4 chained stages.

Every model here is a tiny random checkpoint written as multi-shard safetensors (tiny_models.py).
Chains run in-process, passing each stage's hidden states to the next, the way the gRPC
stages will.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import EOS_ID, FAMILIES, write_tiny_model
from transformers import AutoModelForCausalLM

from inferencemesh.modeling.runtime import PositionError, StageRuntime

NUM_LAYERS = 4
PROMPT_LEN = 21
NEW_TOKENS = 24
SPLITS = {  # number of stages -> layer boundaries
    1: [0, 4],
    2: [0, 2, 4],
    3: [0, 1, 3, 4],
    4: [0, 1, 2, 3, 4],
}


class Chain:
    """Stages run in order in-process; the last one's logits come back."""

    def __init__(self, model_dir: Path, bounds: list[int], **kwargs) -> None:
        self.stages = [StageRuntime(model_dir, a, b, **kwargs) for a, b in zip(bounds, bounds[1:], strict=False)]
        self.sessions = [s.new_session() for s in self.stages]

    def forward(self, pos: int, token_ids: torch.Tensor, logits: str = "last") -> torch.Tensor:
        out = token_ids
        for stage, kv in zip(self.stages, self.sessions, strict=True):
            if stage.is_first:
                out = stage.forward(kv, pos, token_ids=out, logits=logits)
            else:
                out = stage.forward(kv, pos, hidden=out, logits=logits)
        return out

    def greedy(self, prompt: torch.Tensor, new_tokens: int, *, chunk: int = 0, start: int = 0) -> list[int]:
        """Prefill prompt (in chunks of `chunk` if set) from position `start`, then greedy-decode."""
        pos = start
        for piece in prompt.split(chunk) if chunk else [prompt]:
            logits = self.forward(pos, piece)
            pos += len(piece)
        return self.decode(logits, pos, new_tokens)

    def decode(self, logits: torch.Tensor, pos: int, new_tokens: int) -> list[int]:
        tokens: list[int] = []
        while len(tokens) < new_tokens:
            token = int(logits[-1].argmax())
            tokens.append(token)
            if token == EOS_ID or len(tokens) == new_tokens:
                break
            logits = self.forward(pos, torch.tensor([token]))
            pos += 1
        return tokens


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread, and on a busy 2-core machine OpenMP's
    barrier between two threads makes each small op ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {f: write_tiny_model(root / f, f, num_layers=NUM_LAYERS, shards=3) for f in FAMILIES}


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(0, 256, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def reference(models, prompt) -> dict[str, list[int]]:
    """transformers generate() of the unsplit model, greedy, fp32."""
    out = {}
    for family, path in models.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        ids = model.generate(prompt[None], max_new_tokens=NEW_TOKENS, do_sample=False)
        out[family] = ids[0, PROMPT_LEN:].tolist()
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("num_stages", sorted(SPLITS))
def test_greedy_through_stages_equals_transformers(models, prompt, reference, family, num_stages):
    chain = Chain(models[family], SPLITS[num_stages], dtype="float32")
    assert len(reference[family]) == NEW_TOKENS  # the comparison covers the whole window
    assert chain.greedy(prompt, NEW_TOKENS) == reference[family]
    # The same prompt prefilled in uneven chunks (masks against a non-empty cache) gives the same tokens.
    chunked = Chain(models[family], SPLITS[num_stages], dtype="float32")
    assert chunked.greedy(prompt, NEW_TOKENS, chunk=6) == reference[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_window_logits_match_full_forward(models, prompt, reference, family):
    """logits='all' on a window of k tokens (speculative verification) equals transformers' logits."""
    model = AutoModelForCausalLM.from_pretrained(models[family], dtype=torch.float32)
    window = torch.tensor(reference[family][:5])
    full = torch.cat([prompt, window])
    with torch.no_grad():
        expected = model(full[None]).logits[0, PROMPT_LEN:]
    chain = Chain(models[family], SPLITS[2], dtype="float32")
    last = chain.forward(0, prompt)
    verify = chain.forward(PROMPT_LEN, window, logits="all")
    assert verify.shape == (5, chain.stages[-1].vocab_size) and verify.dtype == torch.float32
    torch.testing.assert_close(verify, expected, rtol=1e-4, atol=1e-4)
    # Each row predicts the next reference token: the window would be fully accepted.
    assert verify.argmax(-1).tolist() == reference[family][1:6]
    assert int(last.argmax()) == reference[family][0]


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_rollback_by_pos_start_recomputes_exactly(models, prompt, reference, family):
    """Decode ahead with wrong tokens (a rejected speculation), then a frame at an earlier pos_start."""
    ref = reference[family]
    chain = Chain(models[family], SPLITS[3], dtype="float32")
    logits = chain.forward(0, prompt)
    assert int(logits.argmax()) == ref[0]
    # Accept 4 correct tokens, then a speculative window of 6 tokens, all wrong after the first.
    pos = PROMPT_LEN
    chain.forward(pos, torch.tensor(ref[:4]))
    pos += 4
    bogus = torch.tensor([ref[4], 1, 2, 3, 4, 5])
    chain.forward(pos, bogus, logits="all")
    assert [kv.length for kv in chain.sessions] == [pos + 6] * 3
    # Only ref[4] is accepted: the next frame starts at pos + 1 and carries the correction.
    logits = chain.forward(pos + 1, torch.tensor([ref[5]]))
    assert [kv.length for kv in chain.sessions] == [pos + 2] * 3
    assert chain.decode(logits, pos + 2, NEW_TOKENS - 6) == ref[6:]
    # Rolling all the way back to position 0 re-prefills exactly too (Mistral crosses its window again).
    assert chain.greedy(prompt, NEW_TOKENS, chunk=8) == ref


def test_sessions_are_independent(models, prompt, reference):
    stage = StageRuntime(models["qwen3"], 0, NUM_LAYERS, dtype="float32")
    a, b = stage.new_session(), stage.new_session()
    other = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(1))
    la = stage.forward(a, 0, token_ids=prompt)
    stage.forward(b, 0, token_ids=other)
    tokens = []
    pos = PROMPT_LEN
    for _ in range(8):  # interleave: b's writes must not disturb a
        tokens.append(int(la.argmax()))
        stage.forward(b, b.length, token_ids=torch.tensor([3]))
        la = stage.forward(a, pos, token_ids=torch.tensor([tokens[-1]]))
        pos += 1
    assert tokens == reference["qwen3"][:8]


def test_last_logits_are_the_last_row_of_all(models, prompt):
    stage = StageRuntime(models["qwen2"], 0, NUM_LAYERS, dtype="float32")
    last = stage.forward(stage.new_session(), 0, token_ids=prompt)
    every = stage.forward(stage.new_session(), 0, token_ids=prompt, logits="all")
    assert last.shape == (1, stage.vocab_size) and every.shape == (PROMPT_LEN, stage.vocab_size)
    torch.testing.assert_close(last[0], every[-1], rtol=1e-5, atol=1e-5)


def test_stage_attributes_and_hidden_handoff(models, prompt):
    first = StageRuntime(models["llama"], 0, 1, dtype="bfloat16", max_context=64)
    last = StageRuntime(models["llama"], 1, NUM_LAYERS, dtype="float32", max_context=64)
    assert (first.is_first, first.is_last, last.is_first, last.is_last) == (True, False, False, True)
    assert (first.num_layers, first.hidden_size, first.vocab_size) == (NUM_LAYERS, 64, 320)
    assert first.dtype == torch.bfloat16 and first.device == torch.device("cpu") and first.max_context == 64
    assert first.facts.model_type == "llama" and first.config.num_hidden_layers == NUM_LAYERS
    hidden = first.forward(first.new_session(), 0, token_ids=prompt)
    assert hidden.shape == (PROMPT_LEN, 64) and hidden.dtype == torch.bfloat16
    # The next stage takes any float dtype and casts it to its own.
    logits = last.forward(last.new_session(), 0, hidden=hidden)
    assert logits.shape == (1, 320) and logits.dtype == torch.float32


def test_position_errors(models):
    stage = StageRuntime(models["llama"], 0, NUM_LAYERS, dtype="float32", max_context=32)
    kv = stage.new_session()
    stage.forward(kv, 0, token_ids=torch.arange(10))
    with pytest.raises(PositionError, match="beyond the 10 positions"):
        stage.forward(kv, 11, token_ids=torch.tensor([1]))
    with pytest.raises(PositionError, match="max_context 32"):
        stage.forward(kv, 10, token_ids=torch.arange(23))
    assert kv.length == 10  # refused frames leave the cache alone
    stage.forward(kv, 10, token_ids=torch.arange(22))  # exactly up to max_context is fine
    assert kv.length == 32
    assert issubclass(PositionError, ValueError)


def test_bad_inputs_are_value_errors(models):
    first = StageRuntime(models["llama"], 0, 2, dtype="float32")
    second = StageRuntime(models["llama"], 2, NUM_LAYERS, dtype="float32")
    kv1, kv2 = first.new_session(), second.new_session()
    for call in (
        lambda: first.forward(kv1, 0, hidden=torch.zeros(2, 64)),
        lambda: first.forward(kv1, 0, token_ids=torch.tensor([1, 320])),  # out of vocabulary
        lambda: first.forward(kv1, 0, token_ids=torch.tensor([-1])),
        lambda: first.forward(kv1, 0, token_ids=torch.tensor([1.0])),
        lambda: first.forward(kv1, 0, token_ids=torch.zeros(2, 2, dtype=torch.long)),
        lambda: first.forward(kv1, 0, token_ids=torch.tensor([], dtype=torch.long)),
        lambda: second.forward(kv2, 0, token_ids=torch.tensor([1])),
        lambda: second.forward(kv2, 0, hidden=torch.zeros(2, 63)),
        lambda: second.forward(kv2, 0, hidden=torch.zeros(2, 64), logits="some"),
    ):
        with pytest.raises(ValueError):
            call()
    assert kv1.length == kv2.length == 0


def test_kv_cache_grows_in_place_and_truncates_in_o1(models):
    stage = StageRuntime(models["qwen3"], 1, 3, dtype="float32", max_context=1024)
    kv = stage.new_session()
    assert kv.length == 0 and kv.nbytes() == 0
    hidden = torch.randn(300, 64)
    stage.forward(kv, 0, hidden=hidden[:100])
    assert kv.capacity == 256
    # 2 layers x (K + V) x 2 KV heads x 256 positions x head_dim 32 x 4 bytes
    assert kv.nbytes() == 2 * 2 * 2 * 256 * 32 * 4
    ptr = kv.positions(0, 100).data_ptr()
    before = kv.positions(0, 100).clone()  # every layer's keys and values
    kv.truncate(40)  # O(1): nothing moves, nothing is freed
    assert kv.length == 40 and kv.positions(0, 100).data_ptr() == ptr
    out_a = stage.forward(kv, 40, hidden=hidden[40:100])
    torch.testing.assert_close(kv.positions(0, 100), before)  # recomputing the same rows rewrites them
    stage.forward(kv, 100, hidden=hidden[100:300])  # crosses 256: grows once, geometrically
    assert kv.capacity == 512 and kv.length == 300
    torch.testing.assert_close(kv.positions(0, 100), before)  # contents survive growth
    fresh = stage.new_session()
    stage.forward(fresh, 0, hidden=hidden[:40])
    torch.testing.assert_close(stage.forward(fresh, 40, hidden=hidden[40:100]), out_a, rtol=1e-4, atol=1e-4)
    kv.release()
    assert kv.length == 0 and kv.nbytes() == 0
    stage.forward(kv, 0, hidden=hidden[:5])  # a released session starts over
    assert kv.length == 5


def test_bfloat16_split_equals_unsplit_and_tracks_float32(models, prompt, reference):
    """bf16 on CPU: KV cache kept in float32 (fast CPU attention); splitting changes nothing."""
    one = Chain(models["llama"], SPLITS[1], dtype="bfloat16")
    two = Chain(models["llama"], SPLITS[2], dtype="bfloat16")
    assert one.stages[0].dtype == torch.bfloat16
    tokens = one.greedy(prompt, 12)
    assert two.greedy(prompt, 12, chunk=5) == tokens
    assert one.sessions[0].positions(0, 1).dtype == torch.float32
    assert tokens[0] == reference["llama"][0]
    # Close to the float32 model (bf16 weights round; with these large random weights, tokens
    # drift apart after a few steps, so compare the first logits).
    wide = StageRuntime(models["llama"], 0, NUM_LAYERS, dtype="float32")
    expected = wide.forward(wide.new_session(), 0, token_ids=prompt)[0]
    got = one.stages[0].forward(one.stages[0].new_session(), 0, token_ids=prompt)[0]
    assert torch.nn.functional.cosine_similarity(got, expected, dim=0) > 0.995


def test_packed_linear_matches_nn_linear():
    from torch import nn

    from inferencemesh.modeling.packed import PackedLinear

    torch.manual_seed(0)
    # Within the dtype's rounding, not bit-exact: two CPU kernels accumulate in different orders
    # (in bf16, one ulp apart where the CPU has no native bf16 units). An output near zero has
    # ulps far finer than its inputs', so the absolute tolerance is in ulps at the outputs' scale:
    # two orders of k products' sums drift apart like a random walk, about sqrt(k) / 2 ulps.
    # float32 at both sides of ONEDNN_FLOAT32_MIN_WEIGHTS: MKL's [in, out] layout, then oneDNN's
    for dtype, (n, k) in ((torch.bfloat16, (80, 96)), (torch.float32, (80, 96)), (torch.float32, (400, 384))):
        linear = nn.Linear(k, n, bias=True).to(dtype)
        packed = PackedLinear(linear.weight, linear.bias)
        assert packed._mkldnn == (torch.backends.mkldnn.is_available() and (dtype != torch.float32 or n * k > 150_000))
        for rows in (1, 7):
            x = torch.randn(1, rows, k, dtype=dtype)
            with torch.inference_mode():
                want = linear(x)
                ulp = torch.finfo(dtype).eps * float(want.abs().max())
                atol = max(2, k ** 0.5 / 2) * ulp
                torch.testing.assert_close(packed(x), want, rtol=torch.finfo(dtype).eps, atol=atol)


def test_a_16_bit_weight_is_packed_only_where_onednn_packs_it():
    """Elsewhere the transposed layout would reach a 16-bit matmul kernel 15-20x slower than
    nn.Linear's (the stage's bfloat16 prefill was 10x slower than transformers' on AVX2)."""
    from torch import nn

    from inferencemesh.modeling.packed import onednn_packs, packs

    assert packs(nn.Linear(8, 8)) == torch.backends.mkldnn.is_available()  # float32: oneDNN's layout
    for dtype in (torch.bfloat16, torch.float16):
        assert packs(nn.Linear(8, 8).to(dtype)) == onednn_packs(dtype)


def test_length_dependent_rope_is_computed_per_forward(tmp_path, prompt):
    """Dynamic-NTK rope changes its frequencies past max_position_embeddings: no precomputed table."""
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    path = write_tiny_model(tmp_path / "dyn", "llama", max_position_embeddings=32, rope_parameters=rope)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = model.generate(prompt[None], max_new_tokens=NEW_TOKENS, do_sample=False)[0, PROMPT_LEN:].tolist()
    chain = Chain(path, SPLITS[2], dtype="float32")
    assert chain.stages[0]._rope_tables == {None: None}
    assert PROMPT_LEN + NEW_TOKENS > 32  # the decode crosses into the rescaled range
    assert chain.greedy(prompt, NEW_TOKENS) == expected


def test_prompt_piece_without_a_prediction_skips_the_head(models, prompt, reference):
    """logits='none' (a prompt chunk nobody wants a prediction for) returns nothing from the last
    stage but fills the caches exactly: decoding afterwards gives the reference tokens."""
    chain = Chain(models["llama"], SPLITS[2], dtype="float32")
    head, tail = prompt[:-3], prompt[-3:]
    assert chain.forward(0, head, logits="none") is None
    logits = chain.forward(len(head), tail)
    assert chain.decode(logits, PROMPT_LEN, NEW_TOKENS) == reference["llama"]
