"""The native attention over a KV pool's block tables (modeling/native/paged_attention.c): every
session of a pass in one call, its new keys and values written into their slots, against sdpa over
the same keys and values joined in position order (grouped queries, head widths it specialises and
one it does not, a verify window's causal rows, a prompt piece from position 0, tables out of order,
a sliding window); a session's result the same bit for bit alone or in a batch and at any thread
count; what it refuses, refused; and the runtime taking it where it should (Mistral's windows
included), with the answers of the path it replaces."""

from __future__ import annotations

import pytest
import torch

from inferencemesh.modeling import native_kernels
from inferencemesh.modeling.kv import SessionKV
from inferencemesh.modeling.kv_pool import PAGED_MAX_QUERIES, BlockTableKV, KVPool, PagedFrames
from inferencemesh.modeling.positions import attention_mask
from inferencemesh.modeling.runtime import Segment, StageRuntime

pytestmark = pytest.mark.skipif(native_kernels.library() is None, reason="no C compiler or no AVX-512 here")

BLOCK = 4
CPU = torch.device("cpu")


def pool_of(kv_heads: int, dim: int, blocks: int = 64, seed: int = 0) -> KVPool:
    pool = KVPool(1, 0, kv_heads, dim, num_blocks=blocks, block_tokens=BLOCK, dtype=torch.float32, device=CPU)
    pool.store.copy_(torch.randn(pool.store.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


def frames_of(pool: KVPool, tables: list[list[int]], starts: list[int], counts: list[int]) -> PagedFrames:
    caches = []
    for table, start, count in zip(tables, starts, counts, strict=True):
        cache = BlockTableKV(pool, table, start, count)
        cache.begin(start, count)
        caches.append(cache)
    frames = PagedFrames.of(caches)
    assert frames is not None
    return frames


def reference(queries: torch.Tensor, pool: KVPool, table: list[int], start: int, scale: float,
              window: int | None = None) -> torch.Tensor:
    """sdpa over the session's keys and values gathered in position order, under the runtime's mask
    (positions.attention_mask, with its sliding window): [T, heads * D]."""
    count, heads, dim = queries.shape[1:]
    stop = start + count
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(stop)])
    keys, values = pool.store[0, 0][:, slots][None], pool.store[0, 1][:, slots][None]
    mask = attention_mask(start, count, window, CPU)
    if mask is None:  # one query over everything, or a prefill from 0: causal
        mask = (torch.arange(stop)[None, :] <= torch.arange(start, stop)[:, None])[None, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        queries.transpose(1, 2), keys, values, attn_mask=mask, scale=scale, enable_gqa=heads != keys.shape[1])
    return out.transpose(1, 2).reshape(count, heads * dim)


def fused_rows(rows: int, heads: int, kv_heads: int, dim: int, seed: int) -> torch.Tensor:
    """A layer's fused projection of `rows` tokens, [1, rows, heads + 2 kv_heads, dim]: what the kernel's
    queries, keys and values are views of."""
    return torch.randn(1, rows, heads + 2 * kv_heads, dim, generator=torch.Generator().manual_seed(seed))


def attend(fused: torch.Tensor, heads: int, frames: PagedFrames, scale: float, window: int | None = None
           ) -> torch.Tensor:
    kv_heads = (fused.shape[2] - heads) // 2
    queries, keys, values = fused.split_with_sizes((heads, kv_heads, kv_heads), dim=2)
    return native_kernels.paged_attention(queries, keys, values, frames.layer(0), BLOCK, frames.tables,
                                          frames.frames, scale, window)[0]


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "window"),
                         [(6, 2, 64, None), (4, 4, 128, None), (8, 1, 48, None), (2, 2, 256, None), (6, 2, 64, 7),
                          (4, 4, 128, 20)])
def test_every_session_equals_sdpa_over_its_joined_keys(heads, kv_heads, dim, window) -> None:
    pool = pool_of(kv_heads, dim)
    # A decode step deep in an out-of-order table, a verify window, a prompt piece from position 0,
    # and a block partly filled: each session's own table, some blocks shared.
    tables = [[9, 2, 30, 31, 5, 17, 40, 41, 8, 3], [11, 12, 13], [50, 49, 48, 47], [2, 30, 60]]
    starts, counts = [37, 6, 0, 9], [1, 5, 13, 1]
    frames = frames_of(pool, tables, starts, counts)
    fused = fused_rows(sum(counts), heads, kv_heads, dim, seed=1)
    scale = dim ** -0.5
    got = attend(fused, heads, frames, scale, window)
    row = 0
    for table, start, count in zip(tables, starts, counts, strict=True):
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + count)]
        for side, offset in ((0, heads), (1, heads + kv_heads)):  # the frame's rows written where it lives
            written = pool.store[0, side][:, slots].transpose(0, 1)
            assert torch.equal(written, fused[0, row:row + count, offset:offset + kv_heads])
        want = reference(fused[:, row:row + count, :heads], pool, table, start, scale, window)
        error = float((got[row:row + count] - want).abs().max() / want.abs().max())
        assert error < 2e-6, (start, count, error)
        row += count


def test_a_session_computes_the_same_bits_alone_in_a_batch_and_at_any_thread_count() -> None:
    pool = pool_of(2, 64)
    fused = fused_rows(9, 6, 2, 64, seed=2)
    tables, starts, counts = [[1, 2, 3, 4, 5, 6], [20, 21], [7, 30, 31, 9]], [21, 3, 10], [1, 4, 4]
    together = attend(fused, 6, frames_of(pool, tables, starts, counts), 0.125)
    alone = attend(fused[:, 1:5], 6, frames_of(pool, tables[1:2], starts[1:2], counts[1:2]), 0.125)
    assert torch.equal(together[1:5], alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = attend(fused, 6, frames_of(pool, tables, starts, counts), 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, one_thread)


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf"), 3e38, -3e38])
def test_a_poisoned_session_leaves_the_sessions_beside_it_untouched(poison) -> None:
    """NaN, infinities or huge numbers in one session's queries, new keys and values (a broken upstream
    stage's hidden state) stay in that session: the others in the same call compute the same bits as
    without it, and the call returns."""
    tables, starts, counts = [[1, 2, 3, 4, 5, 6], [20, 21], [7, 30, 31, 9]], [21, 3, 10], [1, 4, 4]
    clean = fused_rows(9, 6, 2, 64, seed=4)
    want = attend(clean, 6, frames_of(pool_of(2, 64), tables, starts, counts), 0.125)
    poisoned = clean.clone()
    poisoned[0, 1:5] = poison  # session 1's rows: queries, keys and values
    got = attend(poisoned, 6, frames_of(pool_of(2, 64), tables, starts, counts), 0.125)
    assert torch.equal(got[0:1], want[0:1]) and torch.equal(got[5:], want[5:])


def test_what_the_kernel_does_not_take_is_refused() -> None:
    assert native_kernels.takes_paged_attention(torch.float32, CPU, 64)
    assert not native_kernels.takes_paged_attention(torch.bfloat16, CPU, 64)  # a GPU's pool dtype
    assert not native_kernels.takes_paged_attention(torch.float32, CPU, 72)  # not a multiple of 16
    assert not native_kernels.takes_paged_attention(torch.float32, CPU, 512)  # beyond its registers
    assert not native_kernels.takes_paged_attention(torch.float32, torch.device("meta"), 64)
    pool = pool_of(2, 72)
    frames = frames_of(pool, [[1, 2]], [3], [1])
    with pytest.raises(RuntimeError, match="refused"):
        attend(fused_rows(1, 4, 2, 72, seed=3), 4, frames, 0.1)
    # frames past its query limit, or caches not over one pool, keep the other path
    long_frame = BlockTableKV(pool_of(2, 64, blocks=64), list(range(40)), 0, PAGED_MAX_QUERIES + 1)
    long_frame.begin(0, PAGED_MAX_QUERIES + 1)
    assert PagedFrames.of([long_frame]) is None
    assert PagedFrames.of([SessionKV(1, 0, 2, 64, dtype=torch.float32, device=CPU, max_context=64)]) is None


@pytest.mark.parametrize("family", ["llama", "mistral"])  # grouped queries; and a sliding window of 8
def test_the_runtime_attends_natively_with_the_answers_of_sdpa(tmp_path, monkeypatch, family) -> None:
    """Attention through the stage's real entry points: decode steps of two sessions batched, and a
    verify window, with the kernel and with it switched off."""
    from test_families import write  # the families' tiny random checkpoints

    path = write(tmp_path, family)
    native = StageRuntime(path, 0, 4, dtype="float32", device="cpu", max_context=128)
    assert native._paged
    calls = []
    real = native_kernels.paged_attention
    monkeypatch.setattr(native_kernels, "paged_attention",
                        lambda *args: calls.append(1) or real(*args))

    def run(rt: StageRuntime) -> list[torch.Tensor]:
        pool = rt.new_pool(32, block_tokens=BLOCK)
        tables = [[9, 3, 12, 5, 20, 1], [2, 14, 7, 30, 6]]
        prompts = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 6)]
        out = rt.forward_batch([Segment(BlockTableKV(pool, t, 0, len(p)), 0, p, "last")
                                for t, p in zip(tables, prompts, strict=True)])
        positions = [len(p) for p in prompts]
        for _ in range(4):  # decode steps, both sessions in one pass
            tokens = [o[-1].argmax().reshape(1) for o in out]  # type: ignore[union-attr]
            out = rt.forward_batch([Segment(BlockTableKV(pool, t, pos, 1), pos, tok, "last")
                                    for t, pos, tok in zip(tables, positions, tokens, strict=True)])
            positions = [pos + 1 for pos in positions]
        window = torch.tensor([5, 17, 42])  # a verify window of session 0, alone
        out.append(rt.forward(BlockTableKV(pool, tables[0], positions[0], 3), positions[0], token_ids=window,
                              logits="all"))
        return out  # type: ignore[return-value]

    got = run(native)
    assert calls, "the lean layers did not take the native attention"
    native._paged = False  # the same runtime through sdpa
    want = run(native)
    for g, w in zip(got, want, strict=True):
        assert float((g - w).abs().max() / w.abs().max()) < 1e-5
        assert torch.equal(g.argmax(-1), w.argmax(-1))
