"""The spec model's fields, defaults and cross-field rules agree with the CRD (one source of truth)."""

from __future__ import annotations

import copy
import typing
from pathlib import Path

import celpy
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, TypeAdapter

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
    assert defaulted["stages"]["count"] == 2
    # unset stays unset: the package's strategy (else auto) and the package's window (else the frontend's)
    assert "strategy" not in defaulted["speculative"] and "window" not in defaulted["speculative"]
    assert S.parse_spec(minimal) == S.parse_spec(defaulted)
    assert S.parse_spec(minimal).speculative.strategy is None and S.parse_spec(minimal).speculative.window is None
    # a window that is given gets the CRD's defaults for what it leaves out, on both sides
    windowed = {"model": {"name": "org/model"}, "speculative": {"window": {"initial": 2}}}
    assert apply_defaults(SPEC_SCHEMA, windowed)["speculative"]["window"]["policy"] == "adaptive"
    assert S.parse_spec(windowed) == S.parse_spec(apply_defaults(SPEC_SCHEMA, windowed))


# ---- the model mirrors the CRD's spec schema ---------------------------------------------------

class Field(typing.NamedTuple):
    annotation: object
    required: bool
    default: object


def model_fields(cls: type) -> dict[str, Field]:
    """A pydantic model's or a NamedTuple's fields, by the name they have in the CRD."""
    if issubclass(cls, BaseModel):
        return {f.alias or name: Field(f.annotation, f.is_required(), f.get_default(call_default_factory=True))
                for name, f in cls.model_fields.items()}
    hints = typing.get_type_hints(cls)
    return {name: Field(hints[name], name not in cls._field_defaults, cls._field_defaults.get(name))
            for name in cls._fields}


def type_args(annotation: object) -> list[object]:
    """Every type inside an annotation: X | None -> [X, None]; tuple[X, ...] -> [X, ...]; and so on."""
    found = [annotation]
    for arg in typing.get_args(annotation):
        found += type_args(arg)
    return found


def nested_model(annotation: object) -> type | None:
    return next((a for a in type_args(annotation) if isinstance(a, type) and a is not tuple
                 and (issubclass(a, BaseModel) or hasattr(a, "_fields"))), None)


def literal_values(annotation: object) -> set | None:
    literals = [a for a in type_args(annotation) if typing.get_origin(a) is typing.Literal]
    return {v for lit in literals for v in typing.get_args(lit)} if literals else None


ABSENT = (None, "", (), {})  # what a field the CRD gives no default holds when unset


def schema_drift(cls: type, schema: dict, path: str) -> list[str]:
    """How the model class and the CRD (sub)schema disagree: fields, required, defaults, enums."""
    properties, fields = schema.get("properties") or {}, model_fields(cls)
    problems = [f"{path}.{key}: in the CRD but not in {cls.__name__}" for key in properties.keys() - fields.keys()]
    problems += [f"{path}.{key}: in {cls.__name__} but not in the CRD" for key in fields.keys() - properties.keys()]
    required = set(schema.get("required") or ())
    for key in sorted(properties.keys() & fields.keys()):
        prop, field, where = properties[key], fields[key], f"{path}.{key}"
        if field.required != (key in required):
            problems.append(f"{where}: required in the CRD: {key in required}, in the model: {field.required}")
        if "default" in prop:
            want = TypeAdapter(field.annotation).validate_python(prop["default"])
            if field.required or field.default != want:
                problems.append(f"{where}: CRD default {prop['default']!r}, model default {field.default!r}")
        elif not field.required and not any(field.default == a and type(field.default) is type(a) for a in ABSENT):
            problems.append(f"{where}: no CRD default, but the model defaults to {field.default!r}")
        if literal_values(field.annotation) != (set(prop["enum"]) if "enum" in prop else None):
            problems.append(f"{where}: CRD enum {prop.get('enum')}, model {literal_values(field.annotation)}")
        sub_schema = prop if "properties" in prop else (prop.get("items") or {})
        sub_model = nested_model(field.annotation)
        if "properties" in sub_schema or sub_model is not None:
            if sub_model is None or "properties" not in sub_schema:
                problems.append(f"{where}: an object in one of CRD and model, not in the other")
            else:
                problems += schema_drift(sub_model, sub_schema, where)
    return problems


def test_the_spec_model_mirrors_the_crd_schema() -> None:
    """Every CRD spec property is a model field and vice versa, with the same default, requiredness and enum."""
    assert schema_drift(S.MeshSpec, SPEC_SCHEMA, "spec") == []


def test_the_drift_check_catches_drift() -> None:
    drifted = copy.deepcopy(SPEC_SCHEMA)
    stages = drifted["properties"]["stages"]["properties"]
    stages["gpus"]["default"] = 2
    stages["newKnob"] = {"type": "string"}
    del drifted["properties"]["telemetry"]["properties"]["debugTracing"]
    drifted["properties"]["speculative"]["properties"]["strategy"]["default"] = "auto"
    drifted["properties"]["model"]["properties"]["dtype"]["enum"].append("float8")
    drifted["properties"]["frontend"]["properties"]["apiKeySecret"]["required"] = []
    found = "\n".join(schema_drift(S.MeshSpec, drifted, "spec"))
    for path in ("spec.stages.gpus: CRD default 2", "spec.stages.newKnob: in the CRD",
                 "spec.telemetry.debugTracing: in TelemetrySpec but not", "spec.speculative.strategy: CRD default",
                 "spec.model.dtype: CRD enum", "spec.frontend.apiKeySecret.name: required"):
        assert path in found, found


def test_a_spec_the_model_refuses_names_the_fields() -> None:
    """Only an object the API server did not check against this CRD gets here (e.g. stored before a CRD
    change); the reconciler reports the message as Planned=False/InvalidSpec."""
    with pytest.raises(S.SpecError) as err:
        S.parse_spec({"model": {"name": "m", "dtype": "float8"}, "stages": {"gpus": "many"}, "frontend": []})
    message = str(err.value)
    assert "spec.model.dtype: Input should be 'auto', 'float32', 'float16' or 'bfloat16'" in message
    assert "spec.stages.gpus: Input should be a valid integer" in message
    assert "spec.frontend: Input should be a valid dictionary" in message
    with pytest.raises(S.SpecError, match=r"spec\.model: Field required"):
        S.parse_spec({})


def test_nested_fields_keep_their_flat_names() -> None:
    spec = S.parse_spec({"model": {"name": "m", "pvc": {"claimName": "c"}, "layout": {"numLayers": 2, "layerBytes": 1}},
                         "frontend": {"service": {"type": "NodePort", "port": 443},
                                      "apiKeySecret": {"name": "keys"}},
                         "telemetry": {"metrics": False, "debugTracing": True},
                         "security": {"mtlsSecretName": "tls"},
                         "stages": {"count": 2, "ranges": [{"start": 0, "end": 1}, {"start": 1, "end": 2}]}})
    assert (spec.model.pvc_claim, spec.model.pvc_sub_path) == ("c", "")
    assert (spec.frontend.service_type, spec.frontend.service_port) == ("NodePort", 443)
    assert (spec.frontend.api_key_secret, spec.frontend.api_key_key) == ("keys", "api-key")
    assert (spec.metrics, spec.debug_tracing, spec.mtls_secret) == (False, True, "tls")
    assert spec.stages.ranges == ((0, 1), (1, 2)) and spec.stages.ranges[1].start == 1
    bare = S.parse_spec({"model": {"name": "m"}})
    assert (bare.model.pvc_claim, bare.frontend.api_key_secret, bare.mtls_secret, bare.stages.ranges) == (
        None, None, None, None)


def test_security_modes_and_the_certificate_lifetime() -> None:
    security = SPEC_SCHEMA["properties"]["security"]["properties"]
    assert security["certificateLifetime"]["pattern"] == S.LIFETIME_PATTERN  # the API server checks the same
    default = S.parse_spec({"model": {"name": "m"}})
    assert default.tls and default.issues_certificates and default.security.lifetime.days == 90
    byo = S.parse_spec({"model": {"name": "m"}, "security": {"mtlsSecretName": "mine", "mtls": False}})
    assert byo.tls and not byo.issues_certificates  # the user's Secret wins
    plain = S.parse_spec({"model": {"name": "m"}, "security": {"mtls": False}})
    assert not plain.tls and not plain.issues_certificates
    for text, seconds in (("60s", 60), ("90s", 90), ("30m", 1800), ("720h", 2592000)):
        assert S.parse_spec({"model": {"name": "m"}, "security": {"certificateLifetime": text}}) \
            .security.lifetime.total_seconds() == seconds
    for bad in ("59s", "0m", "1d", "10", "1h30m", "-5m"):
        with pytest.raises(S.SpecError, match="certificateLifetime"):
            S.parse_spec({"model": {"name": "m"}, "security": {"certificateLifetime": bad}})


def test_max_batch_tokens_is_the_frontends_and_the_removed_fields_are_ignored() -> None:
    assert S.parse_spec({"model": {"name": "m"}}).max_batch_tokens == 256
    assert S.parse_spec({"model": {"name": "m"}, "frontend": {"maxBatchTokens": 1024}}).max_batch_tokens == 1024
    # stages.maxBatchTokens and frontend.replicas are gone from the CRD: the API server prunes them
    # (test_cluster), and a spec that still carries them parses as if they were absent
    props = SPEC_SCHEMA["properties"]
    assert "maxBatchTokens" not in props["stages"]["properties"] and "replicas" not in props["frontend"]["properties"]
    old = S.parse_spec({"model": {"name": "m"}, "stages": {"maxBatchTokens": 64}, "frontend": {"replicas": 3}})
    assert old == S.parse_spec({"model": {"name": "m"}})


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
    ({"speculative": {"draft": "d"}}, set()),  # unset strategy: a named draft means draft
    ({"speculative": {"draft": "d", "strategy": "auto"}}, set()),
    ({"speculative": {"window": {"policy": "adaptive", "min": 5, "initial": 4, "max": 8}}}, {S.MSG_WINDOW}),
    ({"speculative": {"window": {"policy": "fixed", "min": 5, "initial": 4, "max": 2}}}, set()),
    ({"frontend": {"embedFirstStage": True, "nodeSelector": {"gpu": "a100", "zone": "a"}},
      "stages": {"nodeSelector": {"gpu": "h100"}}}, {S.MSG_EMBED_NODE_SELECTOR}),
    ({"frontend": {"embedFirstStage": True, "nodeSelector": {"gpu": "h100", "zone": "a"}},
      "stages": {"nodeSelector": {"gpu": "h100"}}}, set()),  # agreeing keys merge
    ({"frontend": {"nodeSelector": {"gpu": "a100"}}, "stages": {"nodeSelector": {"gpu": "h100"}}}, set()),
    ({"prefixCache": False, "kvCacheTokens": 4096}, set()),  # a pool without sharing
]


@pytest.mark.parametrize(("patch", "expected"), CASES)
def test_rules_table(patch: dict, expected: set[str]) -> None:
    spec = {"model": {"name": "org/model"}}
    for key, value in patch.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
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
            "nodeSelector": st.dictionaries(st.sampled_from(["gpu", "zone"]), st.sampled_from(["a", "b"])),
        }),
        "frontend": st.fixed_dictionaries({}, optional={
            "embedFirstStage": st.booleans(),
            "nodeSelector": st.dictionaries(st.sampled_from(["gpu", "zone"]), st.sampled_from(["a", "b"])),
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
