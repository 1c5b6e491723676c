"""What `--dry-run` checks here, with no host: a run config validated by the workload's own
loader (workload/config.py, which imports no torch) in a subprocess of the local python, so the
operator itself never imports the workload (nor torch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from dflashops import bundle, context
from dflashops.errors import NotFoundError, UnreachableError, UsageError
from dflashops.remote import layout
from dflashops.ssh.session import Session

CHECK_S = 60.0  # the deadline of the local check (it reads one YAML file)

# Runs in the subprocess: argv[1] is run.yaml; prints {"error": str|null, "skipped": str|null}.
CHECK_PROGRAM = """
import json, sys
try:
    from workload.config import ConfigError, load_config
except ImportError as exc:
    print(json.dumps({"error": None, "skipped": f"the workload's loader cannot run here ({exc})"}))
    raise SystemExit(0)
try:
    load_config(sys.argv[1])
    print(json.dumps({"error": None, "skipped": None}))
except ConfigError as exc:
    text = str(exc)
    if "drafter.layout_from" in text and "not a drafter's config.json" in text:
        print(json.dumps({"error": None, "skipped": "drafter.layout_from is read on the target"}))
    else:
        print(json.dumps({"error": text, "skipped": None}))
"""


def check_config(run: str, text: str) -> None:
    """run.yaml's text (with its --set header) checked offline: UsageError (exit 2) naming the
    key (and `did you mean`) for a bad one; a note when the check could not run here."""
    with tempfile.TemporaryDirectory(prefix="dflashops-dry-") as tmp:
        path = Path(tmp) / layout.RUN_CONFIG
        path.write_text(text)
        env = {**os.environ, "PYTHONPATH": str(bundle.ROOT)}
        try:
            done = subprocess.run(
                [sys.executable, "-c", CHECK_PROGRAM, str(path)],
                capture_output=True, env=env, timeout=CHECK_S, cwd=tmp, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            context.note(f"{run}: config: not checked here (no answer in {CHECK_S:.0f} s)")
            return
    try:
        found = json.loads(done.stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        last = (done.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
        context.note(f"{run}: config: not checked here ({last})")
        return
    if found.get("error"):
        raise UsageError(f"{run}: config: {found['error']}")
    if found.get("skipped"):
        context.note(f"{run}: config: checked here, except: {found['skipped']}")
        return
    context.note(f"{run}: config: valid (checked here by workload.config)")


def reads_remote(session: Session) -> bool:
    """Whether a read through `session` was left undone (offline, a target not `local`)."""
    targets = session.inventory.targets.values()
    return session.offline and any(t.kind != "local" for t in targets)


@contextmanager
def unread_is_said(session: Session, what: str) -> Iterator[None]:
    """Under --dry-run, a run (or checkpoint) not found because the hosts were not read is
    said, and the rehearsal ends there (exit 0), instead of failing."""
    try:
        yield
    except (NotFoundError, UnreachableError) as exc:
        if not reads_remote(session):
            raise
        context.note(
            f"dry run: {what}: found by reading the hosts, which --dry-run does not do "
            f"({exc.message}); the rest is shown by the command without --dry-run"
        )
        raise typer.Exit(0) from None


def template_target_config(run: str, spec: str | None) -> str | None:
    """For a rehearsal without --target-config: the copy of the target's config.json that
    ships beside the template --config names (said), else None."""
    from dflashops.runs.training.config import shipped_target_config

    copy = shipped_target_config(spec)
    if copy is None:
        return None
    context.note(f"{run}: memory plan: the target's config.json from {copy} (the template's "
                 "copy; --target-config PATH for another)")  # fmt: skip
    return str(copy)


def local_plan(run: str, text: str, argv: list[str], target_config: str) -> dict | None:
    """workload.plan run here on run.yaml's text against the target model's config.json
    (`--target-config`): the plan, or None (said) where it cannot run here (no torch)."""
    with tempfile.TemporaryDirectory(prefix="dflashops-dry-") as tmp:
        path = Path(tmp) / layout.RUN_CONFIG
        path.write_text(text)
        config = str(Path(target_config).expanduser().absolute())  # the plan runs in `tmp`
        argv = [sys.executable, *argv[1:], "--target-config", config]
        argv[argv.index(layout.RUN_CONFIG)] = str(path)
        env = {**os.environ, "PYTHONPATH": str(bundle.ROOT)}
        try:
            done = subprocess.run(argv, capture_output=True, env=env, timeout=CHECK_S * 4,
                                  cwd=tmp, check=False)  # fmt: skip
        except subprocess.TimeoutExpired:
            context.note(f"{run}: memory plan: not computed here (no answer in time)")
            return None
    err = done.stderr.decode(errors="replace").strip().splitlines()
    if done.returncode == 2:
        raise UsageError(f"{run}: {(err or ['bad input'])[-1].removeprefix('error: ')}")
    if done.returncode != 0:
        why = "no torch here" if any("No module named 'torch'" in e for e in err) else (
            err or ["failed"])[-1]  # fmt: skip
        context.note(f"{run}: memory plan: not computed here ({why})")
        return None
    return json.loads(done.stdout)
