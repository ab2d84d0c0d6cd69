"""Per-position token masks: their wire form and the one function that applies them to logits.

A constrained request's frontend computes, for each position of a verify window, which tokens the
grammar allows there; the last stage must never accept or sample any other. A mask is a bitmask
row of ceil(vocab / 32) int32 words, token t allowed iff bit (t % 32) of word (t // 32) is set
(llguidance's layout, so its masks travel without conversion).

Wire form (explicitly little-endian, independent of the host):

    uint32 positions | uint32 vocab_size | positions * ceil(vocab_size / 32) int32 words

or, when a row allows or forbids few tokens, with COMPACT set in the positions word, each row as a
uint32 header (its form in the top two bits, a count below them) and then

    BITS: ceil(vocab_size / 32) int32 words | ALLOWED, FORBIDDEN: count uint32 ids, ascending

A row goes as a list of ids when the list is at most a 64th of its words (COMPACT_SHARE) and the
vocabulary has 32,768 tokens or more (COMPACT_FROM_WORDS): a JSON schema's structural positions
allow a handful of tokens, so at a 151,936-token vocabulary such a row is a few bytes where its
bitset is 18,992. vocab_size is the tokenizer-side vocabulary the masks
were computed for; the receiver checks the frame against it and against its logits' width. A
model's padded embedding rows (logits wider than vocab_size) are never allowed.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

WORD_BITS = 32
_HEADER = struct.Struct("<II")  # positions, vocab_size
_ROW = struct.Struct("<I")  # a compact frame's row header: form << 30 | count
COMPACT = 1 << 31  # in the positions word: every row has a header
BITS, ALLOWED, FORBIDDEN = 0, 1, 2
_COUNT = (1 << 30) - 1
# A row goes as ids when they take at most 1/COMPACT_SHARE of its bitset's bytes: finding them costs
# about 0.2 us an id, so only rows of very few ids are worth it; a bitset row pays a popcount (5 us).
COMPACT_SHARE = 64
# ... and only where a bitset row is large (32,768 tokens and up): at the bundled 4,096 a compact row
# would save 500 bytes for about 30 us of packing and unpacking.
COMPACT_FROM_WORDS = 1024
# Bounds a frame's header may claim before anything is allocated for it.
MAX_MASK_POSITIONS = 1024
MAX_MASK_VOCAB = 1 << 24


def mask_words(vocab_size: int) -> int:
    """int32 words per mask row for a vocabulary of vocab_size tokens."""
    return (vocab_size + WORD_BITS - 1) // WORD_BITS


def _tail_bits(vocab_size: int) -> int:
    """The last word's bits that name tokens >= vocab_size, as an int32 value (0 if none)."""
    used = vocab_size % WORD_BITS
    if used == 0:
        return 0
    return int(np.array([(0xFFFFFFFF << used) & 0xFFFFFFFF], dtype=np.uint32).view(np.int32)[0])


def pack_token_masks(masks: torch.Tensor | np.ndarray, vocab_size: int) -> bytes:
    """[positions, mask_words(vocab_size)] int32 bitmasks -> the wire frame.

    Bits past vocab_size in the last word are cleared (they name no token); a row that allows
    nothing is refused, as the receiver would refuse it."""
    array = masks.detach().cpu().numpy() if isinstance(masks, torch.Tensor) else np.asarray(masks)
    if array.dtype != np.int32:
        raise ValueError(f"token masks must be int32, got {array.dtype}")
    if not 0 < vocab_size <= MAX_MASK_VOCAB:
        raise ValueError(f"vocab_size {vocab_size} is out of range (1..{MAX_MASK_VOCAB})")
    words = mask_words(vocab_size)
    if array.ndim != 2 or array.shape[1] != words or not 0 < array.shape[0] <= MAX_MASK_POSITIONS:
        raise ValueError(
            f"token masks must have shape [1..{MAX_MASK_POSITIONS}, {words}] for vocab_size {vocab_size}, "
            f"got {list(array.shape)}"
        )
    array = np.array(array, dtype="<i4", copy=True)
    tail = _tail_bits(vocab_size)
    if tail:
        array[:, -1] &= ~np.int32(tail)
    _check_rows(array)
    rows = [_compact_row(row, vocab_size) for row in array]
    if all(row is None for row in rows):
        return _HEADER.pack(array.shape[0], vocab_size) + array.tobytes()
    return _HEADER.pack(array.shape[0] | COMPACT, vocab_size) + b"".join(
        row if row is not None else _ROW.pack(BITS << 30) + array[i].tobytes() for i, row in enumerate(rows))


def _compact_row(row: np.ndarray, vocab_size: int) -> bytes | None:
    """The row as a header and a list of the ids it allows (or forbids), or None: its bitset is smaller."""
    if mask_words(vocab_size) < COMPACT_FROM_WORDS:
        return None
    most = mask_words(vocab_size) // COMPACT_SHARE
    allowed = _popcount(row)
    if allowed <= most:
        return _ROW.pack(ALLOWED << 30 | allowed) + _set_bits(row).astype("<u4").tobytes()
    if vocab_size - allowed <= most:
        forbidden = ~row
        forbidden[-1] &= ~np.int32(_tail_bits(vocab_size))
        return _ROW.pack(FORBIDDEN << 30 | vocab_size - allowed) + _set_bits(forbidden).astype("<u4").tobytes()
    return None


def _popcount(words: np.ndarray) -> int:
    counter = getattr(np, "bitwise_count", None)  # numpy >= 2
    if counter is not None:
        return int(counter(words.view(np.uint32)).sum())
    return int(np.unpackbits(words.view(np.uint8)).sum())


def _set_bits(words: np.ndarray) -> np.ndarray:
    """The positions of the set bits of little-endian int32 words, ascending (unpacking only nonzero words)."""
    nonzero = np.flatnonzero(words)
    bits = np.unpackbits(np.ascontiguousarray(words[nonzero], dtype="<i4").view(np.uint8), bitorder="little")
    word, bit = np.nonzero(bits.reshape(nonzero.size, WORD_BITS))
    return nonzero[word] * WORD_BITS + bit


def _unpack_compact(frame: bytes, positions: int, vocab_size: int) -> np.ndarray:
    """A compact frame's rows (after the header) as [positions, words] bitmasks."""
    words = mask_words(vocab_size)
    array = np.zeros((positions, words), dtype=np.uint32)
    offset = _HEADER.size
    for i in range(positions):
        if len(frame) < offset + 4:
            raise ValueError(f"token mask frame ends before row {i}'s header")
        (head,) = _ROW.unpack_from(frame, offset)
        form, count = head >> 30, head & _COUNT
        offset += 4
        size = 4 * (words if form == BITS else count)
        if form not in (BITS, ALLOWED, FORBIDDEN) or (form == BITS and count) or len(frame) < offset + size:
            raise ValueError(f"token mask row {i} has form {form} of {count}: malformed, or past the frame's "
                             f"{len(frame)} bytes")
        if form == BITS:
            array[i] = np.frombuffer(frame, dtype="<u4", count=words, offset=offset)
        else:
            ids = np.frombuffer(frame, dtype="<u4", count=count, offset=offset).astype(np.int64)
            if ids.size and (ids[-1] >= vocab_size or (ids.size > 1 and bool((ids[1:] <= ids[:-1]).any()))):
                raise ValueError(f"token mask row {i} lists ids that are not ascending within the vocabulary")
            bits = np.left_shift(np.uint32(1), (ids % WORD_BITS).astype(np.uint32))
            np.bitwise_or.at(array[i], ids // WORD_BITS, bits)
            if form == FORBIDDEN:
                array[i] = ~array[i]
                array[i, -1] &= ~np.uint32(_tail_bits(vocab_size) & 0xFFFFFFFF)
        offset += size
    if offset != len(frame):
        raise ValueError(f"token mask frame is {len(frame)} bytes; its {positions} rows take {offset}")
    return array.view(np.int32)


def unpack_token_masks(frame: bytes, vocab_size: int | None = None) -> torch.Tensor:
    """The wire frame -> a CPU int32 tensor [positions, mask_words(vocab_size)].

    vocab_size, when given, is what the receiver expects; a frame for another vocabulary is refused.
    Raises ValueError on any malformed frame (short, long, bits past the vocabulary, a row that
    allows nothing)."""
    if len(frame) < _HEADER.size:
        raise ValueError(f"token mask frame is {len(frame)} bytes, shorter than its {_HEADER.size}-byte header")
    positions, frame_vocab = _HEADER.unpack_from(frame)
    compact = bool(positions & COMPACT)
    positions &= ~COMPACT
    if vocab_size is not None and frame_vocab != vocab_size:
        raise ValueError(f"token masks are for a vocabulary of {frame_vocab}, expected {vocab_size}")
    if not 0 < positions <= MAX_MASK_POSITIONS:
        raise ValueError(f"token mask frame claims {positions} positions (1..{MAX_MASK_POSITIONS} allowed)")
    if not 0 < frame_vocab <= MAX_MASK_VOCAB:
        raise ValueError(f"token mask frame claims vocab_size {frame_vocab} (1..{MAX_MASK_VOCAB} allowed)")
    words = mask_words(frame_vocab)
    expected = _HEADER.size + positions * words * 4
    if compact:
        array = _unpack_compact(frame, positions, frame_vocab)
    elif len(frame) != expected:
        raise ValueError(
            f"token mask frame is {len(frame)} bytes; {positions} positions of vocab {frame_vocab} need {expected}"
        )
    else:
        array = np.frombuffer(frame, dtype="<i4", offset=_HEADER.size).reshape(positions, words).astype(np.int32)
    tail = _tail_bits(frame_vocab)
    if tail and (array[:, -1] & np.int32(tail)).any():
        raise ValueError(f"token masks allow tokens past the vocabulary of {frame_vocab}")
    _check_rows(array)
    return torch.from_numpy(array)


def _check_rows(array: np.ndarray) -> None:
    empty = np.flatnonzero(~array.any(axis=1))
    if empty.size:
        raise ValueError(f"token mask row {int(empty[0])} allows no token")


def allowed_tokens(mask_row: torch.Tensor | np.ndarray) -> np.ndarray:
    """The token ids one mask row allows, ascending (tests and diagnostics)."""
    row = mask_row.detach().cpu().numpy() if isinstance(mask_row, torch.Tensor) else np.asarray(mask_row)
    bits = np.unpackbits(np.ascontiguousarray(row, dtype="<i4").view(np.uint8), bitorder="little")
    return np.flatnonzero(bits)


def is_allowed(mask_row: torch.Tensor | np.ndarray, token: int) -> bool:
    """Whether one mask row allows token (False for ids outside the row)."""
    word, bit = divmod(token, WORD_BITS)
    if token < 0 or word >= mask_row.shape[-1]:
        return False
    return bool((int(mask_row[word]) >> bit) & 1)


def apply_token_masks(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Set every logit the masks disallow to -inf, IN PLACE; returns logits for chaining.

    logits: [positions, vocab] (any float dtype, any device), vocab >= the masks' vocabulary:
    columns past the masks (a model's padded embedding rows) are disallowed. masks: [positions,
    words] int32 (unpack_token_masks' tensor). A row that allows nothing raises ValueError rather
    than leaving a row of -inf that softmax would turn into NaN. The check runs on the masks'
    device: pass CPU masks (as unpacked) to keep it off the accelerator's stream."""
    if logits.dim() != 2 or masks.dim() != 2:
        raise ValueError(f"logits and masks must be 2-D, got {list(logits.shape)} and {list(masks.shape)}")
    if masks.dtype != torch.int32:
        raise ValueError(f"token masks must be int32, got {masks.dtype}")
    positions, vocab = logits.shape
    if masks.shape[0] != positions:
        raise ValueError(f"{masks.shape[0]} mask rows for {positions} logits rows")
    words = masks.shape[1]
    if words > mask_words(vocab):
        raise ValueError(f"masks of {words} words cover more than the logits' {vocab} columns")
    tail = _tail_bits(vocab) if words == mask_words(vocab) else 0
    if tail and bool((masks[:, -1] & tail).any()):
        raise ValueError(f"token masks allow tokens past the logits' {vocab} columns")
    if not bool(masks.any(dim=1).all()):
        empty = int((~masks.any(dim=1)).nonzero()[0, 0])
        raise ValueError(f"token mask row {empty} allows no token")
    masks = masks.to(logits.device, non_blocking=True)
    shifts = torch.arange(WORD_BITS, device=logits.device, dtype=torch.int32)
    allowed = ((masks.unsqueeze(-1) >> shifts) & 1).bool().reshape(positions, words * WORD_BITS)
    covered = min(vocab, words * WORD_BITS)
    logits[:, :covered].masked_fill_(~allowed[:, :covered], float("-inf"))
    logits[:, covered:] = float("-inf")
    return logits
