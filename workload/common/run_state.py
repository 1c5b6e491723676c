"""A run's (or a datagen job's) `state.json`: pid, status, times, exit code; no torch, so
datagen keeps one before it imports torch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workload.common.jsonfile import write_json_atomic
from workload.common.layout import STATE_NAME


class RunState:
    """`state.json`: merged with what is there (the launcher may add keys), replaced atomically."""

    def __init__(self, run_dir: Path, enabled: bool) -> None:
        self.path = run_dir / STATE_NAME
        self.enabled = enabled

    def read(self) -> dict[str, Any]:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def update(self, **values: Any) -> None:
        if self.enabled:
            write_json_atomic(self.path, {**self.read(), **values})
