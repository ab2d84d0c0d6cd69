"""The spec's defaults and cross-field rules agree between the CRD (one source of truth) and Python."""

from __future__ import annotations

import copy
from pathlib import Path

import celpy
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from inferencemesh.operator import spec as S

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "inferencemesh.io_inferencemeshes.yaml"
CRD = yaml.safe_load(CRD_PATH.read_text())
SPEC_SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
_CEL = celpy.Environment()
_PROGRAMS: dict[str, celpy.Runner] = {}


def apply_defaults(schema: dict, value: object) -> object:
    """Structural-schema defaulting as the API server does it: recurse into present objects."""
    if not isinstance(value, dict) or schema.get("type") != "object":
        return value
    out = dict(value)
    for key, sub in (schema.get("properties") or {}).items():
        if key not in out and "default" in sub:
            out[key] = copy.deepcopy(sub["default"])
        if key in out:
            out[key] = apply_defaults(sub, out[key])
    return out


def cel_errors(schema: dict, value: object) -> set[str]:
    """Evaluate every x-kubernetes-validations rule of the schema against the value, like the API server."""
    errors = set()
    if value is None:
        return errors
    for rule in schema.get("x-kubernetes-validations") or []:
        if rule["rule"] not in _PROGRAMS:
            _PROGRAMS[rule["rule"]] = _CEL.program(_CEL.compile(rule["rule"]))
        ok = _PROGRAMS[rule["rule"]].evaluate({"self": celpy.json_to_cel(value)})
        if not ok:
            errors.add(rule["message"])
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            errors |= cel_errors(sub, value.get(key))
    if isinstance(value, list) and "items" in schema:
        for item in value:
            errors |= cel_errors(schema["items"], item)
    return errors


def python_errors(spec: dict) -> set[str]:
    return set(S.validate(S.parse_spec(spec)))


def test_python_defaults_equal_the_crd_defaults() -> None:
    minimal = {"model": {"name": "org/model"}}
    defaulted = apply_defaults(SPEC_SCHEMA, minimal)
    assert defaulted["stages"]["count"] == 2 and defaulted["speculative"]["window"]["policy"] == "adaptive"
    assert S.parse_spec(minimal) == S.parse_spec(defaulted)


def test_every_cel_rule_has_its_message_in_python() -> None:
    messages = {v for k, v in vars(S).items() if k.startswith("MSG_")}
    in_crd = set()

    def walk(schema: dict) -> None:
        in_crd.update(r["message"] for r in schema.get("x-kubernetes-validations") or [])
        for sub in (schema.get("properties") or {}).values():
            walk(sub)
        if "items" in schema:
            walk(schema["items"])

    walk(SPEC_SCHEMA)
    assert in_crd == messages


CASES = [
    ({}, set()),
    ({"stages": {"count": "auto"}}, {S.MSG_AUTO_MEMORY}),
    ({"stages": {"count": "auto", "memory": ["24Gi"]}}, set()),
    ({"stages": {"count": "three"}}, {S.MSG_COUNT, S.MSG_AUTO_MEMORY}),
    ({"stages": {"count": 3, "memory": ["24Gi", "16Gi"]}}, {S.MSG_MEMORY_COUNT}),
    ({"stages": {"count": 2, "memory": ["24Gi", "16Gi"]}}, set()),
    ({"stages": {"count": 3, "ranges": [{"start": 0, "end": 2}, {"start": 2, "end": 4}]}}, {S.MSG_RANGES_COUNT}),
    ({"stages": {"count": 2, "ranges": [{"start": 0, "end": 3}, {"start": 2, "end": 4}]}}, {S.MSG_RANGES_OVERLAP}),
    ({"stages": {"count": 2, "ranges": [{"start": 0, "end": 2}, {"start": 0, "end": 2}]}}, {S.MSG_RANGES_OVERLAP}),
    ({"stages": {"count": 2, "ranges": [{"start": 3, "end": 3}, {"start": 0, "end": 3}]}},
     {S.MSG_RANGE_ORDER, S.MSG_RANGES_OVERLAP}),
    ({"model": {"name": "m", "pvc": {"claimName": "c"}}}, {S.MSG_PVC_LAYOUT}),
    ({"speculative": {"draft": "d", "noDraft": True}}, {S.MSG_DRAFT_NODRAFT}),
    ({"speculative": {"draft": "d", "strategy": "ngram"}}, {S.MSG_DRAFT_STRATEGY}),
    ({"speculative": {"window": {"policy": "adaptive", "min": 5, "initial": 4, "max": 8}}}, {S.MSG_WINDOW}),
    ({"speculative": {"window": {"policy": "fixed", "min": 5, "initial": 4, "max": 2}}}, set()),
]


@pytest.mark.parametrize(("patch", "expected"), CASES)
def test_rules_table(patch: dict, expected: set[str]) -> None:
    spec = {"model": {"name": "org/model"}}
    for key, value in patch.items():
        spec[key] = {**spec.get(key, {}), **value}
    defaulted = apply_defaults(SPEC_SCHEMA, spec)
    assert cel_errors(SPEC_SCHEMA, defaulted) == expected
    assert python_errors(defaulted) == expected
    assert python_errors(spec) == expected  # the operator also copes with an un-defaulted spec


_range = st.builds(lambda a, b: {"start": a, "end": b}, st.integers(0, 8), st.integers(0, 9))
_specs = st.fixed_dictionaries(
    {"model": st.fixed_dictionaries({"name": st.just("org/m")},
                                    optional={"pvc": st.just({"claimName": "c"}),
                                              "layout": st.just({"numLayers": 4, "layerBytes": 10})})},
    optional={
        "stages": st.fixed_dictionaries({}, optional={
            "count": st.one_of(st.integers(1, 5), st.sampled_from(["auto", "x"])),
            "memory": st.lists(st.sampled_from(["1Gi", "2Gi"]), max_size=4),
            "ranges": st.lists(_range, max_size=4),
        }),
        "speculative": st.fixed_dictionaries({}, optional={
            "strategy": st.sampled_from(["auto", "draft", "ngram", "none"]),
            "draft": st.just("org/draft"),
            "noDraft": st.booleans(),
            "window": st.fixed_dictionaries({}, optional={
                "policy": st.sampled_from(["fixed", "adaptive"]),
                "initial": st.integers(1, 9), "min": st.integers(1, 9), "max": st.integers(1, 9)}),
        }),
    },
)


@settings(max_examples=150, deadline=None)
@given(_specs)
def test_python_rules_agree_with_cel_on_random_specs(spec: dict) -> None:
    defaulted = apply_defaults(SPEC_SCHEMA, spec)
    assert python_errors(defaulted) == cel_errors(SPEC_SCHEMA, defaulted)


def test_window_flag() -> None:
    assert S.WindowSpec(policy="fixed", size=6).flag() == "6"
    assert S.WindowSpec(policy="adaptive", initial=3, min=1, max=7).flag() == "adaptive:3:1:7"
