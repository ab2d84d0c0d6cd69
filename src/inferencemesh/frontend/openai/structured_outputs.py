"""The OpenAI and vLLM request fields that constrain a request's output, read into one
engine Constraint (frontend/engine/constraints.py compiles and validates it).

Sources, exactly one per request:
    response_format   {"type": "json_object"} | {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    guided_json       a JSON schema (dict, or its JSON text)           (vLLM)
    guided_regex      a regular expression the whole output matches    (vLLM)
    guided_choice     a list of strings, the output is one of them     (vLLM)
    guided_grammar    a Lark (or GBNF) grammar                         (vLLM)
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object": ...}  (vLLM >= 0.10)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inferencemesh.frontend.engine.constraints import (
    Constraint,
    ConstraintKind,
    choice_constraint,
    grammar_constraint,
    json_object_constraint,
    json_schema_constraint,
    regex_constraint,
)
from inferencemesh.frontend.engine.errors import ConstraintError

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
