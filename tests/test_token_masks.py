"""Token masks: the wire frame round-trips exactly, malformed frames are refused with a message, and
applying masks leaves exactly the allowed tokens finite (padded columns never, empty rows an error)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from inferencemesh.token_masks import (
    allowed_tokens,
    apply_token_masks,
    is_allowed,
    mask_words,
    pack_token_masks,
    unpack_token_masks,
)


def random_masks(rng: np.random.Generator, positions: int, vocab: int, density: float = 0.1) -> np.ndarray:
    """Bitmasks whose allowed sets are random (never empty) subsets of range(vocab)."""
    bits = rng.random((positions, mask_words(vocab) * 32)) < density
    bits[:, vocab:] = False
    bits[np.arange(positions), rng.integers(0, vocab, positions)] = True
    return np.packbits(bits, axis=1, bitorder="little").view("<i4").astype(np.int32)


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 4096, 4100, 151_936])
def test_round_trip_is_exact(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    masks = random_masks(rng, 5, vocab)
    frame = pack_token_masks(torch.from_numpy(masks), vocab)
    assert len(frame) == 8 + 5 * mask_words(vocab) * 4
    back = unpack_token_masks(frame, vocab)
    assert back.dtype == torch.int32 and back.shape == (5, mask_words(vocab))
    assert np.array_equal(back.numpy(), masks)
    for row in range(5):
        ids = allowed_tokens(back[row])
        assert ids.max() < vocab
        assert all(is_allowed(back[row], int(t)) for t in ids[:50])


def test_the_frame_is_little_endian_whatever_the_host() -> None:
    masks = np.array([[1 | (1 << 9)]], dtype=np.int32)
    frame = pack_token_masks(masks, 10)
    assert frame == struct.pack("<II", 1, 10) + bytes([0x01, 0x02, 0, 0])


def test_pack_clears_bits_past_the_vocabulary() -> None:
    masks = np.full((2, 1), -1, dtype=np.int32)  # all 32 bits, vocab 20
    back = unpack_token_masks(pack_token_masks(masks, 20), 20)
    assert allowed_tokens(back[0]).tolist() == list(range(20))


@pytest.mark.parametrize(
    ("frame", "vocab", "message"),
    [
        (b"\x01\x00", None, "shorter than its 8-byte header"),
        (struct.pack("<II", 1, 64) + b"\x01\x00\x00\x00", None, "need 16"),
        (struct.pack("<II", 1, 32) + b"\x01\x00\x00\x00\x00", None, "need 12"),
        (struct.pack("<II", 1, 32) + b"\x01\x00\x00\x00", 64, "expected 64"),
        (struct.pack("<II", 0, 32), None, "claims 0 positions"),
        (struct.pack("<II", 1 << 20, 32), None, "positions"),
        (struct.pack("<II", 1, 0), None, "vocab_size 0"),
        (struct.pack("<II", 1, 20) + struct.pack("<I", 1 << 25), None, "past the vocabulary"),
        (struct.pack("<II", 2, 32) + struct.pack("<Ii", 1, 0), None, "row 1 allows no token"),
    ],
)
def test_malformed_frames_are_refused(frame: bytes, vocab: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        unpack_token_masks(frame, vocab)


def test_pack_refuses_wrong_shapes_and_types() -> None:
    with pytest.raises(ValueError, match="shape"):
        pack_token_masks(np.full((2, 3), -1, dtype=np.int32), 32)
    with pytest.raises(ValueError, match="int32"):
        pack_token_masks(np.full((2, 1), -1, dtype=np.int64), 32)
    with pytest.raises(ValueError, match="allows no token"):
        pack_token_masks(np.array([[1], [0]], dtype=np.int32), 32)
    with pytest.raises(ValueError, match="shape"):
        pack_token_masks(np.full((1,), -1, dtype=np.int32), 32)


@pytest.mark.parametrize("padded", [0, 1, 60])
def test_apply_leaves_exactly_the_allowed_tokens(padded: int) -> None:
    """Logits may be wider than the masks' vocabulary (padded embeddings): those columns are -inf."""
    rng = np.random.default_rng(padded)
    vocab = 4100
    masks = torch.from_numpy(random_masks(rng, 6, vocab, density=0.02))
    logits = torch.randn(6, vocab + padded, generator=torch.Generator().manual_seed(padded))
    logits[:, vocab:] = 1e4  # a padded column must lose even against the largest logit
    out = apply_token_masks(logits, masks)
    assert out is logits  # in place
    assert not torch.isnan(logits).any()
    for row in range(6):
        finite = torch.isfinite(logits[row]).nonzero().flatten().numpy()
        assert np.array_equal(finite, allowed_tokens(masks[row]))
        assert is_allowed(masks[row], int(logits[row].argmax()))
    assert torch.isfinite(torch.softmax(logits, dim=-1)).all()


def test_argmax_after_masking_is_always_allowed() -> None:
    rng = np.random.default_rng(7)
    for trial in range(50):
        vocab = int(rng.integers(2, 3000))
        masks = torch.from_numpy(random_masks(rng, 4, vocab, density=float(rng.random()) * 0.05))
        logits = torch.randn(4, vocab + int(rng.integers(0, 40)), generator=torch.Generator().manual_seed(trial))
        choice = apply_token_masks(logits, masks).argmax(dim=-1)
        assert all(is_allowed(masks[i], int(choice[i])) for i in range(4))


def test_a_row_allowing_nothing_is_an_error_not_nans() -> None:
    masks = torch.tensor([[1], [0]], dtype=torch.int32)
    logits = torch.zeros(2, 32)
    with pytest.raises(ValueError, match="row 1 allows no token"):
        apply_token_masks(logits, masks)
    assert not torch.isinf(logits).any()  # refused before touching the logits


def test_apply_refuses_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="2 mask rows for 3 logits rows"):
        apply_token_masks(torch.zeros(3, 64), torch.full((2, 2), -1, dtype=torch.int32))
    with pytest.raises(ValueError, match="cover more than"):
        apply_token_masks(torch.zeros(1, 40), torch.full((1, 3), -1, dtype=torch.int32))
    with pytest.raises(ValueError, match="past the logits' 40 columns"):
        apply_token_masks(torch.zeros(1, 40), torch.full((1, 2), -1, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        apply_token_masks(torch.zeros(1, 32), torch.ones(1, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="2-D"):
        apply_token_masks(torch.zeros(32), torch.ones(1, 1, dtype=torch.int32))


def rows_allowing(vocab: int, *allowed: set[int] | range) -> np.ndarray:
    bits = np.zeros((len(allowed), mask_words(vocab) * 32), dtype=bool)
    for row, tokens in enumerate(allowed):
        bits[row, list(tokens)] = True
    return np.packbits(bits, axis=1, bitorder="little").view("<i4").astype(np.int32)


@pytest.mark.parametrize("vocab", [32_768, 32_800, 151_936])
def test_rows_that_allow_or_forbid_few_tokens_travel_as_ids_and_round_trip(vocab: int) -> None:
    """One frame with every form: a row of one token, a row of a few, a row of half (its bitset), a row
    of all but a few, a row of all (no id forbidden); the few as ids (4 bytes each), the half as a bitset."""
    words = mask_words(vocab)
    few = {3, vocab // 2}  # within a 64th of the words at every vocabulary here
    masks = rows_allowing(vocab, {vocab - 1}, few, range(0, vocab, 2), set(range(vocab)) - few, range(vocab))
    frame = pack_token_masks(masks, vocab)
    assert len(frame) == 8 + 5 * 4 + 4 * (1 + len(few) + len(few)) + 4 * words
    back = unpack_token_masks(frame, vocab)
    assert np.array_equal(back.numpy(), masks)
    assert allowed_tokens(back[0]).tolist() == [vocab - 1] and allowed_tokens(back[4]).size == vocab


def test_a_small_vocabularys_rows_stay_bitsets() -> None:
    masks = rows_allowing(4096, {5}, range(4096))
    assert pack_token_masks(masks, 4096) == struct.pack("<II", 2, 4096) + masks.astype("<i4").tobytes()


def compact(vocab: int, *rows: tuple[int, int, list[int]]) -> bytes:
    """A compact frame built by hand: rows of (form, count, ids or words)."""
    body = b"".join(struct.pack("<I", form << 30 | count) + struct.pack(f"<{len(v)}I", *v) for form, count, v in rows)
    return struct.pack("<II", len(rows) | 1 << 31, vocab) + body


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (compact(64, (3, 1, [5])), "form 3"),
        (compact(64, (0, 1, [1, 0])), "form 0 of 1"),
        (compact(64, (1, 2, [5])), "past the frame"),
        (compact(64, (1, 2, [5, 5])), "not ascending"),
        (compact(64, (1, 2, [9, 5])), "not ascending"),
        (compact(64, (1, 1, [64])), "within the vocabulary"),
        (compact(64, (1, 1, [5]), (1, 1, [6]))[:-8], "before row 1"),
        (compact(64, (1, 1, [5])) + b"\0", "rows take"),
        (compact(64, (1, 0, [])), "row 0 allows no token"),
        (compact(2, (2, 2, [0, 1])), "row 0 allows no token"),
        (compact(40, (0, 0, [1, 1 << 9])), "past the vocabulary"),
    ],
)
def test_malformed_compact_frames_are_refused(frame: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        unpack_token_masks(frame)
