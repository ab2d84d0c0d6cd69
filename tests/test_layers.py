"""The import direction: shared foundations at the bottom, the three libraries on top of them and
blind to each other's internals, the programs over everything.

    programs (cli, serve, stage, frontend, plan, bench, operator, router)   (top: may import anything below)
    stage | frontend | operator | router         (none imports another, nor the top)
    protocol, modeling, planner, checkpoint, sampling, config, speculation, tls, bundled

A module's layer is its path under src/inferencemesh (import names are paths). There is no
exception: a stage in the frontend's process is joined to it by a program (programs/mesh.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
LIBRARIES = {"stage", "frontend", "operator", "router"}
TOP = {"programs", "__main__"}


def layer_of(module: str) -> str:
    """'inferencemesh.stage.server' -> 'stage'; bottom modules -> 'bottom'."""
    parts = module.split(".")
    if parts[0] != "inferencemesh" or len(parts) == 1:
        return "external" if parts[0] != "inferencemesh" else "bottom"
    return parts[1] if parts[1] in LIBRARIES | TOP else "bottom"


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (the project uses absolute imports only)"
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def sources() -> list[tuple[str, Path]]:
    files = []
    for path in (SRC / "inferencemesh").rglob("*.py"):
        module = ".".join(path.relative_to(SRC).with_suffix("").parts)
        package = module.split(".")[1]
        files.append((package if package in LIBRARIES | TOP else "bottom", path))
    assert {layer for layer, _ in files} >= LIBRARIES | {"programs", "bottom"}, "the layout moved: update this test"
    return files


ALLOWED = {
    "bottom": {"bottom", "external"},
    "stage": {"bottom", "external", "stage"},
    "frontend": {"bottom", "external", "frontend"},
    "operator": {"bottom", "external", "operator"},
    "router": {"bottom", "external", "router"},
}


@pytest.mark.parametrize(("layer", "path"), sources(), ids=lambda v: str(v.relative_to(REPO)) if isinstance(
    v, Path) else v)
def test_imports_point_down(layer: str, path: Path) -> None:
    targets = {layer_of(m) for m in imports_of(path) if m.startswith("inferencemesh")} | {"external"}
    if layer in TOP:
        return
    wrong = targets - ALLOWED[layer]
    assert not wrong, f"{path.relative_to(REPO)} ({layer}) imports {sorted(wrong)}"


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from inferencemesh.frontend.engine.engine import PipelineEngine\n")
    assert layer_of(next(m for m in imports_of(bad) if m.count(".") == 3)) == "frontend"
