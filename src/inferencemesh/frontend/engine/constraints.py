"""A request's output constraint: compiled to an llguidance grammar and validated before
generation, so a bad constraint is a 400 and never a failed stream.

Kinds: any JSON object, a JSON schema, a regular expression the whole output matches, one of
a list of strings, a Lark (or GBNF) grammar, and tool calls (built by the OpenAI wing's
tools.py). Which request field brings which is the OpenAI wing's business
(frontend/openai/structured_outputs.py); the shape limits checked before compiling are
grammar_shape.py's.

JSON schemas are checked against their metaschema with jsonschema (a runtime dependency):
llguidance is a compiler, it checks only the keywords it compiles, so a schema with e.g. a
non-string "title" or a non-array "required" under a keyword it skips would compile and then be
enforced differently from what the client's own validator would say. Strict json_schema follows
OpenAI's subset rules on top (every object closed and fully required, the root an object).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import jsonschema
import llguidance

from inferencemesh.frontend.engine import grammar_worker
from inferencemesh.frontend.engine.errors import ConstraintError
from inferencemesh.frontend.engine.grammar_shape import check_grammar_shape, check_regex, check_schema_shape

# The largest constraint a request may bring, as UTF-8 text (a schema as its compact JSON): larger
# ones are refused before compiling. Compiling is linear-ish in size, but a request must not be
# able to make the frontend spend seconds before its first token.
MAX_CONSTRAINT_BYTES = 64 * 1024
# llguidance's bound on the compiled grammar (symbols in productions) and its per-step work: a
# small text can still expand (a regex like (a{1000}){1000}). Errors omit parser state: they are
# answered to the client.
MAX_GRAMMAR_SYMBOLS = 200_000
# Earley items one token's mask (or commit) may create. llguidance's default (50,000) let an
# ambiguous grammar ('s: s s | s s s | " "') spend seconds per token, holding the GIL while it
# consumed one; at 10,000 the worst step costs tens of milliseconds, far above any real grammar's.
MAX_STEP_ITEMS = 10_000
LIMITS: dict[str, Any] = {"max_grammar_size": MAX_GRAMMAR_SYMBOLS, "step_max_items": MAX_STEP_ITEMS,
                          "verbose_errors": False}
GRAMMAR_LIMITS = llguidance.LLParserLimits(**LIMITS)
# JSON comes out compact (no whitespace between tokens). Flexible
# whitespace (vLLM's llguidance default) let the bundled model, greedy, write newlines after the
# first key until max_tokens ran out: a constraint must not make a valid output unreachable.
JSON_WHITESPACE_FLEXIBLE = False


class ConstraintKind(Enum):
    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"  # Lark, or GBNF (llguidance converts it)
    TOOL_CALLS = "tool_calls"  # function calling (tools.py), text in its own format or free with auto


@dataclass(frozen=True)
class Constraint:
    """One request's constraint, compiled and validated.

    spec is the client's constraint as canonical text (a schema as sorted compact JSON, the
    choices as a JSON list), hashable, usable as a cache key; grammar is llguidance's grammar
    for it (what LLMatcher takes); param is where it came from, for errors found later."""

    kind: ConstraintKind
    spec: str
    grammar: str
    param: str
    strict: bool = False
    name: str | None = None  # response_format.json_schema.name


def json_object_constraint(param: str) -> Constraint:
    """Any JSON object (OpenAI's json_object mode)."""
    spec = '{"type":"object"}'
    return Constraint(ConstraintKind.JSON_OBJECT, spec, validated_grammar(_json_grammar(spec), param), param)


def json_schema_constraint(schema: Any, param: str, *, strict: bool = False, name: str | None = None) -> Constraint:
    if isinstance(schema, str):
        _bounded(schema, param)
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as exc:
            raise ConstraintError(param, f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, Mapping):
        raise ConstraintError(param, "a JSON schema must be an object")
    check_schema_shape(schema, param)
    try:
        # keys in the client's order: the output writes an object's properties in its schema's order
        # (OpenAI's rule; a schema can put "reasoning" before "answer"), sorted they came out alphabetical
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConstraintError(param, f"the JSON schema is not JSON: {exc}") from None
    try:
        text.encode("utf-8")  # a lone surrogate (JSON's \ud800 escape) reaches llguidance as no string at all
    except UnicodeEncodeError:
        raise ConstraintError(param, "the JSON schema contains a lone surrogate (invalid Unicode)") from None
    spec = _bounded(text, param)
    schema = json.loads(spec)  # a plain dict from here on, whatever mapping the caller passed
    _check_metaschema(schema, param)
    if strict:
        check_strict(schema, param)
    grammar = validated_grammar(_json_grammar(spec), param)
    return Constraint(ConstraintKind.JSON_SCHEMA, spec, grammar, param, strict, name)


def regex_constraint(regex: Any, param: str) -> Constraint:
    if not isinstance(regex, str) or not regex:
        raise ConstraintError(param, "the regular expression must be a non-empty string")
    spec = _bounded(regex, param)
    check_regex(spec, param)
    return Constraint(
        ConstraintKind.REGEX, spec, validated_grammar(llguidance.LLMatcher.grammar_from_regex(spec), param), param
    )


def choice_constraint(choices: Any, param: str) -> Constraint:
    if not isinstance(choices, list | tuple) or not choices:
        raise ConstraintError(param, "the choices must be a non-empty list of strings")
    if not all(isinstance(choice, str) and choice for choice in choices):
        raise ConstraintError(param, "every choice must be a non-empty string")
    spec = _bounded(json.dumps(list(choices), ensure_ascii=False), param)
    # A Lark alternation of string literals; JSON's string escapes are Lark's.
    lark = "start: " + " | ".join(json.dumps(choice) for choice in choices)
    return Constraint(
        ConstraintKind.CHOICE, spec, validated_grammar(llguidance.LLMatcher.grammar_from_lark(lark), param), param
    )


def grammar_constraint(grammar: Any, param: str) -> Constraint:
    if not isinstance(grammar, str) or not grammar.strip():
        raise ConstraintError(param, "the grammar must be a non-empty string")
    spec = _bounded(grammar, param)
    check_grammar_shape(spec, param)
    try:
        compiled = llguidance.grammar_from("grammar", spec)  # Lark as is; GBNF converted to Lark
    except (ValueError, RecursionError) as exc:
        raise ConstraintError(param, f"invalid grammar: {exc}") from None
    return Constraint(ConstraintKind.GRAMMAR, spec, validated_grammar(compiled, param), param)


def _json_grammar(spec: str) -> str:
    # Only object schemas reach here, the one form llguidance applies compile options to.
    return llguidance.LLMatcher.grammar_from_json_schema(
        spec, defaults={"whitespace_flexible": JSON_WHITESPACE_FLEXIBLE}
    )


def _bounded(text: str, param: str) -> str:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_CONSTRAINT_BYTES:
        raise ConstraintError(param, f"the constraint is {size} bytes; the limit is {MAX_CONSTRAINT_BYTES}")
    return text


def validated_grammar(grammar: str, param: str) -> str:
    """grammar, once llguidance has built it (tokenizer-independent checks: syntax, unsupported
    schema keywords, unsatisfiable bounds, size limits), in the grammar worker: a grammar that
    crashes the compiler or outlasts its CPU budget is refused, and only the worker pays for it.
    Blocks the calling thread (never call it on the event loop)."""
    error = grammar_worker.checker().check(grammar, LIMITS)
    if error:
        raise ConstraintError(param, f"cannot enforce this constraint: {first_line(error)}")
    return grammar


def first_line(error: str) -> str:
    """llguidance's message without the source excerpt it appends (lines of grammar and carets)."""
    lines = [line for line in error.splitlines() if line.strip()]
    head = lines[0] if lines else error
    # regex errors put the cause on a later "error: ..." line
    cause = next((line.strip() for line in lines[1:] if line.strip().startswith("error:")), None)
    return f"{head} ({cause})" if cause else head


def _check_metaschema(schema: Any, param: str) -> None:
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(part) for part in exc.absolute_path) or "(root)"
        raise ConstraintError(param, f"invalid JSON schema at {where}: {exc.message}") from None


def check_strict(schema: Any, param: str) -> None:
    """OpenAI's strict structured outputs: the root is an object; every object schema lists all
    its properties in required and sets additionalProperties to false."""
    if not isinstance(schema, dict) or not _is_object_schema(schema):
        raise ConstraintError(param, "strict mode requires the root schema to be an object (type: object)")
    for pointer, sub in subschemas(schema, "#"):
        if not _is_object_schema(sub):
            continue
        if sub.get("additionalProperties") is not False:
            raise ConstraintError(param, f"strict mode requires additionalProperties: false at {pointer}")
        properties = sub.get("properties", {})
        missing = [key for key in properties if key not in sub.get("required", [])]
        if missing:
            raise ConstraintError(
                param,
                f"strict mode requires every property to be required at {pointer}; "
                f"missing {', '.join(repr(key) for key in missing)}",
            )


def _is_object_schema(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in schema


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = (
    "items",
    "additionalProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "additionalItems",
)


def subschemas(schema: dict[str, Any], pointer: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema object within schema (itself first), with its JSON pointer."""
    yield pointer, schema
    for key in _SCHEMA_MAPS:
        for name, sub in (schema.get(key) or {}).items():
            if isinstance(sub, dict):
                yield from subschemas(sub, f"{pointer}/{key}/{name}")
    for key in _SCHEMA_LISTS:
        for index, sub in enumerate(schema.get(key) or []):
            if isinstance(sub, dict):
                yield from subschemas(sub, f"{pointer}/{key}/{index}")
    for key in _SCHEMA_ONE:
        sub = schema.get(key)
        if isinstance(sub, dict):
            yield from subschemas(sub, f"{pointer}/{key}")
        elif isinstance(sub, list):  # draft-4 style tuple items
            for index, item in enumerate(sub):
                if isinstance(item, dict):
                    yield from subschemas(item, f"{pointer}/{key}/{index}")


