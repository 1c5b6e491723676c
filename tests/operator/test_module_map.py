"""docs/operator-design.md's module map and dflashops/ in step: every module of the operator has
its one line there, and every line names a module that exists."""

from __future__ import annotations

import re
from pathlib import Path

import dflashops

ROOT = Path(dflashops.__file__).parent
MAP = ROOT.parent / "docs" / "operator-design.md"
ROW = re.compile(r"^\| `([\w/]+\.py)` \| (.+) \|$", re.M)


def _mapped() -> dict[str, str]:
    text = MAP.read_text()
    section = text[text.index("## Module map") :]
    section = section[: section.find("\n## ", 1)] if "\n## " in section[1:] else section
    return dict(ROW.findall(section))


def test_every_operator_module_has_one_line_in_the_map():
    modules = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py")}
    mapped = _mapped()
    assert sorted(modules - set(mapped)) == [], "modules missing from docs/operator-design.md"
    assert sorted(set(mapped) - modules) == [], "the map names modules that do not exist"
    assert all(line.strip() for line in mapped.values())
