"""A request's output constraint: parsed from OpenAI / vLLM parameters, compiled to an llguidance
grammar and validated before generation, so a bad schema is a 400 and never a failed stream.

Sources, exactly one per request:
    response_format   {"type": "json_object"} | {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    guided_json       a JSON schema (dict, or its JSON text)           (vLLM)
    guided_regex      a regular expression the whole output matches    (vLLM)
    guided_choice     a list of strings, the output is one of them     (vLLM)
    guided_grammar    a Lark (or GBNF) grammar                         (vLLM)
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object": ...}  (vLLM >= 0.10)

JSON schemas are checked against their metaschema with jsonschema (a runtime dependency):
llguidance is a compiler, it checks only the keywords it compiles, so a schema with e.g. a
non-string "title" or a non-array "required" under a keyword it skips would compile and then be
enforced differently from what the client's own validator would say. Strict json_schema follows
OpenAI's subset rules on top (every object closed and fully required, the root an object).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import jsonschema
import llguidance

from inferencemesh.frontend.engine import grammar_worker
from inferencemesh.frontend.engine.errors import InvalidRequest

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
# Checked on the constraint's text before anything compiles it (by iteration, never recursion):
# llguidance's compiler recurses on a grammar's structure and its lexer expands counted repetition,
# so shape, not size, is what a crafted constraint attacks. Real constraints stay far below these.
MAX_NESTING = 64  # brackets in a regex or grammar; JSON arrays and objects in a schema
MAX_GRAMMAR_RULES = 1_000  # rules and terminals of a Lark or GBNF grammar
MAX_RULE_DEPTH = 200  # the longest chain of rule references (r0 -> r1 -> r2 ...), cycles cut
MAX_REPEAT_EXPANSION = 4_096  # a regex's atoms with counted repetitions written out: (a{1000}){1000} is 10^6
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


class ConstraintError(InvalidRequest):
    """A constraint the server refuses: a 400 naming the OpenAI parameter at fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message, param=param)
        self.message = message


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


# The request fields, in the order an error about two of them names them.
_SOURCES = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
_STRUCTURED_KEYS = {
    "json": ConstraintKind.JSON_SCHEMA,
    "regex": ConstraintKind.REGEX,
    "choice": ConstraintKind.CHOICE,
    "grammar": ConstraintKind.GRAMMAR,
}


def constraint_from_request(
    *,
    response_format: Mapping[str, Any] | None = None,
    guided_json: Mapping[str, Any] | str | None = None,
    guided_regex: str | None = None,
    guided_choice: list[str] | None = None,
    guided_grammar: str | None = None,
    structured_outputs: Mapping[str, Any] | None = None,
) -> Constraint | None:
    """The request's constraint, or None when it has none (response_format {"type": "text"} is none).

    Raises ConstraintError (param: the OpenAI/vLLM parameter name) for two constraints at once,
    a malformed or invalid one, one over MAX_CONSTRAINT_BYTES, strict-mode violations, or a
    feature llguidance cannot enforce."""
    structured = _structured_fields(structured_outputs)
    given = {
        "response_format": response_format if _is_format(response_format) else None,
        "guided_json": guided_json,
        "guided_regex": guided_regex,
        "guided_choice": guided_choice,
        "guided_grammar": guided_grammar,
        "structured_outputs": structured or None,
    }
    present = [name for name in _SOURCES if given[name] is not None]
    if not present:
        return None
    if len(present) > 1:
        raise ConstraintError(present[1], f"only one output constraint may be given; got {' and '.join(present)}")
    source = present[0]
    if source == "response_format":
        assert response_format is not None
        return _from_response_format(response_format)
    if source == "guided_json":
        return json_schema_constraint(guided_json, "guided_json")
    if source == "guided_regex":
        return regex_constraint(guided_regex, "guided_regex")
    if source == "guided_choice":
        return choice_constraint(guided_choice, "guided_choice")
    if source == "guided_grammar":
        return grammar_constraint(guided_grammar, "guided_grammar")
    return _from_structured_outputs(structured)


def _is_format(response_format: Mapping[str, Any] | None) -> bool:
    if response_format is None:
        return False
    if not isinstance(response_format, Mapping):
        raise ConstraintError("response_format", "response_format must be an object")
    return response_format.get("type") != "text"


def _structured_fields(structured_outputs: Mapping[str, Any] | None) -> dict[str, Any]:
    """structured_outputs' constraint fields that are set (its other fields are options)."""
    if structured_outputs is None:
        return {}
    if not isinstance(structured_outputs, Mapping):
        raise ConstraintError("structured_outputs", "structured_outputs must be an object")
    fields = {
        key: structured_outputs[key]
        for key in (*_STRUCTURED_KEYS, "json_object", "structural_tag")
        if structured_outputs.get(key) not in (None, False)
    }
    return fields


def _from_response_format(response_format: Mapping[str, Any]) -> Constraint:
    kind = response_format.get("type")
    if kind == "json_object":
        return json_object_constraint("response_format")
    if kind != "json_schema":
        raise ConstraintError("response_format.type", f"response_format type {kind!r} is not supported")
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise ConstraintError("response_format.json_schema", "response_format.json_schema must be an object")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise ConstraintError("response_format.json_schema.name", "response_format.json_schema.name is required")
    strict = spec.get("strict")
    if strict not in (None, True, False):
        raise ConstraintError("response_format.json_schema.strict", "strict must be a boolean")
    schema = spec.get("schema", {"type": "object"})  # OpenAI: absent schema means any object
    return json_schema_constraint(schema, "response_format.json_schema.schema", strict=bool(strict), name=name)


def _from_structured_outputs(fields: Mapping[str, Any]) -> Constraint:
    if len(fields) > 1:
        raise ConstraintError(
            "structured_outputs", f"structured_outputs takes one constraint; got {', '.join(sorted(fields))}"
        )
    ((key, value),) = fields.items()
    param = f"structured_outputs.{key}"
    if key == "json_object":
        return json_object_constraint(param)
    if key == "structural_tag":
        raise ConstraintError(param, "structural_tag is not supported")
    kind = _STRUCTURED_KEYS[key]
    if kind is ConstraintKind.JSON_SCHEMA:
        return json_schema_constraint(value, param)
    if kind is ConstraintKind.REGEX:
        return regex_constraint(value, param)
    if kind is ConstraintKind.CHOICE:
        return choice_constraint(value, param)
    return grammar_constraint(value, param)


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
    _check_schema_shape(schema, param)
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
        _check_strict(schema, param)
    grammar = validated_grammar(_json_grammar(spec), param)
    return Constraint(ConstraintKind.JSON_SCHEMA, spec, grammar, param, strict, name)


def regex_constraint(regex: Any, param: str) -> Constraint:
    if not isinstance(regex, str) or not regex:
        raise ConstraintError(param, "the regular expression must be a non-empty string")
    spec = _bounded(regex, param)
    _check_regex(spec, param)
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


def _check_strict(schema: Any, param: str) -> None:
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


# ---- shape limits, checked before compiling ------------------------------------------------------

def _check_schema_shape(schema: Any, param: str) -> None:
    """Refuse a schema nested deeper than MAX_NESTING (walked with a stack: a deep one is what
    makes the recursive checks after this one fail) or with a pattern past the regex limits."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_NESTING:
            raise ConstraintError(param, f"the JSON schema is nested more than {MAX_NESTING} levels deep")
        if isinstance(node, Mapping):
            for key, value in node.items():
                if key == "pattern" and isinstance(value, str):
                    _check_regex(value, param)
                if key == "patternProperties" and isinstance(value, Mapping):
                    for pattern in value:
                        _check_regex(str(pattern), param)
                stack.append((value, depth + 1))
        elif isinstance(node, list | tuple):
            stack.extend((item, depth + 1) for item in node)


_COUNTED = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def regex_shape(regex: str) -> tuple[int, int]:
    """(expansion, nesting) of a regular expression: how many atoms it stands for with every
    counted repetition written out (of alternatives, the largest; capped just past
    MAX_REPEAT_EXPANSION), and its deepest group nesting. A scan, not a parser: it errs towards
    larger numbers on syntax it does not know."""
    cap = MAX_REPEAT_EXPANSION + 1
    groups: list[tuple[int, int]] = []  # per open group: (its enclosing best alternative, total so far)
    best = total = last = deepest = 0
    i = 0
    while i < len(regex):
        char = regex[i]
        counted = _COUNTED.match(regex, i) if char == "{" else None
        if char == "\\":
            i += 2
            if regex[i - 1 : i] in ("p", "P", "x", "u", "N") and regex[i : i + 1] == "{":  # \p{Greek}, \x{1F600}
                i = regex.find("}", i) + 1 or len(regex)
            total, last = min(total + 1, cap), 1
            continue
        if char == "[":
            i = _class_end(regex, i)
            total, last = min(total + 1, cap), 1
            continue
        if counted:
            times = int(counted.group(2) or counted.group(1))  # {m}, {m,}: m; {m,n}: n
            total = min(total + last * max(times - 1, 0), cap)
            last = min(last * times, cap)
            i = counted.end()
            continue
        if char == "(":
            groups.append((best, total))
            best = total = 0
            deepest = max(deepest, len(groups))
        elif char == ")" and groups:
            size = max(best, total)
            best, total = groups.pop()
            total, last = min(total + size, cap), size
        elif char == "|":
            best, total, last = max(best, total), 0, 0
        elif char not in "*+?":
            total, last = min(total + 1, cap), 1
        i += 1
    return max(best, total, *(outer for _, outer in groups)), deepest


def _class_end(regex: str, start: int) -> int:
    """The index past a character class [...] starting at start (nested classes included)."""
    depth, i = 0, start
    while i < len(regex):
        char = regex[i]
        if char == "\\":
            i += 2
            continue
        if char == "[":
            depth += 1
            if regex.startswith("[^]", i) or regex.startswith("[]", i):
                i += 2 if regex[i + 1] == "]" else 3
                continue
        elif char == "]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return i


def _check_regex(regex: str, param: str) -> None:
    expansion, nesting = regex_shape(regex)
    if nesting > MAX_NESTING:
        raise ConstraintError(param, f"the regular expression nests groups more than {MAX_NESTING} deep")
    if expansion > MAX_REPEAT_EXPANSION:
        raise ConstraintError(param, "the regular expression's counted repetitions expand past "
                                     f"{MAX_REPEAT_EXPANSION} elements (nested or chained {{n}} bounds)")


# Lark: "name:" or "?name.2:" at a line's start; GBNF: "name ::=".
_DEFINITION = re.compile(r"^[ \t]*[?!]?([A-Za-z_][\w-]*)(?:\.-?\d+)?[ \t]*(?:::=|:)", re.M)
_NAME = re.compile(r"[A-Za-z_][\w-]*")
_LARK_RANGE = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")


def check_grammar_shape(grammar: str, param: str) -> None:
    """Refuse a Lark or GBNF grammar past the limits on rules and terminals, on the chain of
    rule references, on bracket nesting and on counted repetition (its regexes' and its own)."""
    gbnf = "::=" in grammar
    text = _grammar_skeleton(grammar, gbnf, param)
    bodies: dict[str, list[str]] = {}
    definitions = list(_DEFINITION.finditer(text))
    if len(definitions) > MAX_GRAMMAR_RULES:
        raise ConstraintError(param, f"the grammar defines {len(definitions)} rules and terminals; "
                                     f"the limit is {MAX_GRAMMAR_RULES}")
    for this, after in zip(definitions, [*definitions[1:], None], strict=True):
        body = text[this.end() : after.start() if after is not None else len(text)]
        bodies.setdefault(this.group(1), []).extend(_NAME.findall(body))
    depth = _reference_depth(bodies)
    if depth > MAX_RULE_DEPTH:
        raise ConstraintError(param, f"the grammar's rules reference one another {depth} deep; "
                                     f"the limit is {MAX_RULE_DEPTH}")
    nesting = level = 0
    for char in text:
        level += (char in "([{") - (char in ")]}")
        nesting = max(nesting, level)
    if nesting > MAX_NESTING:
        raise ConstraintError(param, f"the grammar nests brackets more than {MAX_NESTING} deep")
    counts = [int(b or a) for a, b in _COUNTED.findall(text)] + \
             [int(b or a) for a, b in _LARK_RANGE.findall(text)]
    if any(count > MAX_REPEAT_EXPANSION for count in counts):
        raise ConstraintError(param, f"the grammar repeats an element more than {MAX_REPEAT_EXPANSION} times")


def _grammar_skeleton(grammar: str, gbnf: bool, param: str) -> str:
    """The grammar with comments dropped and every literal (strings, regexes, GBNF character
    classes) replaced by "": what is left is names, operators and brackets. Each regex is checked
    on the way."""
    out: list[str] = []
    i = 0
    while i < len(grammar):
        char = grammar[i]
        if (gbnf and char == "#") or (not gbnf and grammar.startswith("//", i)):
            i = grammar.find("\n", i)
            if i < 0:
                break
            continue
        if char == '"':
            end = i + 1
            while end < len(grammar) and grammar[end] not in '"\n':
                end += 2 if grammar[end] == "\\" else 1
            out.append('""')
            i = end + 1
            continue
        if not gbnf and char == "/":
            end = i + 1
            while end < len(grammar) and grammar[end] not in "/\n":
                end += 2 if grammar[end] == "\\" else 1
            _check_regex(grammar[i + 1 : end], param)
            out.append('""')
            i = end + 1
            continue
        if gbnf and char == "[":
            end = _class_end(grammar, i)
            out.append('""')
            i = end
            continue
        out.append(char)
        i += 1
    return "".join(out)


def _reference_depth(bodies: dict[str, list[str]]) -> int:
    """The longest chain of references between defined rules (a reference back into the chain
    ends it), found without recursion."""
    depth: dict[str, int] = {}
    for root in bodies:
        if root in depth:
            continue
        on_path = {root}
        stack: list[tuple[str, Iterator[str]]] = [(root, iter(bodies[root]))]
        while stack:
            name, refs = stack[-1]
            ref = next((r for r in refs if r in bodies and r not in on_path and r not in depth), None)
            if ref is not None:
                on_path.add(ref)
                stack.append((ref, iter(bodies[ref])))
                continue
            stack.pop()
            on_path.discard(name)
            depth[name] = 1 + max((depth[r] for r in bodies[name] if r in depth), default=0)
    return max(depth.values(), default=0)
