"""The workload's file names (a run directory, a checkpoint, a dataset: state.json,
model.safetensors, MANIFEST.sha256, ...) are spelled once, in workload/common/layout.py.
config.json is Hugging Face's name for every model directory's config (the target's too), not
only the drafter checkpoint's: it may be written where a model directory is read."""

from __future__ import annotations

from pathlib import Path

import workload
from tests.spelled_once import layout_names, spelled_elsewhere

ROOT = Path(workload.__file__).parent
LAYOUT = ROOT / "common" / "layout.py"


def test_every_layout_file_name_is_spelled_once():
    assert {"state.json", "model.safetensors", "resolved.yaml"} <= set(layout_names(LAYOUT))
    assert spelled_elsewhere(ROOT, LAYOUT, allowed={"config.json"}) == []
