"""Small stdlib-only programs that run inside targets with their `python3 -c` (never imported
by the operator itself: their text is sent as an argument)."""

from __future__ import annotations

from functools import cache
from pathlib import Path


@cache
def source(name: str) -> str:
    """The text of the helper program `name` (e.g. "receive.py")."""
    return (Path(__file__).parent / name).read_text()


def argv(name: str, *args: str) -> list[str]:
    """The argv that runs helper `name` with `args` in a target."""
    return ["python3", "-c", source(name), *args]
