"""Request constraints: every OpenAI / vLLM form is parsed into one Constraint, and each kind of bad
input is refused up front with ConstraintError naming the parameter a 400 reports."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import pytest

from inferencemesh.frontend.engine.constraints import LIMITS, MAX_CONSTRAINT_BYTES, Constraint, ConstraintKind
from inferencemesh.frontend.engine.errors import ConstraintError, InvalidRequest
from inferencemesh.frontend.engine.grammar_shape import MAX_REPEAT_EXPANSION, regex_shape
from inferencemesh.frontend.engine.grammar_worker import GrammarChecker
from inferencemesh.frontend.openai.structured_outputs import constraint_from_request

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def schema_format(schema: Any, *, strict: bool | None = True, name: str = "person") -> dict[str, Any]:
    spec: dict[str, Any] = {"name": name, "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


def refused(**fields: Any) -> ConstraintError:
    with pytest.raises(ConstraintError) as caught:
        constraint_from_request(**fields)
    return caught.value


@pytest.mark.parametrize(
    ("fields", "kind", "param"),
    [
        ({"response_format": {"type": "json_object"}}, ConstraintKind.JSON_OBJECT, "response_format"),
        ({"response_format": schema_format(PERSON)}, ConstraintKind.JSON_SCHEMA, "response_format.json_schema.schema"),
        ({"guided_json": PERSON}, ConstraintKind.JSON_SCHEMA, "guided_json"),
        ({"guided_json": json.dumps(PERSON)}, ConstraintKind.JSON_SCHEMA, "guided_json"),
        ({"guided_regex": r"[0-9]{3}-[a-z]+"}, ConstraintKind.REGEX, "guided_regex"),
        ({"guided_choice": ["yes", "no", 'say "hi"']}, ConstraintKind.CHOICE, "guided_choice"),
        ({"guided_grammar": 'start: "a" NUM\nNUM: /[0-9]+/'}, ConstraintKind.GRAMMAR, "guided_grammar"),
        ({"guided_grammar": 'root ::= "a" [0-9]+'}, ConstraintKind.GRAMMAR, "guided_grammar"),  # GBNF
        ({"structured_outputs": {"json": PERSON}}, ConstraintKind.JSON_SCHEMA, "structured_outputs.json"),
        ({"structured_outputs": {"regex": "a+"}}, ConstraintKind.REGEX, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": ["x", "y"]}}, ConstraintKind.CHOICE, "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": 'start: "x"'}}, ConstraintKind.GRAMMAR, "structured_outputs.grammar"),
        ({"structured_outputs": {"json_object": True}}, ConstraintKind.JSON_OBJECT, "structured_outputs.json_object"),
    ],
)
def test_every_form_gives_one_validated_constraint(fields: dict[str, Any], kind: ConstraintKind, param: str) -> None:
    constraint = constraint_from_request(**fields)
    assert isinstance(constraint, Constraint)
    assert constraint.kind is kind and constraint.param == param
    assert llguidance.LLMatcher.validate_grammar(constraint.grammar) == ""
    hash(constraint)  # frozen and hashable: a cache key for compiled grammars


def test_no_constraint_is_none() -> None:
    assert constraint_from_request() is None
    assert constraint_from_request(response_format={"type": "text"}) is None
    assert constraint_from_request(structured_outputs={"json": None, "disable_fallback": True}) is None
    # text plus a vLLM constraint is one constraint, not two
    assert constraint_from_request(response_format={"type": "text"}, guided_regex="a") is not None


def test_the_schema_spec_is_compact_and_keeps_the_properties_order() -> None:
    one = constraint_from_request(guided_json=PERSON)
    two = constraint_from_request(guided_json=json.dumps(PERSON, indent=2))
    assert one is not None and two is not None
    assert one.spec == two.spec and one.grammar == two.grammar
    # the output writes properties in the schema's order (OpenAI's rule), so the spec keeps it
    reordered = {**PERSON, "properties": dict(reversed(list(PERSON["properties"].items())))}
    three = constraint_from_request(guided_json=reordered)
    assert three is not None and list(json.loads(three.spec)["properties"]) == ["age", "name"]
    assert list(json.loads(one.spec)["properties"]) == ["name", "age"]


def test_strict_schema_carries_its_name_and_flag() -> None:
    constraint = constraint_from_request(response_format=schema_format(PERSON))
    assert constraint is not None and constraint.strict and constraint.name == "person"
    loose = constraint_from_request(response_format=schema_format({"type": "object"}, strict=None))
    assert loose is not None and not loose.strict


def test_two_constraints_at_once_are_refused() -> None:
    err = refused(response_format={"type": "json_object"}, guided_regex="a+")
    assert err.param == "guided_regex" and "response_format and guided_regex" in err.message
    assert refused(guided_json=PERSON, guided_choice=["a"]).param == "guided_choice"
    assert refused(guided_grammar='start: "a"', structured_outputs={"regex": "a"}).param == "structured_outputs"
    assert refused(structured_outputs={"regex": "a", "choice": ["a"]}).param == "structured_outputs"


def test_the_error_is_a_400_naming_the_parameter() -> None:
    err = refused(guided_regex="a((")
    assert isinstance(err, InvalidRequest) and err.status_code == 400
    assert err.param == "guided_regex" and "unclosed group" in err.message and str(err) == err.message


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}, "additionalProperties"),
        ({"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False}, "'a'"),
        (
            {
                "type": "object",
                "properties": {"inner": {"type": "object", "properties": {"x": {"type": "integer"}}}},
                "required": ["inner"],
                "additionalProperties": False,
            },
            "#/properties/inner",
        ),
        (
            {
                "type": "object",
                "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}}},
                "required": ["items"],
                "additionalProperties": False,
                "$defs": {"item": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
            },
            "#/$defs/item",
        ),
        (
            {
                "type": "object",
                "properties": {"v": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {}}]}},
                "required": ["v"],
                "additionalProperties": False,
            },
            "#/properties/v/anyOf/1",
        ),
        ({"type": "array", "items": {"type": "string"}}, "root schema to be an object"),
    ],
)
def test_strict_mode_violations_are_refused(schema: dict[str, Any], where: str) -> None:
    err = refused(response_format=schema_format(schema))
    assert err.param == "response_format.json_schema.schema" and where in err.message
    # the same schema is fine where strict mode does not apply
    assert constraint_from_request(response_format=schema_format(schema, strict=False)) is not None
    assert constraint_from_request(guided_json=schema) is not None


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "strng"}, "invalid JSON schema"),
        ({"type": "string", "minLength": -1}, "invalid JSON schema at minLength"),
        ({"type": "object", "required": [1]}, "invalid JSON schema at required/0"),
        ({"type": "string", "title": 5}, "invalid JSON schema at title"),  # a keyword llguidance never reads
        ({"properties": {"a": {"type": "integer", "maximum": "ten"}}}, "properties/a/maximum"),
        ([{"type": "string"}], "must be an object"),
        ({"type": "integer", "minimum": 5, "maximum": 2}, "Unsatisfiable"),  # valid JSON schema, matches nothing
        ({"$ref": "#/$defs/missing"}, "does not exist"),
    ],
)
def test_invalid_schemas_are_refused(schema: Any, message: str) -> None:
    err = refused(guided_json=schema)
    assert err.param == "guided_json" and message in err.message


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "array", "contains": {"type": "integer"}}, "contains"),
        ({"not": {"type": "string"}}, "not"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ],
)
def test_schema_features_llguidance_cannot_enforce_are_refused(schema: dict[str, Any], keyword: str) -> None:
    """Valid JSON schemas whose keyword would otherwise be silently ignored: refused, not approximated."""
    err = refused(response_format=schema_format(schema, strict=False))
    assert err.param == "response_format.json_schema.schema"
    assert "cannot enforce" in err.message and keyword in err.message


def test_malformed_schema_text_is_refused() -> None:
    assert "not valid JSON" in refused(guided_json='{"type": ').message
    assert "not JSON" in refused(guided_json={"type": "number", "maximum": float("nan")}).message


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"guided_regex": "a(("}, "guided_regex", "unclosed group"),
        ({"guided_regex": ""}, "guided_regex", "non-empty"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_choice": ["a", 3]}, "guided_choice", "non-empty string"),
        ({"guided_choice": "a"}, "guided_choice", "list"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "unknown name"),
        ({"guided_grammar": "   "}, "guided_grammar", "non-empty"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "must be an object"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
            "required",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": PERSON, "strict": "yes"},
                }
            },
            "response_format.json_schema.strict",
            "boolean",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type", "not supported"),
        ({"response_format": "json"}, "response_format", "must be an object"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
        ({"structured_outputs": ["json"]}, "structured_outputs", "must be an object"),
    ],
)
def test_malformed_fields_are_refused(fields: dict[str, Any], param: str, message: str) -> None:
    err = refused(**fields)
    assert err.param == param and message in err.message


@pytest.mark.parametrize("field", ["guided_json", "guided_regex", "guided_choice", "guided_grammar"])
def test_a_constraint_over_the_size_limit_is_refused(field: str) -> None:
    words = [f"w{i:06d}" for i in range(MAX_CONSTRAINT_BYTES // 8 + 1)]
    oversized: Any = {
        "guided_json": {"enum": words},
        "guided_regex": "|".join(words),
        "guided_choice": words,
        "guided_grammar": "start: " + " | ".join(json.dumps(w) for w in words),
    }[field]
    err = refused(**{field: oversized})
    assert err.param == field and f"the limit is {MAX_CONSTRAINT_BYTES}" in err.message
    # a tenth of it compiles: the limit, not the content, refused it
    half: Any = {
        "guided_json": {"enum": words[: len(words) // 10]},
        "guided_regex": "|".join(words[: len(words) // 10]),
        "guided_choice": words[: len(words) // 10],
        "guided_grammar": "start: " + " | ".join(json.dumps(w) for w in words[: len(words) // 10]),
    }[field]
    assert constraint_from_request(**{field: half}) is not None


def test_non_ascii_choices_and_schemas_keep_their_text() -> None:
    constraint = constraint_from_request(guided_choice=["café", 'naïve \\ "q"'])
    assert constraint is not None and json.loads(constraint.spec) == ["café", 'naïve \\ "q"']
    schema = {"type": "object", "properties": {"größe": {"type": "string"}}}
    constraint = constraint_from_request(guided_json=schema)
    assert constraint is not None and "größe" in constraint.spec


def test_a_lone_surrogate_in_a_schema_is_a_constraint_error_not_a_crash() -> None:
    with pytest.raises(ConstraintError, match="lone surrogate") as refused:
        constraint_from_request(guided_json={"type": "object", "properties": {"\ud800": {"type": "string"}}})
    assert refused.value.param == "guided_json"


# ---- shape limits and the grammar worker (issue 33) ---------------------------------------------

def chain(n: int, gbnf: bool = False) -> str:
    if gbnf:
        return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "a"\n'
    return "start: r0\n" + "".join(f"r{i}: r{i + 1} | \"b\"\n" for i in range(n)) + f'r{n}: "a"\n'


@pytest.mark.parametrize(("grammar", "message"), [
    (chain(1500), "rules and terminals"),
    (chain(1500, gbnf=True), "rules and terminals"),
    (chain(250), "reference one another 252 deep"),
    (chain(250, gbnf=True), "reference one another 252 deep"),
    ("start: " + "(" * 70 + '"a"' + ")" * 70, "nests brackets"),
    ('start: "a"{5000}', "repeats an element"),
    ("start: A\nA: /(a{100}){100}/", "expand past"),
], ids=["lark-rules", "gbnf-rules", "lark-depth", "gbnf-depth", "nesting", "grammar-repeat", "terminal-regex"])
def test_grammars_past_the_shape_limits_are_refused_before_compiling(grammar: str, message: str) -> None:
    with pytest.raises(ConstraintError) as caught:
        constraint_from_request(guided_grammar=grammar)
    assert caught.value.param == "guided_grammar" and message in caught.value.message, caught.value.message


def test_grammars_within_the_shape_limits_compile() -> None:
    for grammar in (chain(150), chain(150, gbnf=True), 'start: s\ns: "(" s ")" | "x"',  # recursion is not depth
                    'start: "a"{10} /[0-9]{3}-[0-9]{4}/ // a comment with ( and {9999}\n'):
        constraint = constraint_from_request(guided_grammar=grammar)
        assert constraint is not None and constraint.kind is ConstraintKind.GRAMMAR


@pytest.mark.parametrize(("regex", "expansion"), [
    (r"\d{3}-\d{4}", 8), ("(a{30}){30}", 900), ("((a|bc){10}|d){3}", 60), (r"\p{L}{2,3}", 3),
    ("[]{]{5}", 5), ("x{10,}", 10), ("(a{1000}){1000}", MAX_REPEAT_EXPANSION + 1),
])
def test_regex_expansion_counts_atoms_with_repetition_written_out(regex: str, expansion: int) -> None:
    assert regex_shape(regex)[0] == expansion


@pytest.mark.parametrize("fields", [
    {"guided_regex": "(a{1000}){1000}"},
    {"guided_regex": "(x?){2500}x{2500}"},  # each bound small, together "too many expressions" at the first token
    {"guided_regex": "(" * 70 + "a" + ")" * 70},
    {"guided_json": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(a{100}){100}"}}}},
    {"guided_json": {"type": "object", "patternProperties": {"(k{100}){100}": {}}}},
])
def test_regexes_past_the_limits_are_refused(fields: dict[str, Any]) -> None:
    with pytest.raises(ConstraintError) as caught:
        constraint_from_request(**fields)
    assert caught.value.param == next(iter(fields))


def nested(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


DEEP_TEXT = '{"type":"object","properties":{"a":' * 1000 + '{"type":"string"}' + "}}" * 1000  # past json's recursion


@pytest.mark.parametrize("schema", [nested(40), json.dumps(nested(40)), DEEP_TEXT])
def test_a_schema_nested_past_the_limit_is_refused_not_a_recursion_error(schema: Any) -> None:
    with pytest.raises(ConstraintError) as caught:
        constraint_from_request(guided_json=schema)
    assert caught.value.param == "guided_json"


def test_a_schema_nested_within_the_limit_compiles() -> None:
    assert constraint_from_request(guided_json=nested(20)) is not None


def test_the_grammar_worker_survives_a_compiler_crash_and_remembers_verdicts() -> None:
    """The chain that overflowed llguidance's stack in the serving process kills only the worker
    (the shape limits are bypassed here: this is what stands behind them); the next grammar gets
    a new worker, and each grammar is compiled once."""
    checker = GrammarChecker()
    try:
        crash = llguidance.grammar_from("grammar", chain(3000))
        assert "SIGSEGV" in checker.check(crash, LIMITS)
        assert checker.restarts == 1
        fine = llguidance.grammar_from("grammar", 'start: "a"')
        assert checker.check(fine, LIMITS) == ""
        assert "SIGSEGV" in checker.check(crash, LIMITS)  # remembered, not compiled again
        assert checker.check(fine, LIMITS) == ""
        assert (checker.compiles, checker.restarts) == (2, 1)
    finally:
        checker.close()


def test_the_grammar_worker_refuses_a_grammar_past_its_cpu_budget() -> None:
    checker = GrammarChecker(cpu_s=1)
    try:
        # far past the 1-2 s budget: 300 patterns took 1.6-2.8 s of CPU here (too close), 600 took 33 s
        schema = {"type": "object", "additionalProperties": False,
                  "patternProperties": {f"^[a-z]*{i}[a-z]*$": {"type": "string"} for i in range(450)}}
        verdict = checker.check(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)), LIMITS)
        assert "of CPU to compile" in verdict, verdict
    finally:
        checker.close()
