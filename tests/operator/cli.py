"""Run the real `dflashops` command line in a subprocess, as a user would: to its end
(`dflashops`), or in the background (`start`, then `finished`)."""

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


def start(
    *args: str, inventory: Path, home: Path, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`dflashops ARGS...` started in the background, as a user's second terminal would."""
    env = {**os.environ, "HOME": str(home), **(env or {})}
    env.pop("DFLASHOPS_INVENTORY", None)
    argv = [sys.executable, "-m", "dflashops.cli", "--inventory", str(inventory), *args]
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        preexec_fn=as_at_a_terminal,  # some are sent Ctrl-C
    )


def finished(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")
