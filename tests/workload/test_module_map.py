"""The map of the workload (docs/workload-design.md, "## Files") stays true: every module is
listed, with one line, under its package's heading, and every file listed exists."""

from __future__ import annotations

import re
from pathlib import Path

import workload

ROOT = Path(workload.__file__).parent
MAP = ROOT.parent / "docs" / "workload-design.md"
ROW = re.compile(r"^\| `([^`]+\.py)` \| (.+) \|$")


def _section() -> list[str]:
    lines = MAP.read_text().splitlines()
    start = lines.index("## Files")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def _listed() -> dict[str, list[str]]:
    """Each file of the map's tables with the line(s) that hold it."""
    rows: dict[str, list[str]] = {}
    for line in _section():
        if m := ROW.match(line):
            rows.setdefault(m.group(1), []).append(m.group(2))
    return rows


def _modules() -> set[str]:
    return {
        p.relative_to(ROOT).as_posix()
        for p in ROOT.rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    }


def test_every_workload_module_is_on_the_map():
    missing = sorted(_modules() - set(_listed()))
    assert not missing, f"{MAP.name} lists no line for: " + ", ".join(missing)


def test_every_file_on_the_map_exists_and_has_one_line():
    listed = _listed()
    gone = sorted(name for name in listed if not (ROOT / name).is_file())
    assert not gone, f"{MAP.name} lists files that are not in workload/: " + ", ".join(gone)
    twice = sorted(name for name, rows in listed.items() if len(rows) > 1)
    assert not twice, f"{MAP.name} lists these more than once: " + ", ".join(twice)
    assert all(text.strip() for rows in listed.values() for text in rows)


def test_every_package_has_its_heading():
    headings = "\n".join(line for line in _section() if line.startswith("### "))
    packages = sorted(p.parent.relative_to(ROOT).as_posix() for p in ROOT.glob("*/__init__.py"))
    missing = [p for p in packages if f"`{p}/`" not in headings]
    assert not missing, f"{MAP.name} has no heading for the package(s): " + ", ".join(missing)
