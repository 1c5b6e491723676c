"""Shell completion of run and target names (typer's completion, switched on in cli.py).

Target names come from the inventory alone. Run names need one read of every target (the
directory names only), bounded by DEADLINE_S: a target that does not answer in time adds
nothing. Completion never prints an error and never waits longer: a shell waits on it.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
from typing import TYPE_CHECKING, Any

import typer
from typer.models import ParameterInfo

if TYPE_CHECKING:
    from dflashops.inventory import Inventory

DEADLINE_S = 3.0  # the longest a completion may take
CALL_S = 2.0  # the deadline of each remote read inside it
NEW_RUN_COMMANDS = ("launch",)  # their RUN names a run that does not exist yet


def _quiet() -> None:
    """Nothing of a completion's process may reach the terminal but the candidates: stderr
    (ours, paramiko's log, a helper's) goes to /dev/null for the rest of this process."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    sys.stderr = open(devnull, "w")  # noqa: SIM115 (kept open until the process ends)


def _inventory(ctx: typer.Context) -> Inventory:
    from dflashops.inventory import find_inventory, load_inventory  # only when completing

    return load_inventory(find_inventory(ctx.find_root().params.get("inventory")))


def _matching(names: list[str], incomplete: str) -> list[str]:
    """Names completing `incomplete`; in a comma list (TARGET,TARGET...) its last part."""
    head, comma, last = incomplete.rpartition(",")
    taken = set(head.split(",")) if comma else set()
    return [head + comma + n for n in names if n.startswith(last) and n not in taken]


def target_names(ctx: typer.Context, incomplete: str) -> list[str]:
    """Target names of the inventory."""
    _quiet()
    try:
        return _matching(sorted(_inventory(ctx).targets), incomplete)
    except Exception:  # noqa: BLE001 (a bad inventory completes nothing)
        return []


def run_names(ctx: typer.Context, incomplete: str) -> list[str]:
    """Run names (runs/ and archive/) on the targets that answer within DEADLINE_S, but for
    those already on the line (`compare a b`, `status a --vs b`)."""
    _quiet()
    found: list[str] = []
    reader = threading.Thread(target=_read_names, args=(ctx, found), daemon=True)
    reader.start()
    reader.join(DEADLINE_S)
    if reader.is_alive():
        return []  # the daemon thread ends with the process
    given = _runs_given(ctx)
    return _matching([n for n in found if n not in given], incomplete)


def _runs_given(ctx: typer.Context) -> set[str]:
    """The values of the command's RUN parameters parsed so far."""
    given: set[str] = set()
    for param in ctx.command.params:
        value = ctx.params.get(param.name or "")
        if _names_runs(param.metavar) and value:
            given.update([value] if isinstance(value, str) else value)
    return given


def _read_names(ctx: typer.Context, out: list[str]) -> None:
    from dflashops.runs.reading.survey import survey  # only when completing run names
    from dflashops.ssh.session import Session

    try:
        with Session(_inventory(ctx), announce=lambda _: None, timeout=CALL_S) as session:
            out += survey(session, names=[], archive=True, records="none").all_names()
    except Exception:  # noqa: BLE001 (nothing to complete from)
        pass


def attach(app: typer.Typer) -> None:
    """Give each command's RUN parameters run completion, its TARGET ones target completion
    (found by metavar: RUN, [RUN], RUN RUN..., TARGET, TARGET[,TARGET...]; or named `target`)."""
    for info in app.registered_commands:
        command = info.name or ""
        for name, param in inspect.signature(info.callback).parameters.items():
            declared = param.default
            if not isinstance(declared, ParameterInfo):
                continue
            completer = _completer_for(command, name, declared)
            if completer is not None and declared.autocompletion is None:
                declared.autocompletion = completer


def _names_runs(metavar: str | None) -> bool:
    """A RUN parameter's metavar: RUN, RUN RUN..., or [RUN] (an optional one)."""
    return (metavar or "").lstrip("[").startswith("RUN")


def _completer_for(command: str, name: str, declared: ParameterInfo) -> Any:
    if _names_runs(declared.metavar) and command not in NEW_RUN_COMMANDS:
        return run_names
    if (declared.metavar or "").startswith("TARGET") or name == "target":
        return target_names
    return None
