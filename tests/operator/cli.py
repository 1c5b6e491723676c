"""Run the real `dflashops` command line in a subprocess, as a user would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


def as_at_a_terminal() -> None:
    """preexec_fn for a process a test presses Ctrl-C in: SIGINT's disposition is the default,
    as in a terminal's foreground job, even where this run inherited it ignored (started as a
    background job, or under nohup), which the started process would otherwise inherit too."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@dataclass
class Ran:
    code: int
    out: str
    err: str


def dflashops(
    *args: str,
    inventory: Path | None = None,
    cwd: Path | None = None,
    home: Path | None = None,
    stdin: bytes | None = None,
    timeout: float = 120,
    env: dict[str, str] | None = None,
) -> Ran:
    full = [sys.executable, "-m", "dflashops.cli"]
    if inventory is not None:
        full += ["--inventory", str(inventory)]
    environ = dict(os.environ)
    environ.pop("DFLASHOPS_INVENTORY", None)
    if home is not None:
        environ["HOME"] = str(home)
    environ.update(env or {})
    proc = subprocess.run(
        [*full, *args],
        input=stdin if stdin is not None else b"",
        capture_output=True,
        cwd=cwd,
        env=environ,
        timeout=timeout,
    )
    return Ran(
        proc.returncode, proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
    )
