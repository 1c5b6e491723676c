"""The workload's modules as a reader meets them: imports go one way (no circle, counting every
import: at the top, inside a function, under TYPE_CHECKING), no module uses another module's
`_private` names, each program imports only what it runs (the evaluator holds no training
code), and the workload never imports the operator."""

from __future__ import annotations

import ast
from pathlib import Path

import workload

ROOT = Path(workload.__file__).parent
PACKAGE = "workload"
TRAINING = "workload.train"  # the trainer's package: what only training runs
# the evaluator's programs: `python -m workload.eval`, `workload.serve_bench`, `workload.parity`
EVALUATOR = ("workload.eval.__main__", "workload.serve_bench", "workload.parity")


def _modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = ast.parse(path.read_text(), str(path))
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return any(other.startswith(name + ".") for other in MODULES)


def _owner(name: str) -> str | None:
    """The module `name` (a module or a name in one) lives in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(name: str, tree: ast.Module, package: str = PACKAGE) -> list[tuple[str, str | None]]:
    """(module imported, name taken from it or None) for every import of `package` in `tree`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name.split(".")[0] == package]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if _is_package(name) else name.split(".")[:-1]
                here = here[: len(here) - node.level + 1]
                base = ".".join([*here, base] if base else here)
            if base.split(".")[0] == package:
                out += [(base, a.name) for a in node.names]
    return out


def _edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, tree in MODULES.items():
        for module, taken in _imports(name, tree):
            target = f"{module}.{taken}" if taken and f"{module}.{taken}" in MODULES else module
            owner = _owner(target)
            if owner and owner != name:
                graph[name].add(owner)
    return graph


def _a_circle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_privates(tree: ast.Module) -> set[str]:
    """The `_names` a module defines: functions, classes, variables, attributes it sets."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name | ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.id if isinstance(node, ast.Name) else node.attr)
    return {n for n in names if _private(n)}


def _closure(start: str, graph: dict[str, set[str]]) -> dict[str, str]:
    """Every module `start` imports, directly or not (a package's __init__ with each of its
    modules), each with the module that imports it."""
    seen: dict[str, str] = {start: start}
    todo = [start]
    while todo:
        node = todo.pop()
        parents = [".".join(node.split(".")[:i]) for i in range(1, node.count(".") + 1)]
        for nxt in [*graph[node], *(p for p in parents if p in MODULES)]:
            if nxt not in seen:
                seen[nxt] = node
                todo.append(nxt)
    return seen


def test_the_workloads_import_graph_has_no_circle():
    graph = _edges()
    assert len(graph) > 40 and sum(map(len, graph.values())) > 80  # the walk saw the imports
    circle = _a_circle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle or [])


def test_no_module_uses_another_modules_private_names():
    defined = {name: _defined_privates(tree) for name, tree in MODULES.items()}
    found = []
    for name, tree in MODULES.items():
        for module, taken in _imports(name, tree):
            if taken and _private(taken) and f"{module}.{taken}" not in MODULES:
                found.append(f"{name} imports {module}.{taken}")
        elsewhere = set().union(*(d for other, d in defined.items() if other != name))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in elsewhere and node.attr not in defined[name]:
                found.append(f"{name}:{node.lineno} reads .{node.attr}")
    assert not found, "\n".join(found)


def test_the_evaluator_imports_no_training_code():
    """Every import counts, the lazy ones too: a checkpoint is read through the format
    (workload.drafter.checkpoint), never through the trainer's save and restore."""
    graph = _edges()
    assert TRAINING in MODULES and all(program in MODULES for program in EVALUATOR)
    found = []
    for program in EVALUATOR:
        closure = _closure(program, graph)
        assert "workload.drafter.checkpoint" in closure or program != EVALUATOR[0]
        for module, importer in sorted(closure.items()):
            if module == TRAINING or module.startswith(TRAINING + "."):
                found.append(f"{program}: {importer} imports {module}")
    assert not found, "\n".join(found)


def test_the_workload_never_imports_the_operator():
    found = [
        f"{name} imports {module}"
        for name, tree in MODULES.items()
        for module, _ in _imports(name, tree, package="dflashops")
    ]
    assert not found, "\n".join(found)


def test_the_workloads_packages_import_one_way():
    """The modules' graph folded into its packages (train/, plan/, eval/, ...; a top-level
    module is its own) has no circle either: plan/ prices what train/ runs without importing
    it (both read common/parallel_rules.py)."""
    folded: dict[str, set[str]] = {}
    for module, targets in _edges().items():
        home = ".".join(module.split(".")[:2])
        folded.setdefault(home, set()).update(
            t for t in (".".join(x.split(".")[:2]) for x in targets) if t != home
        )
    for targets in folded.values():
        for t in targets:
            folded.setdefault(t, set())
    circle = _a_circle(folded)
    assert circle is None, "packages in a circle: " + " -> ".join(circle or [])
