"""The import direction: shared foundations at the bottom, the libraries on top of them and blind
to each other, the programs over everything; inside the frontend, the token engine below the
OpenAI surface; and no import cycle anywhere.

    programs (cli, serve, stage, frontend, plan, bench, operator, router)   (top: may import anything below)
    stage | frontend | operator | router         (none imports another, nor the top)
    protocol, modeling, planner, checkpoint, sampling, config, speculation, tls, bundled

    frontend.openai   the OpenAI HTTP surface (may import the engine wing)
    frontend.engine   the token engine: ids in, steps out; imports neither the OpenAI wing nor
                      an HTTP or OpenAI model library

A module's layer is its path under src/inferencemesh (import names are paths). There is no
exception: a stage in the frontend's process is joined to it by a program (programs/mesh.py).
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
PACKAGE = "inferencemesh"
LIBRARIES = {"stage", "frontend", "operator", "router"}
TOP = {"programs", "__main__"}
ENGINE_WING = "inferencemesh.frontend.engine"
OPENAI_WING = "inferencemesh.frontend.openai"
# What the engine wing never imports: the HTTP stack and the OpenAI models live above it.
ENGINE_WING_FORBIDDEN = ("fastapi", "starlette", "pydantic", "openai", OPENAI_WING)

ALLOWED = {
    "bottom": {"bottom", "external"},
    "stage": {"bottom", "external", "stage"},
    "frontend": {"bottom", "external", "frontend"},
    "operator": {"bottom", "external", "operator"},
    "router": {"bottom", "external", "router"},
}


def layer_of(module: str) -> str:
    """'inferencemesh.stage.server' -> 'stage'; bottom modules -> 'bottom'; others 'external'."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return "external"
    if len(parts) == 1:
        return "bottom"
    return parts[1] if parts[1] in LIBRARIES | TOP else "bottom"


def imports_of(path: Path) -> set[str]:
    """Every name a file imports, at any depth (function-level and TYPE_CHECKING imports count
    too): for `from m import x`, both `m` and `m.x` (x may be a module or a name in m)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (the project uses absolute imports only)"
            assert node.module is not None
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def layer_violations(module: str, path: Path) -> set[str]:
    """The layers a module imports that its own may not (none for the programs on top)."""
    layer = layer_of(module)
    if layer in TOP:
        return set()
    return {layer_of(name) for name in imports_of(path) if name.startswith(PACKAGE)} - ALLOWED[layer]


def module_files(root: Path) -> dict[str, Path]:
    """Module name -> file, for every module of the package under root (a package is its __init__)."""
    modules = {}
    for path in (root / PACKAGE).rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(path: Path, modules: Collection[str]) -> set[str]:
    """The package's modules a file imports, at any depth: `from a.b import c` imports the module
    a.b.c when c is one, else the module a.b (a parent package is no import of its own)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            found.update(
                f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                for alias in node.names)
    return found & set(modules)


def import_graph(modules: Mapping[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    return {module: imported_modules(path, modules) for module, path in modules.items()}


def strongly_connected(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iterative (no recursion limit to meet)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            successor = next(successors, None)
            if successor is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
            elif successor not in index:
                index[successor] = low[successor] = len(index)
                stack.append(successor)
                on_stack.add(successor)
                work.append((successor, iter(sorted(graph.get(successor, ())))))
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
    return components


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The components that are cycles: more than one module, or a module that imports itself."""
    return [c for c in strongly_connected(graph) if len(c) > 1 or c[0] in graph[c[0]]]


def reachable(graph: Mapping[str, Iterable[str]], start: str) -> set[str]:
    """start and every module it imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    return seen


def engine_wing_breaches(module: str, graph: Mapping[str, Iterable[str]],
                         modules: Mapping[str, Path]) -> dict[str, list[str]]:
    """What importing an engine-wing module brings in from above the wall, by the module that
    imports it (the engine wing's own modules and the foundations they pull in alike)."""
    breaches = {}
    for reached in sorted(reachable(graph, module)):
        banned = sorted({name for name in imports_of(modules[reached]) for above in ENGINE_WING_FORBIDDEN
                         if name == above or name.startswith(above + ".")})
        if banned:
            breaches[reached] = banned
    return breaches


MODULES = module_files(SRC)
GRAPH = import_graph(MODULES)


def _ids(value: object) -> str:
    return str(value.relative_to(REPO)) if isinstance(value, Path) else str(value)


@pytest.mark.parametrize(("module", "path"), sorted(MODULES.items()), ids=_ids)
def test_imports_point_down(module: str, path: Path) -> None:
    wrong = layer_violations(module, path)
    assert not wrong, f"{path.relative_to(REPO)} ({layer_of(module)}) imports {sorted(wrong)}"


def test_the_layers_are_where_this_test_expects_them() -> None:
    layers = {layer_of(module) for module in MODULES}
    assert layers >= LIBRARIES | {"programs", "bottom"}, "the layout moved: update this test"
    assert ENGINE_WING in MODULES and OPENAI_WING in MODULES, "the frontend's wings moved: update this test"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith(ENGINE_WING)))
def test_the_engine_wing_stays_below_the_openai_wing(module: str) -> None:
    breaches = engine_wing_breaches(module, GRAPH, MODULES)
    assert not breaches, f"importing {module} (the token engine) brings in what belongs above it: {breaches}"


def test_no_import_cycles() -> None:
    found = cycles(GRAPH)
    assert not found, "import cycles (each line one strongly connected component):\n" + "\n".join(
        ", ".join(component) for component in found)


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from inferencemesh.frontend.engine.engine import PipelineEngine\n")
    assert layer_violations("inferencemesh.stage.bad", bad) == {"frontend"}
    assert layer_violations("inferencemesh.config", bad) == {"frontend"}
    assert layer_violations("inferencemesh.frontend.bad", bad) == set()
    assert layer_violations("inferencemesh.programs.bad", bad) == set()


def test_the_wall_checker_sees_a_breach(tmp_path: Path) -> None:
    package = tmp_path / PACKAGE
    (package / "frontend" / "engine").mkdir(parents=True)
    (package / "frontend" / "openai").mkdir()
    for init in ("", "frontend", "frontend/engine", "frontend/openai"):
        (package / init / "__init__.py").write_text("")
    (package / "frontend" / "engine" / "steps.py").write_text(
        "from typing import TYPE_CHECKING\nimport inferencemesh.helpers\n"
        "if TYPE_CHECKING:\n    from inferencemesh.frontend.openai.jobs import Job\n")
    (package / "frontend" / "engine" / "clean.py").write_text("import openai_spec\nimport torch\n")
    (package / "frontend" / "openai" / "jobs.py").write_text("import fastapi\nJob = 1\n")
    (package / "helpers.py").write_text("def f():\n    import pydantic.fields\n    import starlette\n")
    modules = module_files(tmp_path)
    graph = import_graph(modules)
    assert engine_wing_breaches(f"{ENGINE_WING}.steps", graph, modules) == {
        f"{ENGINE_WING}.steps": [f"{OPENAI_WING}.jobs", f"{OPENAI_WING}.jobs.Job"],
        f"{OPENAI_WING}.jobs": ["fastapi"],
        "inferencemesh.helpers": ["pydantic.fields", "starlette"],
    }
    assert engine_wing_breaches(f"{ENGINE_WING}.clean", graph, modules) == {}


def test_the_cycle_checker_sees_a_cycle(tmp_path: Path) -> None:
    package = tmp_path / PACKAGE
    (package / "wing").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "wing" / "__init__.py").write_text("from inferencemesh.wing.a import A\n")
    (package / "wing" / "a.py").write_text("from inferencemesh.wing import b\nA = 1\n")
    (package / "wing" / "b.py").write_text("def f():\n    from inferencemesh.wing.c import C\n")
    (package / "wing" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import inferencemesh.wing.a\nC = 1\n")
    (package / "alone.py").write_text("import inferencemesh.alone\n")
    (package / "leaf.py").write_text("from inferencemesh.wing.c import C\n")
    graph = import_graph(module_files(tmp_path))
    assert graph["inferencemesh.wing.a"] == {"inferencemesh.wing.b"}
    assert cycles(graph) == [["inferencemesh.alone"], ["inferencemesh.wing.a", "inferencemesh.wing.b",
                                                      "inferencemesh.wing.c"]]
    assert cycles({"x": {"y"}, "y": set()}) == []
