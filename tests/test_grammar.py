"""SessionGrammar on the bundled tokenizer: speculative windows never let a forbidden token through.

Each schema is decoded by a seeded random walk that plays both sides of speculative decoding:
a proposer draws k drafts (mostly allowed ones, some random tokens), window_masks cuts the
window at the first forbidden draft, a verifier accepts a random prefix of what is left and
samples the bonus token from its mask, and the grammar commits exactly those tokens. The text
must then parse and validate: the masks alone kept it inside the constraint.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch
import transformers

from inferencemesh.bundled import DEFAULT_MODEL, bundled_path
from inferencemesh.frontend.engine import grammar as grammar_module
from inferencemesh.frontend.engine.constraints import Constraint, ConstraintKind
from inferencemesh.frontend.engine.errors import ConstraintError
from inferencemesh.frontend.engine.grammar import (
    ConstrainedOutput,
    GrammarTokenizer,
    GrammarViolation,
    SessionGrammar,
    constraint_matcher,
    grammar_tokenizer,
)
from inferencemesh.frontend.openai.structured_outputs import constraint_from_request
from inferencemesh.token_masks import (
    allowed_tokens,
    apply_token_masks,
    is_allowed,
    pack_token_masks,
    unpack_token_masks,
)

VOCAB = 4096  # the bundled target's config vocab_size
K = 4  # drafts per window
SOFT_LIMIT = 60  # tokens after which the walk steers toward ending the output
HARD_LIMIT = 1500


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    path: Path = bundled_path(DEFAULT_MODEL)
    return transformers.AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def tokenizer(hf_tokenizer: Any) -> GrammarTokenizer:
    return grammar_tokenizer(hf_tokenizer, VOCAB)


@pytest.fixture(scope="module")
def texts(hf_tokenizer: Any) -> list[str]:
    return [hf_tokenizer.decode([i]) for i in range(VOCAB)]


def session(tokenizer: GrammarTokenizer, **fields: Any) -> SessionGrammar:
    constraint = constraint_from_request(**fields)
    assert isinstance(constraint, Constraint)
    return SessionGrammar(constraint, tokenizer)


class Walker:
    """Picks tokens uniformly among the allowed ones; past SOFT_LIMIT it prefers EOS, then tokens
    that only close things, then tokens that open nothing, so every walk ends."""

    CLOSERS = set('"]}):, ')
    OPENERS = set("[{(")

    def __init__(self, texts: list[str], eos: int, seed: int) -> None:
        self.texts, self.eos, self.rng = texts, eos, np.random.default_rng(seed)

    def pick(self, mask: torch.Tensor, length: int) -> int:
        ids = allowed_tokens(mask)
        assert ids.size, "a mask that allows nothing"
        if length >= SOFT_LIMIT:
            if self.eos in ids:
                return self.eos
            tiers: list[Callable[[str], bool]] = [
                lambda t: bool(t.strip()) and set(t) <= self.CLOSERS - {","},
                lambda t: bool(t.strip()) and set(t) <= self.CLOSERS,
                lambda t: bool(t.strip()) and not set(t) & self.OPENERS,
            ]
            for keep in tiers:
                preferred = [i for i in ids if keep(self.texts[i])]
                if preferred:
                    return int(self.rng.choice(preferred))
        return int(self.rng.choice(ids))

    def drafts(self, grammar: SessionGrammar, length: int) -> tuple[list[int], int]:
        """K drafts and the index of the first one the grammar forbids (K if none)."""
        drafts: list[int] = []
        first_bad = K
        for i in range(K):
            mask = grammar.mask_after(drafts) if first_bad == K else None
            if mask is None or self.rng.random() < 0.2:
                token = int(self.rng.integers(0, VOCAB + 8))  # random, sometimes past the vocabulary
            else:
                token = self.pick(mask[0], length + i)
            if first_bad == K and (mask is None or not is_allowed(mask[0], token)):
                first_bad = i
            drafts.append(token)
            if first_bad == K and token == self.eos:
                first_bad = i + 1  # nothing follows EOS
        return drafts, first_bad


def speculative_walk(
    grammar: SessionGrammar, texts: list[str], seed: int, stats: dict[str, int] | None = None
) -> list[int]:
    """Decode to EOS through windows of K drafts; returns the committed tokens (EOS last).
    stats, when given, counts windows kept whole and windows cut short."""
    eos = grammar.tokenizer.eos_token_ids[0]
    stats = {} if stats is None else stats
    walker = Walker(texts, eos, seed)
    out: list[int] = []
    while len(out) < HARD_LIMIT:
        drafts, expected_usable = walker.drafts(grammar, len(out))
        before = grammar.window_masks([])[0]
        masks, usable = grammar.window_masks(drafts)
        assert usable == expected_usable, (drafts, usable, expected_usable)
        outcome = "whole" if usable == K else "cut"
        stats[outcome] = stats.get(outcome, 0) + 1
        assert masks.shape == (usable + 1, grammar.tokenizer.words)
        assert torch.equal(masks[0], before[0]) and torch.equal(grammar.window_masks([])[0], before)  # rolled back
        # EOS exactly where the grammar may end; once finished, EOS alone
        assert is_allowed(masks[0], eos) == grammar.is_accepting
        if grammar.is_finished:
            assert allowed_tokens(masks[0]).tolist() == [eos]
        # the wire and the stage's transform: the verifier's argmax is always allowed
        shipped = unpack_token_masks(pack_token_masks(masks, VOCAB), VOCAB)
        assert torch.equal(shipped, masks)
        logits = torch.randn(usable + 1, VOCAB + 64, generator=torch.Generator().manual_seed(seed + len(out)))
        best = apply_token_masks(logits, shipped).argmax(dim=-1)
        assert all(is_allowed(masks[i], int(best[i])) for i in range(usable + 1))
        accepted = int(walker.rng.integers(0, usable + 1))
        step = drafts[:accepted]
        if eos not in step:
            step.append(walker.pick(masks[accepted], len(out) + accepted))
        grammar.commit(step)
        out.extend(step)
        if step[-1] == eos:
            assert grammar.is_finished
            return out
    raise AssertionError(f"the walk did not end in {HARD_LIMIT} tokens")


def text_of(hf_tokenizer: Any, tokens: list[int]) -> str:
    assert tokens[-1] == 0 and 0 not in tokens[:-1]
    return str(hf_tokenizer.decode(tokens[:-1]))


def obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        **extra,
    }


SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": obj({"name": {"type": "string"}, "age": {"type": "integer"}}, additionalProperties=False),
    "nested": obj(
        {
            "user": obj(
                {"id": {"type": "integer"}, "address": obj({"city": {"type": "string"}, "zip": {"type": "string"}})}
            )
        }
    ),
    "array-bounds": obj(
        {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 2, "maxItems": 3}}
    ),
    "enum": obj({"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M"]}}),
    "number-bounds": obj(
        {
            "x": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            "p": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        }
    ),
    "integer-bounds": obj(
        {"n": {"type": "integer", "minimum": 10, "maximum": 99}, "m": {"type": "integer", "minimum": -5, "maximum": 5}}
    ),
    "booleans": obj(
        {"ok": {"type": "boolean"}, "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4}}
    ),
    "nullable-anyof": obj({"note": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]}}),
    "nullable-type-list": obj({"count": {"type": ["integer", "null"]}, "label": {"type": ["string", "null"]}}),
    "anyof-shapes": obj(
        {
            "shape": {
                "anyOf": [
                    obj({"r": {"type": "number"}}, additionalProperties=False),
                    obj({"w": {"type": "integer"}, "h": {"type": "integer"}}, additionalProperties=False),
                ]
            }
        }
    ),
    "pattern": obj(
        {
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "slug": {"type": "string", "pattern": "^[a-z]+(_[a-z]+)*$", "maxLength": 12},
        }
    ),
    "string-lengths": obj(
        {
            "short": {"type": "string", "minLength": 2, "maxLength": 4},
            "long": {"type": "string", "minLength": 5, "maxLength": 10},
        }
    ),
    "defs-ref": {
        **obj({"home": {"$ref": "#/$defs/place"}, "work": {"$ref": "#/$defs/place"}}),
        "$defs": {"place": obj({"lat": {"type": "number"}, "lon": {"type": "number"}}, additionalProperties=False)},
    },
    "recursive-tree": {
        "$ref": "#/$defs/node",
        "$defs": {
            "node": obj(
                {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
                additionalProperties=False,
            )
        },
    },
    "array-of-objects": obj(
        {
            "rows": {
                "type": "array",
                "maxItems": 3,
                "items": obj(
                    {"k": {"type": "string", "maxLength": 4}, "v": {"type": "integer"}}, additionalProperties=False
                ),
            }
        }
    ),
    "const": obj({"version": {"const": 2}, "kind": {"const": "event"}}),
    "tuple": obj(
        {
            "pair": {
                "type": "array",
                "prefixItems": [{"type": "string", "maxLength": 5}, {"type": "integer"}],
                "items": False,
            }
        }
    ),
    "optional-properties": obj(
        {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "boolean"}},
        required=["a"],
        additionalProperties=False,
    ),
    "typed-additional": {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3},
    "mixed-enum": obj({"v": {"enum": [1, "one", None, True, 2.5]}}),
    "openai-strict": obj(
        {
            "answer": {"type": "string", "maxLength": 20},
            "confidence": {"anyOf": [{"type": "number", "minimum": 0, "maximum": 1}, {"type": "null"}]},
            "steps": {
                "type": "array",
                "maxItems": 2,
                "items": obj({"why": {"type": "string", "maxLength": 10}}, additionalProperties=False),
            },
        },
        additionalProperties=False,
    ),
    "matrix": obj(
        {
            "m": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "integer"}},
            }
        }
    ),
    "top-level-array": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1, "maxItems": 4},
    "escapes": obj({"s": {"type": "string", "minLength": 3, "maxLength": 15}}),
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_speculative_walks_produce_valid_json(
    name: str, tokenizer: GrammarTokenizer, texts: list[str], hf_tokenizer: Any
) -> None:
    schema = SCHEMAS[name]
    stats: dict[str, int] = {}
    for seed in range(2):
        grammar = session(tokenizer, guided_json=schema)
        tokens = speculative_walk(grammar, texts, seed=sum(map(ord, name)) + seed, stats=stats)
        text = text_of(hf_tokenizer, tokens)
        jsonschema.validate(json.loads(text), schema)
    assert stats.get("cut", 0) > 0 and stats.get("whole", 0) > 0, stats  # both sides of the window logic ran


def test_json_object_mode_gives_an_object(tokenizer: GrammarTokenizer, texts: list[str], hf_tokenizer: Any) -> None:
    for seed in range(3):
        grammar = session(tokenizer, response_format={"type": "json_object"})
        assert isinstance(json.loads(text_of(hf_tokenizer, speculative_walk(grammar, texts, seed))), dict)


def test_regex_choice_and_lark(tokenizer: GrammarTokenizer, texts: list[str], hf_tokenizer: Any) -> None:
    regex = r"[A-Z][a-z]{2,8} (19|20)[0-9]{2}(, [a-z]+)?"
    choices = ["yes", "no", "maybe so", 'a "quoted" one']
    lark = """
        start: expr
        expr: term (("+" | "-") term)*
        term: NUMBER | "(" expr ")"
        NUMBER: /[0-9]{1,3}/
    """
    seen = set()
    for seed in range(6):
        text = text_of(hf_tokenizer, speculative_walk(session(tokenizer, guided_regex=regex), texts, seed))
        assert re.fullmatch(regex, text), text
        text = text_of(hf_tokenizer, speculative_walk(session(tokenizer, guided_choice=choices), texts, seed))
        assert text in choices
        seen.add(text)
        text = text_of(hf_tokenizer, speculative_walk(session(tokenizer, guided_grammar=lark), texts, seed))
        assert arithmetic(text), text
    assert len(seen) > 1


def arithmetic(text: str) -> bool:
    """Whether text is expr := term (('+'|'-') term)*, term := 1-3 digits | '(' expr ')'."""
    pos = 0

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        while pos < len(text) and text[pos] in "+-":
            pos += 1
            if not term():
                return False
        return True

    def term() -> bool:
        nonlocal pos
        digits = re.match(r"[0-9]{1,3}", text[pos:])
        if digits:
            pos += digits.end()
            return True
        if text[pos : pos + 1] == "(":
            pos += 1
            if not expr() or text[pos : pos + 1] != ")":
                return False
            pos += 1
            return True
        return False

    return expr() and pos == len(text)


def test_the_window_is_cut_at_the_first_forbidden_draft(tokenizer: GrammarTokenizer, hf_tokenizer: Any) -> None:
    grammar = session(tokenizer, guided_regex="[a-c]{3}[0-9]+")
    a, b, c, x, one = (hf_tokenizer.convert_tokens_to_ids(t) for t in "abcx1")
    masks, usable = grammar.window_masks([a, b, x, c])
    assert usable == 2 and masks.shape[0] == 3
    assert is_allowed(masks[0], a) and is_allowed(masks[1], b) and is_allowed(masks[2], c)  # row 2: the bonus
    assert not is_allowed(masks[2], x)
    assert grammar.window_masks([x, a])[1] == 0
    assert grammar.window_masks([a, b, c, one])[1] == 4
    for bad in (-1, VOCAB, VOCAB + 100):  # ids outside the vocabulary are forbidden, never an error state
        assert grammar.window_masks([a, bad])[1] == 1
    grammar.commit([a, b])
    masks, usable = grammar.window_masks([c])
    assert usable == 1 and not is_allowed(masks[0], 0) and is_allowed(masks[1], one) and not is_allowed(masks[1], a)


def test_eos_only_where_the_grammar_may_end(tokenizer: GrammarTokenizer, hf_tokenizer: Any) -> None:
    grammar = session(tokenizer, guided_regex="ab?")
    a, b = (hf_tokenizer.convert_tokens_to_ids(t) for t in "ab")
    masks, usable = grammar.window_masks([a, b, 0, a])
    assert usable == 3  # a, b, EOS; nothing after EOS
    assert not is_allowed(masks[0], 0) and is_allowed(masks[1], 0) and is_allowed(masks[2], 0)
    assert allowed_tokens(masks[2]).tolist() == [0]  # after "ab" the regex can only end
    assert allowed_tokens(masks[3]).tolist() == [0]  # the row after an EOS draft
    assert not grammar.is_accepting
    grammar.commit([a, b])
    assert grammar.is_accepting and grammar.is_finished
    # a window from a finished grammar: EOS is the only draft it keeps, however often it repeats
    masks, usable = grammar.window_masks([0, 0])
    assert usable == 1 and masks.shape[0] == 2
    grammar.commit([0])
    assert grammar.is_finished and allowed_tokens(grammar.window_masks([])[0][0]).tolist() == [0]


def test_extra_eos_ids_end_generation_too(hf_tokenizer: Any) -> None:
    im_end = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    chat = grammar_tokenizer(hf_tokenizer, VOCAB, eos_token_ids=[0, im_end])
    grammar = session(chat, guided_choice=["ok"])
    masks, usable = grammar.window_masks(hf_tokenizer.encode("ok", add_special_tokens=False) + [im_end])
    assert usable == masks.shape[0] - 1 and allowed_tokens(masks[-1]).tolist() == [0, im_end]
    assert is_allowed(masks[-2], im_end) and is_allowed(masks[-2], 0)


def test_a_forbidden_commit_raises_and_changes_nothing(tokenizer: GrammarTokenizer, hf_tokenizer: Any) -> None:
    grammar = session(tokenizer, guided_regex="[0-9]+")
    one, x = (hf_tokenizer.convert_tokens_to_ids(t) for t in "1x")
    grammar.commit([one])
    before = grammar.window_masks([])[0]
    for bad in ([one, x], [0, one], [VOCAB + 5], [-3]):
        with pytest.raises(GrammarViolation, match="not allowed"):
            grammar.commit(bad)
        assert torch.equal(grammar.window_masks([])[0], before) and grammar.committed == 1
    grammar.commit([one, 0])
    with pytest.raises(GrammarViolation):
        grammar.commit([one])  # nothing but EOS after EOS


def test_masks_match_a_fresh_matcher_after_the_same_commits(tokenizer: GrammarTokenizer, texts: list[str]) -> None:
    """The scratch walks left no trace: a session that only ever committed agrees row by row."""
    schema = SCHEMAS["openai-strict"]
    walked = session(tokenizer, guided_json=schema)
    tokens = speculative_walk(walked, texts, seed=11)
    replay = session(tokenizer, guided_json=schema)
    for i, token in enumerate(tokens[:40]):
        assert torch.equal(replay.window_masks([])[0][0], session_at(tokenizer, schema, tokens[:i]).mask_after()[0])
        replay.commit([token])


def session_at(tokenizer: GrammarTokenizer, schema: dict[str, Any], tokens: list[int]) -> SessionGrammar:
    grammar = session(tokenizer, guided_json=schema)
    grammar.commit(tokens)
    return grammar


def test_window_rows_equal_the_draft_masks(tokenizer: GrammarTokenizer, hf_tokenizer: Any) -> None:
    drafts = allowed_path(session(tokenizer, guided_json=SCHEMAS["flat"]), 6)
    masks, usable = session(tokenizer, guided_json=SCHEMAS["flat"]).window_masks(drafts)
    assert usable == len(drafts)
    for i in range(usable + 1):  # each from a grammar of its own: computed, not remembered
        after = session(tokenizer, guided_json=SCHEMAS["flat"]).mask_after(drafts[:i])
        assert after is not None and torch.equal(masks[i], after[0])
    grammar = session(tokenizer, guided_json=SCHEMAS["flat"])
    assert grammar.mask_after([*drafts, hf_tokenizer.convert_tokens_to_ids("x"), 5000]) is None


def allowed_path(grammar: SessionGrammar, length: int) -> list[int]:
    """length tokens the grammar allows in a row: each the highest allowed id (a long token, not
    whitespace) — a prompt's encoding may not be one, since llguidance admits only the canonical
    tokens for bytes the grammar forces (a key of a closed object, say)."""
    path: list[int] = []
    for _ in range(length):
        mask = grammar.mask_after(path)
        assert mask is not None
        path.append(int(allowed_tokens(mask[0]).max()))
    return path


def test_draft_logits_are_constrained(tokenizer: GrammarTokenizer, hf_tokenizer: Any) -> None:
    grammar = session(tokenizer, guided_choice=["alpha", "beta"])
    logits = torch.randn(VOCAB + 32)
    grammar.constrain_draft_logits(logits)
    finite = torch.isfinite(logits).nonzero().flatten().tolist()
    assert finite and all(
        hf_tokenizer.decode([t]) in ("alpha", "beta")
        or "alpha".startswith(hf_tokenizer.decode([t]))
        or "beta".startswith(hf_tokenizer.decode([t]))
        for t in finite
    )
    first = int(logits.argmax())
    row = torch.randn(1, VOCAB)
    grammar.constrain_draft_logits(row, [first])
    assert is_allowed(grammar.mask_after([first])[0], int(row.argmax()))  # type: ignore[index]
    with pytest.raises(GrammarViolation):
        grammar.constrain_draft_logits(torch.randn(VOCAB), [hf_tokenizer.convert_tokens_to_ids("z")] * 3)


def test_padded_vocabulary_is_never_allowed(hf_tokenizer: Any) -> None:
    padded = grammar_tokenizer(hf_tokenizer, VOCAB + 100)
    assert padded.words == (VOCAB + 100 + 31) // 32
    grammar = session(padded, response_format={"type": "json_object"})
    masks, _ = grammar.window_masks([VOCAB + 3])
    assert masks.shape == (1, padded.words) and allowed_tokens(masks[0]).max() < VOCAB
    logits = torch.full((1, VOCAB + 100), -5.0)
    logits[0, VOCAB:] = 50.0
    assert int(apply_token_masks(logits, masks).argmax()) < VOCAB


def test_the_tokenizer_is_built_once(hf_tokenizer: Any, tokenizer: GrammarTokenizer) -> None:
    assert grammar_tokenizer(hf_tokenizer, VOCAB) is tokenizer
    assert grammar_tokenizer(hf_tokenizer, VOCAB, eos_token_ids=[0, 2]) is not tokenizer
    with pytest.raises(ValueError, match="more than the model"):
        grammar_tokenizer(hf_tokenizer, 100)
    with pytest.raises(ValueError, match="EOS"):
        grammar_tokenizer(hf_tokenizer, VOCAB, eos_token_ids=[VOCAB])


def test_one_session_from_two_threads(tokenizer: GrammarTokenizer, hf_tokenizer: Any) -> None:
    """llguidance refuses concurrent use of one matcher ("Already borrowed"); the session's lock orders it."""
    grammar = session(tokenizer, guided_json=SCHEMAS["nested"])
    drafts = allowed_path(grammar, 12)
    expected = grammar.window_masks(drafts)
    failures: list[BaseException] = []

    def hammer() -> None:
        try:
            for _ in range(200):
                masks, usable = grammar.window_masks(drafts)
                assert usable == expected[1] and torch.equal(masks, expected[0])
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=hammer) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures


def test_a_constraint_from_elsewhere_still_gets_a_400(tokenizer: GrammarTokenizer) -> None:
    bad = Constraint(
        kind=ConstraintKind.REGEX,
        spec="a((",
        grammar='{"grammars": [{"lark_grammar": "start: ("}]}',
        param="guided_regex",
    )
    with pytest.raises(ConstraintError) as caught:
        SessionGrammar(bad, tokenizer)
    assert caught.value.param == "guided_regex"


def test_a_draft_models_masks_are_not_computed_twice_for_its_window(tokenizer: GrammarTokenizer) -> None:
    """A draft model asks for the mask after each of its drafts; the verify window's rows for the
    same prefixes are then copies, not computed again, and equal what a fresh grammar computes."""
    drafts = allowed_path(session(tokenizer, guided_json=SCHEMAS["flat"]), 5)
    drafted, fresh = (session(tokenizer, guided_json=SCHEMAS["flat"]) for _ in range(2))
    for i in range(len(drafts)):  # the draft model, token by token
        assert drafted.mask_after(drafts[:i]) is not None
    assert drafted.mask_fills == len(drafts)
    masks, usable = drafted.window_masks(drafts)
    assert usable == len(drafts) and drafted.mask_fills == len(drafts) + 1  # only the bonus row is new
    assert torch.equal(masks, fresh.window_masks(drafts)[0])
    drafted.commit(drafts[:2])  # a commit moves the state: nothing remembered applies any more
    fills = drafted.mask_fills
    assert torch.equal(drafted.window_masks([])[0], session_at(tokenizer, SCHEMAS["flat"], drafts[:2]).window_masks(
        [])[0])
    assert drafted.mask_fills == fills + 1


def test_an_objects_properties_come_in_its_schemas_order(hf_tokenizer: Any, tokenizer: GrammarTokenizer) -> None:
    # OpenAI's rule: the output writes properties in the schema's order (it was alphabetical: the
    # schema's keys were sorted before compiling)
    def accepts(properties: list[str], text: str) -> bool:
        schema = {"type": "object", "properties": {name: {"type": "integer"} for name in properties},
                  "required": properties, "additionalProperties": False}
        grammar = SessionGrammar(constraint_from_request(guided_json=schema), tokenizer)
        try:
            grammar.commit(hf_tokenizer(text, add_special_tokens=False).input_ids)
        except GrammarViolation:
            return False
        return grammar.is_accepting

    assert accepts(["zeta", "alpha"], '{"zeta":1,"alpha":2}')
    assert not accepts(["zeta", "alpha"], '{"alpha":2,"zeta":1}')
    assert accepts(["alpha", "zeta"], '{"alpha":2,"zeta":1}')


# ---- the grammar engine as a bounded resource (issue 33) ----------------------------------------

def test_a_constraints_matcher_is_built_once_and_each_choice_copies_it(tokenizer: GrammarTokenizer,
                                                                        hf_tokenizer: Any) -> None:
    constraint = constraint_from_request(guided_choice=["yes", "no"])
    assert constraint is not None
    assert constraint_matcher(constraint, tokenizer) is constraint_matcher(constraint, tokenizer)
    output = ConstrainedOutput(constraint, tokenizer)
    first, second = output.start(), output.start()
    first.commit(hf_tokenizer.encode("yes"))
    assert first.is_finished and not second.is_finished  # copies: one choice's tokens are its own
    second.commit(hf_tokenizer.encode("no"))
    assert second.is_finished


def test_a_limit_met_at_the_first_token_is_a_400_before_generation(tokenizer: GrammarTokenizer) -> None:
    """Within the regex limits, yet llguidance gives up at the first token ("too many expressions
    constructed"): the build's probe finds it, so the request is refused, not failed mid-stream."""
    constraint = constraint_from_request(guided_regex="(x?){1000}x{1000}")
    assert constraint is not None
    for _ in range(2):  # the refusal is remembered as well
        with pytest.raises(ConstraintError) as caught:
            ConstrainedOutput(constraint, tokenizer).start()
        assert caught.value.param == "guided_regex" and "too many expressions" in caught.value.message


def test_an_ambiguous_grammar_ends_at_the_step_limit_with_a_constraint_error(tokenizer: GrammarTokenizer,
                                                                            hf_tokenizer: Any) -> None:
    """Each 31-space token makes the next step costlier (seconds by the tenth at llguidance's
    default limits); the per-step item limit ends the generation after a few, each step cheap."""
    spaces = hf_tokenizer.convert_tokens_to_ids("Ġ" * 31)
    grammar = session(tokenizer, guided_grammar='start: s\ns: s s | s s s | " "')
    with pytest.raises(ConstraintError) as caught:
        for _ in range(20):
            started = time.perf_counter()
            masks, _ = grammar.window_masks([])
            assert is_allowed(masks[0], spaces)
            grammar.commit([spaces])
            assert time.perf_counter() - started < 1.0
    assert caught.value.param == "guided_grammar" and "could not be enforced" in caught.value.message
    assert grammar.committed < 10


def test_a_mask_past_its_cpu_budget_ends_the_choice(tokenizer: GrammarTokenizer,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    grammar = session(tokenizer, guided_json={"type": "object"})
    monkeypatch.setattr(grammar_module, "MASK_BUDGET_S", -1.0)  # any mask is over it
    with pytest.raises(ConstraintError) as caught:
        grammar.window_masks([])
    assert caught.value.param == "guided_json" and "ms of CPU" in caught.value.message


def test_masks_and_commits_run_off_the_event_loop(tokenizer: GrammarTokenizer, hf_tokenizer: Any) -> None:
    grammar = session(tokenizer, guided_choice=["yes", "no"])
    loop_thread = threading.get_ident()
    computed_on: list[int] = []
    original = grammar.window_masks

    def recording(drafts: Any) -> Any:
        computed_on.append(threading.get_ident())
        return original(drafts)

    grammar.window_masks = recording  # type: ignore[method-assign]

    async def go() -> None:
        await grammar.window_masks_async([])
        await grammar.commit_async(hf_tokenizer.encode("yes"))

    asyncio.run(go())
    assert computed_on and loop_thread not in computed_on
    assert grammar.is_finished
