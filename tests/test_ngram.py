"""The fast n-gram lookup returns exactly what the plain scan it replaced returns."""

from __future__ import annotations

import random

import pytest

from inferencemesh.frontend.engine.proposers.ngram import ngram_lookup


def reference_lookup(history: list[int], k: int, min_ngram: int = 2, max_ngram: int = 4) -> list[int]:
    """The original pure-Python scan (once in frontend/speculative.py), kept verbatim as the specification."""
    n = len(history)
    for size in range(min(max_ngram, n - 1), min_ngram - 1, -1):
        suffix = history[n - size :]
        for start in range(n - size - 1, -1, -1):
            if history[start : start + size] == suffix:
                follow = history[start + size : start + size + k]
                if follow:
                    return follow
    return []


@pytest.mark.parametrize("vocab", [1, 2, 3, 5, 20, 50_000])
def test_matches_reference_on_random_histories(vocab: int) -> None:
    rng = random.Random(vocab)
    for _ in range(1500):
        history = [rng.randrange(vocab) for _ in range(rng.randrange(0, 80))]
        k = rng.randrange(1, 10)
        lo = rng.randrange(1, 4)
        hi = rng.randrange(lo, 7)
        assert ngram_lookup(history, k, lo, hi) == reference_lookup(history, k, lo, hi), (history, k, lo, hi)


def test_matches_reference_on_long_repetitive_histories() -> None:
    rng = random.Random(7)
    for _ in range(40):
        # Text-like: a few repeated phrases among noise, thousands of tokens long.
        phrases = [[rng.randrange(200) for _ in range(rng.randrange(2, 9))] for _ in range(6)]
        history: list[int] = []
        while len(history) < 3000:
            history += rng.choice(phrases) if rng.random() < 0.6 else [rng.randrange(4096)]
        for k in (1, 4, 8):
            assert ngram_lookup(history, k) == reference_lookup(history, k)
            assert ngram_lookup(history, k, 1, 6) == reference_lookup(history, k, 1, 6)


@pytest.mark.parametrize(
    ("history", "k", "expected"),
    [
        ([], 3, []),
        ([7], 3, []),
        ([7, 7], 3, []),  # size 1 is below min_ngram
        ([7, 7, 7], 3, [7]),  # suffix [7, 7] at 0 overlaps itself; one token follows
        ([1, 2, 3, 4], 3, []),  # no repeat
        ([1, 2, 3, 1, 2], 3, [3, 1, 2]),  # k reaches into the suffix itself
        ([1, 2, 3, 1, 2], 10, [3, 1, 2]),  # k larger than the continuation
        ([1, 2, 3, 1, 2], 0, []),
        ([9, 1, 2, 5, 1, 2, 6, 1, 2], 2, [6, 1]),  # the latest match wins
        ([1, 2, 3, 7, 9, 2, 3, 8, 1, 2, 3], 2, [7, 9]),  # the longest size wins over a later match
        ([1, 2, 3, 4, 5, 8, 0, 2, 3, 4, 5, 7, 1, 2, 3, 4, 5], 2, [7, 1]),  # sizes capped at max_ngram (4)
        ([5, 5, 5, 5, 5], 3, [5]),  # the match right before the end leaves one token to follow
    ],
)
def test_edge_cases(history: list[int], k: int, expected: list[int]) -> None:
    assert reference_lookup(history, k) == expected  # the cases themselves are right
    assert ngram_lookup(history, k) == expected


def test_ids_that_are_not_code_points_fall_back_to_the_scan() -> None:
    # Surrogate code points, the last code point, and ids beyond Unicode or negative.
    for odd in (0xD800, 0xDFFF, 0x10FFFF, 0x110000, 2**40, -3):
        history = [odd, 4, odd, 5, 6, odd, 4, odd]
        assert ngram_lookup(history, 3) == reference_lookup(history, 3) == [5, 6, odd]
        assert ngram_lookup(history, 3, 1, 1) == reference_lookup(history, 3, 1, 1) == [4, odd]


@pytest.mark.parametrize(("lo", "hi"), [(0, 3), (-1, 2), (0, 0), (3, 2), (5, 9)])
def test_unusual_size_bounds(lo: int, hi: int) -> None:
    rng = random.Random(lo * 10 + hi)
    for n in range(0, 12):
        history = [rng.randrange(3) for _ in range(n)]
        assert ngram_lookup(history, 2, lo, hi) == reference_lookup(history, 2, lo, hi), (history, lo, hi)
