"""Small stdlib-only programs that run inside targets with their `python3 -c` (never imported
by the operator itself: their text is sent as an argument)."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from dflashops.errors import OpsError

if TYPE_CHECKING:
    from dflashops.targets.base import Machine, Result


@cache
def source(name: str) -> str:
    """The text of the helper program `name` (e.g. "receive.py")."""
    return (Path(__file__).parent / name).read_text()


def argv(name: str, *args: str) -> list[str]:
    """The argv that runs helper `name` with `args` in a target."""
    return ["python3", "-c", source(name), *args]


def run(machine: Machine, name: str, *args: str, stdin: bytes = b"", what: str) -> Result:
    """Run helper `name` in `machine`; an OpsError saying `what` failed when it does (a missing
    python3 named as such). Under --dry-run the result is empty and successful."""
    result = machine.run(argv(name, *args), stdin=stdin)
    check(machine, result, what)
    return result


def check(machine: Machine, result: Result, what: str, error: type[OpsError] = OpsError) -> None:
    if result.ok or machine.dry_run:
        return
    if result.returncode == 127:
        raise OpsError(f"{machine.name}: python3 not found; install it in the target")
    raise error(f"{machine.name}: {what} failed: {result.error_text}")
