"""A continuous eval started from the command line: `eval RUN --every N --on TARGET`, and
`launch ... --eval-on TARGET --eval-every N` (runs/evaluation/continuous.py does the work)."""

from __future__ import annotations

from typing import Any

from dflashops import context
from dflashops.errors import OpsError
from dflashops.inventory import Target
from dflashops.render import console
from dflashops.runs.evaluation.continuous import start_follow
from dflashops.runs.evaluation.job import Extra
from dflashops.runs.lifecycle.rehearse import unread_is_said


def continuous(
    opts: context.Context, as_json: bool, run: str, every: int, dest: Target, extra: Extra
) -> None:
    """Start it and say where it runs (it is detached: the command returns)."""
    with opts.sessions() as (reader, writer), unread_is_said(reader, f"run {run}"):
        job = start_follow(reader, writer, run, every, dest, extra)
    if opts.dry_run:
        opts.dry_run_done(run=run, every=every, on=dest.name, job=job["dir"])
        return
    said(opts, as_json, job)


def said(opts: context.Context, as_json: bool, job: dict[str, Any]) -> None:
    if as_json:
        opts.emit(job)
        return
    console().print(
        f"continuous eval {job['name']} of {job['run']} running on {job['target']} (every "
        f"{job['every']} steps; tmux {job['tmux']}); watch it: dflashops logs {job['name']} "
        f"--follow; results: dflashops evals {job['run']}"
    )


def with_launch(reader: Any, writer: Any, run: str, dest: Target, every: int, extra: Extra) -> None:
    """After `launch` started the run: its continuous eval (a failure leaves the run going)."""
    try:
        job = start_follow(reader, writer, run, every, dest, extra)
    except OpsError as exc:
        exc.args = (f"{exc.message} (the run goes on; start its continuous eval with "
                    f"`dflashops eval {run} --every {every} --on {dest.name}`)",)  # fmt: skip
        raise
    context.note(f"continuous eval {job['name']} on {dest.name}: dflashops logs {job['name']} "
                 f"--follow; results: dflashops evals {run}")  # fmt: skip
