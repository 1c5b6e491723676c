"""The layout's file names (CONTRACTS §2-4: state.json, run.yaml, node.json, ...) are spelled
once in the operator, in dflashops/remote/layout.py; every module and helper program takes them
from there."""

from __future__ import annotations

from pathlib import Path

import dflashops
from tests.spelled_once import layout_names, spelled_elsewhere

ROOT = Path(dflashops.__file__).parent
LAYOUT = ROOT / "remote" / "layout.py"


def test_every_layout_file_name_is_spelled_once():
    assert {"state.json", "node.json", "run.yaml", "MANIFEST.sha256"} <= set(layout_names(LAYOUT))
    assert spelled_elsewhere(ROOT, LAYOUT) == []
