"""Where a half's layout names (the file names of its layout module: "state.json", ...) are
written out as string literals outside that module: each should be spelled there once."""

from __future__ import annotations

import ast
from pathlib import Path


def layout_names(layout: Path) -> dict[str, str]:
    """{value: NAME} of the layout module's file names (string constants holding a dot)."""
    names = {}
    for node in ast.parse(layout.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            value = node.value.value
            if isinstance(value, str) and "." in value:
                names[value] = node.targets[0].id
    return names


def spelled_elsewhere(root: Path, layout: Path, allowed: set[str] = frozenset()) -> list[str]:
    """`path:line: "value" (layout.NAME)` for every such literal outside `layout`."""
    names = {v: n for v, n in layout_names(layout).items() if v not in allowed}
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == layout:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                where = path.relative_to(root.parent)
                found.append(f'{where}:{node.lineno}: "{node.value}" ({names[node.value]})')
    return found
