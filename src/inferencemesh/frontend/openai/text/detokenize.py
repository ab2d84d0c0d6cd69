"""Token ids -> text deltas for streaming.

Decoding token by token is wrong for two reasons: a byte-level BPE token can hold half of a
UTF-8 character, and some decoders (SentencePiece's leading space) depend on the previous
token. So we decode a small window twice, as vLLM and TGI do, and emit the difference only
once it no longer ends in U+FFFD. With a fast tokenizer the same algorithm runs inside
tokenizers' DecodeStream, one Rust call per step instead of two decode() calls.

Tokens are only ever appended: the engine yields verified tokens, never drafts it may roll back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

if TYPE_CHECKING:
    from tokenizers import Tokenizer

PROMPT_CONTEXT_TOKENS = 5  # prompt tail decoded with the output so the first token's spacing is right
REPLACEMENT_CHAR = "\ufffd"


def _usable_decode_stream() -> Any:
    """tokenizers' DecodeStream class if it takes a prefilled window and lists of ids (>= 0.22), else None."""
    try:
        from tokenizers.decoders import DecodeStream

        DecodeStream(ids=[], skip_special_tokens=True)
    except (ImportError, TypeError):
        return None
    return DecodeStream


_DECODE_STREAM = _usable_decode_stream()


def _rust_tokenizer(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    """The Rust tokenizer behind `tokenizer` if its decode() is exactly the Rust decode, else None."""
    if not isinstance(tokenizer, PreTrainedTokenizerFast) or _DECODE_STREAM is None:
        return None
    cls = type(tokenizer)
    # A few model tokenizers (Whisper, Wav2Vec2, ...) post-process decode(): DecodeStream would not.
    if cls.decode is not PreTrainedTokenizerFast.decode or cls._decode is not PreTrainedTokenizerFast._decode:
        return None
    return tokenizer.backend_tokenizer


class IncrementalDetokenizer:
    """The window algorithm; a DecodeStream takes over the steps where it provably agrees with it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[int]) -> None:
        self._tok = tokenizer
        self._rust = _rust_tokenizer(tokenizer)
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix = 0  # start of the decode window
        self._read = len(self._ids)  # ids before this have been emitted
        self._stream: Any = None  # a DecodeStream while it runs the steps
        self._start_stream()

    def _decode(self, ids: list[int]) -> str:
        if self._rust is not None:  # what tokenizer.decode returns (see _rust_tokenizer), minus its overhead
            return self._rust.decode(ids, skip_special_tokens=True)
        return str(self._tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))

    def _delta(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        full_text = self._decode(self._ids[self._prefix:])
        if len(full_text) <= len(prefix_text) or (not final and full_text.endswith(REPLACEMENT_CHAR)):
            return ""  # nothing new yet, or an incomplete character: wait for the next token
        self._prefix, self._read = self._read, len(self._ids)
        return full_text[len(prefix_text):]

    def _start_stream(self) -> None:
        """Hand the next steps to a DecodeStream; called only when nothing is pending (read == len(ids)).

        Prefilled with our window, a DecodeStream takes the window's text as emitted and its end as
        the read point, as we do, unless that text ends in U+FFFD: then it would emit it again.
        """
        if self._rust is None:
            return
        window = self._ids[self._prefix:self._read]
        if not self._decode(window).endswith(REPLACEMENT_CHAR):
            self._stream = _DECODE_STREAM(ids=window, skip_special_tokens=True)

    def add(self, ids: Sequence[int]) -> str:
        """Append new token ids; return the text that is now certain."""
        self._ids.extend(ids)
        if self._stream is not None:
            try:
                piece = self._stream.step(self._rust, list(ids))
            except Exception:  # the decoder rewrote text already emitted (InvalidPrefix), or an odd id
                piece = None
            if piece is not None:  # exactly _delta's text: same window, same prefix text
                self._prefix, self._read = self._read, len(self._ids)
                return piece
            # It holds text back. Leave it: with tokens pending it can drift from our window (it
            # re-anchors windows whose text is empty, and compares lengths in UTF-8 bytes, not
            # characters). The window algorithm decides; the next emission starts a new stream.
            self._stream = None
        piece = self._delta(final=False)
        if piece:
            self._start_stream()
        return piece

    def flush(self) -> str:
        """Generation ended: return whatever is still held back (even an incomplete character)."""
        self._stream = None
        return self._delta(final=True)
