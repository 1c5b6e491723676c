"""A helper program's imports from the files beside it (remote/shared.py, layout.py, ...) become
those files' texts in front of it (remote.source): every name it takes must be defined there,
not merely imported there (a linter drops an import its own file does not use)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from dflashops import remote

HERE = Path(remote.__file__).parent
LIBRARY_IMPORT = re.compile(r"^from dflashops\.remote\.(\w+) import (\([^)]*\)|.+)$", re.M)


def _defined(text: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def test_every_name_a_helper_takes_from_a_library_is_defined_there():
    missing = []
    for path in sorted(HERE.glob("*.py")):
        if path.name == "__init__.py":
            continue
        for library, names in LIBRARY_IMPORT.findall(path.read_text()):
            defined = _defined(remote.source(f"{library}.py"))
            taken = [n.strip() for n in names.strip("()").split(",") if n.strip()]
            missing += [f"{path.name}: {library}.{n}" for n in taken if n not in defined]
        compile(remote.source(path.name), path.name, "exec")
    assert not missing
