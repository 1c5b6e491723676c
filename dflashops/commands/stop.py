"""`stop RUN`: ask the trainer to save a checkpoint and stop (SIGTERM to rank 0, which tells
every rank at the end of the step), wait until every node has exited, report the checkpoint.
`stop RUN --kill`: SIGKILL to every node's torchrun and ranks, for a trainer that does not stop.
A queued launch (`launch --queue`) is cancelled: its waiter, secrets and directory removed.
Processes are recognised by pid and start time, never by a name (runs/lifecycle/stop.py)."""

from __future__ import annotations

import typer

from dflashops import context
from dflashops.commands import _options
from dflashops.runs.lifecycle import queue
from dflashops.runs.lifecycle import stop as stopping
from dflashops.runs.lifecycle.rehearse import unread_is_said
from dflashops.runs.reading.survey import find


def register(app: typer.Typer) -> None:
    @app.command("stop")
    @context.command
    def stop(
        ctx: typer.Context,
        run: str = typer.Argument(..., metavar="RUN", help="A running run."),
        timeout: float = typer.Option(
            900, "--timeout", metavar="SECONDS", help="How long to wait for the checkpoint."
        ),
        kill: bool = typer.Option(
            False, "--kill", help="Kill it now (SIGKILL, every node): no checkpoint is saved."
        ),
        host: str = _options.HOST_OPTION,
        json_out: bool = _options.JSON_OPTION,
    ) -> None:
        """Ask a run's trainer to save a checkpoint and stop; wait until it has."""
        opts = context.begin(ctx, json_out)
        what = f"run {run}" if run else "the newest running run"
        with opts.sessions() as (reader, writer), unread_is_said(reader, what):
            view = find(reader, run, host=host, checkpoints=True, records="none")
            if view.queued and not writer.dry_run:
                answer = queue.dequeue(writer, view)
                if answer.get("removed"):
                    opts.answer({**view.summary(), "stopped": True, "cancelled": True},
                                queue.cancelled_line(view))  # fmt: skip
                    return
                view = find(reader, run, host=host, checkpoints=True, records="none")
            if not stopping.running(view):
                said = f"{run}: not running ({view.state}); nothing to stop"
                opts.answer({**view.summary(), "stopped": False}, said)
                return
            done = stopping.stop(reader, writer, view, kill=kill, timeout=timeout)
            if done is None:
                opts.dry_run_done(**view.summary(), stopped=False)
                return
        where, doc = stopping.stopped(done)
        said = f"{run}: {done.state}{where}; continue with: dflashops resume {run}"
        opts.answer({**done.summary(), "stopped": True, **doc}, said)
