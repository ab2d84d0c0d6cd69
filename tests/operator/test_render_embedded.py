"""Rendering with the first stage embedded in the frontend pod: no stage-0 objects, the frontend in stage 0's place."""

from __future__ import annotations

import dataclasses

import pytest
from render_fixtures import (
    MESH_WIDE,
    certificate_secrets,
    children,
    container,
)

from inferencemesh.config import FrontendConfig
from inferencemesh.flags import from_args
from inferencemesh.operator import names as N
from inferencemesh.operator import render_pod as P
from inferencemesh.operator import resources
from inferencemesh.programs.cli import build_parser

EMBEDDED = {
    "model": {"name": "Llama-70B", "pvc": {"claimName": "models", "subPath": "llama/70b"},
              "layout": {"numLayers": 8, "layerBytes": 10}},
    "stages": {"gpus": 1, "device": "cuda",
               "resources": {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "16Gi"}},
               "nodeSelector": {"gpu": "h100"}, "tolerations": [{"key": "gpu", "operator": "Exists"}],
               "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                   {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}}},
    "frontend": {"embedFirstStage": True, "maxBatchTokens": 512,
                 "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
                 "nodeSelector": {"pool": "serving"}, "tolerations": [{"key": "serving", "operator": "Exists"}]},
}


def frontend_config(objs: dict) -> FrontendConfig:
    """What the frontend program makes of its pod's arguments."""
    args = container(objs[("Deployment", "code-p0-frontend")])["args"]
    assert args[0] == "frontend"
    return from_args(FrontendConfig, build_parser().parse_args(args))


def test_an_embedded_first_stage_renders_no_stage_0_objects_and_runs_in_the_frontend() -> None:
    objs = children(EMBEDDED)
    assert sorted(objs) == sorted(
        MESH_WIDE + [("Deployment", "code-p0-frontend")]
        + [(kind, f"code-p0-stage-{i}") for i in (1, 2) for kind in ("Deployment", "Service", "NetworkPolicy")]
        + certificate_secrets(range(1, 3)))
    # the frontend's config is the separate-stage one with exactly the embedded stage's fields changed
    separate = frontend_config(children({**EMBEDDED, "frontend": {**EMBEDDED["frontend"], "embedFirstStage": False}}))
    assert separate.first_stage_layers is None and separate.num_stages == 3
    assert frontend_config(objs) == dataclasses.replace(
        separate, first_stage_layers=(0, 3),
        stage_addresses=("code-p0-stage-1.ml.svc:50051", "code-p0-stage-2.ml.svc:50051"),
        threads=2, device="cuda")
    assert separate.max_batch_tokens == 512
    assert frontend_config(objs).num_stages == 3 and frontend_config(objs).model == "/models/llama/70b"
    # the stages after it keep their index, range and downstream
    parser = build_parser()
    for i, (start, end) in ((1, (3, 6)), (2, (6, 8))):
        parsed = parser.parse_args(container(objs[("Deployment", f"code-p0-stage-{i}")])["args"])
        assert (parsed.stage_index, parsed.num_stages, parsed.layers) == (i, 3, (start, end))
    assert parser.parse_args(container(objs[("Deployment", "code-p0-stage-1")])["args"]).downstream == \
        "code-p0-stage-2.ml.svc:50051"


def test_the_embedded_frontend_pod_takes_stage_0s_resources_gpu_claim_and_placement() -> None:
    front = children(EMBEDDED)[("Deployment", "code-p0-frontend")]
    pod = front["spec"]["template"]["spec"]
    c = container(front)
    # stage 0's work and the frontend's, in one container: summed, with the GPU stage 0 would have had
    assert c["resources"] == {"requests": {"cpu": "2500m", "memory": "9Gi"},
                              "limits": {"memory": "16Gi", "nvidia.com/gpu": "1"}}
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod["volumes"]
    assert {"name": "model", "mountPath": P.MODELS_MOUNT, "readOnly": True} in c["volumeMounts"]
    assert pod["nodeSelector"] == {"gpu": "h100", "pool": "serving"}
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists"}, {"key": "serving", "operator": "Exists"}]
    assert pod["affinity"] == EMBEDDED["stages"]["affinity"]
    assert front["spec"]["replicas"] == 1  # one frontend per pipeline
    # a GPU pod never surges (no spare GPU); loading layers gets the stage's startup budget
    assert front["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] == 1800
    assert front["spec"]["template"]["metadata"]["annotations"]["inferencemesh.io/layers"] == "0:3"
    # without embedding, the frontend pod is what it was
    plain = children({**EMBEDDED, "frontend": {**EMBEDDED["frontend"], "embedFirstStage": False}})
    plain_front = plain[("Deployment", "code-p0-frontend")]
    assert container(plain_front)["resources"] == {"requests": {"cpu": "500m", "memory": "1Gi"}}
    assert plain_front["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "serving"}
    assert "affinity" not in plain_front["spec"]["template"]["spec"]
    assert plain_front["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}


def test_stage_1_admits_the_frontend_as_its_upstream_and_nothing_else() -> None:
    objs = children(EMBEDDED)

    def sources(i: int) -> list[dict]:
        grpc_rule = objs[("NetworkPolicy", f"code-p0-stage-{i}")]["spec"]["ingress"][0]
        return [p["podSelector"]["matchLabels"] for p in grpc_rule["from"]]

    assert sources(1) == [N.frontend_selector("code", 0)]  # no selector for stage-0 pods that do not exist
    assert sources(2) == [N.frontend_selector("code", 0), N.stage_selector("code", 0, 1)]


def test_a_one_stage_plan_embedded_has_no_stage_objects_at_all() -> None:
    objs = children({"model": {"name": "bundled://imesh-code-target"}, "stages": {"count": 1, "gpus": 0},
                     "frontend": {"embedFirstStage": True}}, ranges=[(0, 8)])
    assert sorted(objs) == sorted([*MESH_WIDE, ("Deployment", "code-p0-frontend"),
                                   *certificate_secrets(range(0))])
    config = frontend_config(objs)
    assert config.stage_addresses == () and config.first_stage_layers == (0, 8) and config.num_stages == 1
    front = objs[("Deployment", "code-p0-frontend")]
    assert "nvidia.com/gpu" not in (container(front)["resources"].get("limits") or {})
    assert front["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}  # no GPU to hold


@pytest.mark.parametrize(("resources", "threads"), [
    ({"requests": {"cpu": "1500m"}}, 2),
    ({"requests": {"cpu": "1"}, "limits": {"cpu": "2500m"}}, 3),  # the pod's quota also feeds the frontend: the limit
    ({}, 0),
])
def test_the_embedded_stage_threads_follow_stage_0s_cpu(resources: dict, threads: int) -> None:
    objs = children({"model": {"name": "org/m"}, "stages": {"resources": resources},
                     "frontend": {"embedFirstStage": True, "resources": {"limits": {"cpu": "1"}}}})
    assert frontend_config(objs).threads == threads


def test_sum_resources() -> None:
    assert resources.sum_resources({"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"nvidia.com/gpu": 2}},
                           {"requests": {"cpu": "1", "memory": "1G"}, "limits": {"cpu": "250m"}}) == {
        "requests": {"cpu": "1500m", "memory": "1536870912"}, "limits": {"nvidia.com/gpu": "2", "cpu": "250m"}}
    assert resources.sum_resources({}, {}) == {}
