"""What can be checked without a cluster: CRD drift, chart lint/render/schema, Dockerfiles."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import helm_python as helm
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "inferencemesh.io_inferencemeshes.yaml"
CHART = REPO / "charts" / "inferencemesh"
# Every image is a target of the root Dockerfile; the image folders document theirs.
DOCKERFILE = REPO / "Dockerfile"
IMAGE_TARGETS = {"stage": "stage_image", "frontend": "frontend_image", "operator": "operator"}


def render(values: dict | None = None) -> list[dict]:
    out = helm.Chart.load(str(CHART)).render(values or {}, name="imesh", namespace="imesh-system", is_install=True)
    return [doc for path, text in out.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]


def test_the_chart_installs_the_very_same_crd() -> None:
    copies = list((CHART / "crds").iterdir())
    assert [p.name for p in copies] == [CRD_PATH.name]
    assert copies[0].read_bytes() == CRD_PATH.read_bytes(), (
        "charts/inferencemesh/crds/ drifted from crds/: "
        "cp crds/inferencemesh.io_inferencemeshes.yaml charts/inferencemesh/crds/")
    (crd,) = helm.Chart.load(str(CHART)).crds  # what Helm itself will install
    assert crd["data"] == CRD_PATH.read_text()


def test_crd_shape() -> None:
    crd = yaml.safe_load(CRD_PATH.read_text())
    assert crd["metadata"]["name"] == "inferencemeshes.inferencemesh.io"
    assert crd["spec"]["names"]["kind"] == "InferenceMesh" and crd["spec"]["names"]["shortNames"] == ["imesh"]
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"]["status"] == {}
    # `kubectl scale imesh` (and an HPA) count pipelines: one frontend pod each
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                                "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}
    columns = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert columns == ["Model", "Pipelines", "Stages", "Ready", "Endpoint", "Age"]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert {"phase", "conditions", "observedGeneration", "stages", "endpoint", "speculative",
            "replicas", "selector", "pipelines", "pipelinesSummary"} <= set(status)
    assert not {"frontendReplicas", "frontendSelector"} & set(status)
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert spec["replicas"]["default"] == 1 and spec["replicas"]["minimum"] == 0
    assert "replicas" not in spec["frontend"]["properties"]  # spec.replicas counts pipelines, each with one frontend
    assert spec["restartBudget"]["properties"]["restarts"]["default"] == 5
    assert spec["restartBudget"]["properties"]["windowSeconds"]["default"] == 600


def test_helm_lint_is_clean() -> None:
    report = helm.lint(str(CHART), strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_rbac_is_least_privilege() -> None:
    for values in ({}, {"watchNamespaces": ["team-a", "team-b"], "peering": {"enabled": True}}):
        docs = render(values)
        roles = [d for d in docs if d["kind"] in ("ClusterRole", "Role")]
        assert roles
        for role in roles:
            for rule in role["rules"]:
                for key in ("verbs", "resources", "apiGroups"):
                    assert "*" not in rule.get(key, []), (role["metadata"]["name"], rule)
                if rule.get("resources") == ["pods"]:
                    assert rule["verbs"] == ["get", "list", "watch"]
    namespaced = render({"watchNamespaces": ["team-a"]})
    cluster_role = next(d for d in namespaced if d["kind"] == "ClusterRole")
    granted = {r for rule in cluster_role["rules"] for r in rule["resources"]}
    assert granted == {"customresourcedefinitions", "namespaces"}  # the rest is a Role in team-a only
    assert [d["metadata"]["namespace"] for d in namespaced if d["kind"] == "Role"] == ["team-a"]


def test_operator_deployment_is_hardened() -> None:
    docs = render({"watchNamespaces": ["team-a"]})
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["args"][0] == "operator" and "--standalone" in c["args"] and "--namespace=team-a" in c["args"]
    assert dep["spec"]["strategy"]["type"] == "Recreate" and dep["spec"]["replicas"] == 1
    assert pod["serviceAccountName"] == "imesh-inferencemesh-operator"


def test_service_monitors_are_optional() -> None:
    assert not [d for d in render() if d["kind"] == "ServiceMonitor"]
    # Enabled, but this render has no monitoring.coreos.com/v1 API: nothing (test_monitoring.py renders with it).
    assert not [d for d in render({"serviceMonitor": {"enabled": True}}) if d["kind"] == "ServiceMonitor"]


@pytest.mark.parametrize("bad", [{"image": {"repository": "x", "pullPolicy": "Sometimes"}},
                                 {"watchNamespaces": ["Not_A_Namespace"]}, {"replicaCount": -1}, {"unknownKey": 1}])
def test_values_schema_rejects_bad_values(bad: dict) -> None:
    chart = helm.Chart.load(str(CHART))
    chart.validate_schema({})
    with pytest.raises(helm.HelmError):
        chart.validate_schema(bad)


def test_chart_readme_shows_the_example() -> None:
    readme = (CHART / "README.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", readme, re.S)]
    example = yaml.safe_load((REPO / "examples" / "inferencemesh.yaml").read_text())
    assert example in blocks


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _stages(ins: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """Each build stage's instructions by name, each stage prefixed with those of the stage it is FROM."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for word, rest in ins:
        if word == "FROM":
            image, *alias = rest.split()
            current = list(stages.get(image, [])) + [(word, rest)]
            if alias[:1] == ["AS"]:
                stages[alias[1]] = current
        else:
            current.append((word, rest))
    return stages


def test_one_dockerfile_builds_every_image_from_one_wheel_stage() -> None:
    ins = _instructions(DOCKERFILE)
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    # the base images are build arguments with pinned defaults (no :latest, no untagged image)
    bases = {}
    for word, rest in ins:
        if word == "ARG" and rest.split("=")[0].endswith("BASE_IMAGE"):
            name, default = rest.split("=", 1)
            assert ":" in default and not default.endswith(":latest"), rest
            bases[name] = default
    stages = _stages(ins)
    # every build stage starts from a base argument or from an earlier stage of the same file
    for word, rest in ins:
        if word == "FROM":
            image = rest.split()[0]
            assert image.strip("${}") in bases or image in stages, f"FROM {rest}"
    # the project's wheel is built in one stage, and each image installs that one
    wheel_builders = [name for name, body in stages.items() if any("pip wheel" in rest for _, rest in body)]
    assert wheel_builders == ["wheel"]
    for word, rest in ins:
        if word == "COPY" and not rest.startswith("--from"):
            *sources, _dest = rest.split()
            for src in sources:
                assert (REPO / src).exists(), f"COPY {src} does not exist in the build context"
    from inferencemesh.programs.cli import build_parser

    subcommands = build_parser()._subparsers._group_actions[0].choices
    for target, folder in IMAGE_TARGETS.items():
        body = stages[target]
        assert ("COPY", "--from=wheel /wheels /wheels") in body, target
        users = [rest for word, rest in body if word == "USER"]
        assert users and users[-1].split(":")[0] not in ("root", "0"), target
        entry = [rest for word, rest in body if word == "ENTRYPOINT"][-1]
        program = yaml.safe_load(entry)[0]
        assert program in scripts and scripts[program] == "inferencemesh.programs.cli:main"
        cmd = [yaml.safe_load(rest) for word, rest in body if word == "CMD"][-1]
        assert cmd[0] in subcommands, target  # each target runs a real subcommand
        # the image's folder says how it is built and what it runs
        readme = (REPO / folder / "README.md").read_text()
        assert f"--target {target}" in readme and cmd[0] in readme
