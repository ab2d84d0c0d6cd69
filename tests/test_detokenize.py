"""Incremental detokenization: the DecodeStream fast path streams exactly what the window algorithm did.

The reference below is the frontend's detokenizer as it was before DecodeStream, kept verbatim. The
new one must produce the same pieces for the same token chunks: on the bundled byte-level BPE
tokenizer, and on small SentencePiece-style and WordPiece tokenizers built here whose decoders are
not plain concatenation (a window-leading space is stripped; WordPiece's cleanup rewrites text
already decoded, which DecodeStream reports as an invalid prefix).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from inferencemesh.bundled import DEFAULT_MODEL, bundled_path
from inferencemesh.frontend.openai.text import detokenize
from inferencemesh.frontend.openai.text.detokenize import IncrementalDetokenizer
from inferencemesh.frontend.openai.text.stop_strings import OutputText, StopStringMatcher

REPLACEMENT_CHAR = "\ufffd"


class ReferenceDetokenizer:
    """The window algorithm as it was (two tokenizer.decode calls per step)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[int]) -> None:
        self._tok = tokenizer
        self._ids: list[int] = list(prompt_ids[-5:])
        self._prefix = 0
        self._read = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _delta(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        full_text = self._decode(self._ids[self._prefix:])
        if len(full_text) <= len(prefix_text) or (not final and full_text.endswith(REPLACEMENT_CHAR)):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full_text[len(prefix_text):]

    def add(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        return self._delta(final=False)

    def flush(self) -> str:
        return self._delta(final=True)


class ReferenceOutputText:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[int], stops: Sequence[str]) -> None:
        self._detok = ReferenceDetokenizer(tokenizer, prompt_ids)
        self._stops = StopStringMatcher(stops)
        self.stopped = False

    def add_tokens(self, ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        out, self.stopped = self._stops.push(self._detok.add(ids))
        return out

    def finish(self) -> str:
        if self.stopped:
            return ""
        out, self.stopped = self._stops.push(self._detok.flush())
        return out if self.stopped else out + self._stops.flush()


# --- tokenizers -------------------------------------------------------------------------------


def bundled() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(bundled_path(DEFAULT_MODEL))


def sentencepiece_like() -> PreTrainedTokenizerBase:
    """Llama-2 / Mistral style: '▁' for spaces, byte fallback, one leading space stripped per decode."""
    pieces = ["▁", "▁▁", "▁the", "the", "▁a", "a", "b", "▁b", "é", "▁日本", "語", "\n", "x", REPLACEMENT_CHAR,
              "▁" + REPLACEMENT_CHAR]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    vocab |= {p: 259 + i for i, p in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def metaspace() -> PreTrainedTokenizerBase:
    """T5 style: the Metaspace decoder drops the space of the first token of every decode."""
    vocab = {"<unk>": 0, "</s>": 1} | {p: 2 + i for i, p in enumerate(["▁", "▁a", "a", "▁b", "b", "▁▁", "c"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "</s>")])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


def wordpiece() -> PreTrainedTokenizerBase:
    """BERT style: cleanup turns "do n't" into "don't", changing text that was already decoded."""
    words = ["[UNK]", "[CLS]", "a", "##b", ".", "'", "s", "m", "do", "n", "##'t", "n't", "?", "!", ",", "##s", "can"]
    tok = Tokenizer(models.WordPiece(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.add_special_tokens([AddedToken("[CLS]", special=True)])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]")


class PostProcessingTokenizer(PreTrainedTokenizerFast):
    """A model tokenizer whose decode() differs from the Rust decode: it must keep the plain path."""

    def _decode(self, token_ids, skip_special_tokens: bool = False, **kwargs) -> str:  # type: ignore[override]
        return super()._decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()


def post_processing() -> PreTrainedTokenizerBase:
    return PostProcessingTokenizer(tokenizer_object=bundled().backend_tokenizer, eos_token="<|endoftext|>")


TOKENIZERS: dict[str, Callable[[], PreTrainedTokenizerBase]] = {
    "bundled": bundled, "sentencepiece": sentencepiece_like, "metaspace": metaspace, "wordpiece": wordpiece,
    "post-processing": post_processing,
}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerBase:
    return TOKENIZERS[request.param]()


# --- helpers ----------------------------------------------------------------------------------


def chunked(ids: list[int], rng: random.Random) -> list[list[int]]:
    """Split ids as a speculative engine yields them: one to a few tokens per step."""
    out, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3, 5])
        out.append(ids[i : i + n])
        i += n
    return out


def stream(detok: IncrementalDetokenizer | ReferenceDetokenizer, chunks: list[list[int]]) -> list[str]:
    return [detok.add(chunk) for chunk in chunks] + [detok.flush()]


def random_ids(tokenizer: PreTrainedTokenizerBase, rng: random.Random, n: int) -> list[int]:
    vocab = len(tokenizer)
    specials = tokenizer.all_special_ids
    return [rng.choice(specials) if specials and rng.random() < 0.05 else rng.randrange(vocab) for _ in range(n)]


TEXTS = [
    "naïve café — ✓ 日本語 🚀 done",
    "def f(x):\n    return x  # ünïcödé\n\n\nprint(f('日本'))\n",
    "emoji 👩‍👩‍👧 flags 🇫🇷🇯🇵 and math ∑∫√ and the end",
    "abc \ufffd literal replacement chars \ufffd",
]


# --- the fast path is the old algorithm -------------------------------------------------------


def test_random_token_streams_match_reference(tokenizer: PreTrainedTokenizerBase) -> None:
    rng = random.Random(1)
    for _ in range(300):
        prompt = random_ids(tokenizer, rng, rng.randrange(0, 9))
        chunks = chunked(random_ids(tokenizer, rng, rng.randrange(1, 40)), rng)
        expected = stream(ReferenceDetokenizer(tokenizer, prompt), chunks)
        assert stream(IncrementalDetokenizer(tokenizer, prompt), chunks) == expected, (prompt, chunks)


@pytest.mark.parametrize("text", TEXTS)
def test_text_streams_match_reference_at_every_prompt_split(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    """Every split point, including prompts that end inside a character or in a literal U+FFFD."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    rng = random.Random(text)
    for cut in range(len(ids)):
        chunks = chunked(ids[cut:], rng)
        expected = stream(ReferenceDetokenizer(tokenizer, ids[:cut]), chunks)
        assert stream(IncrementalDetokenizer(tokenizer, ids[:cut]), chunks) == expected, cut


def test_output_text_matches_reference(tokenizer: PreTrainedTokenizerBase) -> None:
    rng = random.Random(2)
    texts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in TEXTS] * 10
    for ids in texts + [random_ids(tokenizer, rng, 30) for _ in range(100)]:
        decoded = tokenizer.decode(ids, skip_special_tokens=True)
        if not decoded:
            continue  # a toy tokenizer that cannot encode this text
        start = rng.randrange(len(decoded))
        stops = [decoded[start : start + rng.randrange(1, 4)], "never seen"]
        chunks = chunked(ids, rng)
        ref, new = ReferenceOutputText(tokenizer, [], stops), OutputText(tokenizer, [], stops)
        for chunk in chunks:
            assert new.add_tokens(chunk) == ref.add_tokens(chunk), (ids, stops)
            assert new.stopped == ref.stopped
        assert new.finish() == ref.finish() and new.stopped == ref.stopped


# --- properties of the stream itself (bundled tokenizer) --------------------------------------


@pytest.mark.parametrize("text", TEXTS[:3])
def test_split_characters_never_show_replacement_chars(text: str) -> None:
    tok = bundled()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert any(REPLACEMENT_CHAR in tok.decode([i]) for i in ids), "the text must split a character across tokens"
    rng = random.Random(3)
    for _ in range(20):
        out = OutputText(tok, [], [])
        pieces = [out.add_tokens(chunk) for chunk in chunked(ids, rng)] + [out.finish()]
        assert "".join(pieces) == text
        assert not any(REPLACEMENT_CHAR in p for p in pieces)


def test_stop_string_inside_multibyte_text_is_cut_exactly() -> None:
    tok = bundled()
    text = "naïve café — ✓ 日本語 🚀 done"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    rng = random.Random(4)
    for stop in ["本語", "🚀", "é —", "done"]:
        for _ in range(10):
            out = OutputText(tok, [], [stop])
            emitted = ""
            for chunk in chunked(ids, rng):
                emitted += out.add_tokens(chunk)
                assert stop not in emitted and REPLACEMENT_CHAR not in emitted
                if out.stopped:
                    break
            assert out.stopped and out.finish() == ""
            assert emitted == text[: text.find(stop)]


def test_prompt_context_sets_the_first_tokens_spacing() -> None:
    # SentencePiece-style decoders drop a decode's leading space: the prompt tail keeps it.
    tok = sentencepiece_like()
    the, a = tok.convert_tokens_to_ids(["▁the", "▁a"])
    assert IncrementalDetokenizer(tok, [a]).add([the]) == " the"
    assert IncrementalDetokenizer(tok, []).add([the]) == "the"


# --- the fast path is really taken ------------------------------------------------------------


def test_fast_tokenizers_stream_through_decode_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    stream_class = detokenize._DECODE_STREAM
    assert stream_class is not None, "the installed tokenizers has a usable DecodeStream"
    served = []

    class CountingStream:
        def __init__(self, **kwargs) -> None:
            self._stream = stream_class(**kwargs)

        def step(self, tokenizer: Tokenizer, ids: list[int]) -> str | None:
            piece = self._stream.step(tokenizer, ids)
            served.append(piece is not None)
            return piece

    monkeypatch.setattr(detokenize, "_DECODE_STREAM", CountingStream)
    tok = bundled()
    code = "def area(width, height):\n    return width * height  # in square metres\n\n\n" * 10
    ids = tok(code, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok, ids[:3])
    assert "".join(detok.add([i]) for i in ids[3:]) + detok.flush() == tok.decode(ids[3:])
    # ASCII text never holds a character back: every step is a DecodeStream step that emits.
    assert len(served) == len(ids) - 3 and all(served)
    # Where characters are split, the plain path takes the held-back steps and hands back after.
    served.clear()
    ids = tok(TEXTS[1] * 5, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(detok.add([i]) for i in ids) + detok.flush() == TEXTS[1] * 5
    assert not all(served) and sum(served) > len(ids) / 2


def test_tokenizers_that_post_process_decode_keep_the_plain_path() -> None:
    tok = post_processing()
    assert detokenize._rust_tokenizer(tok) is None
    assert detokenize._rust_tokenizer(bundled()) is not None
    ids = tok("shout this", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(detok.add([i]) for i in ids) + detok.flush() == "SHOUT THIS"
