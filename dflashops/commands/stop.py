"""`stop RUN`: ask the trainer to save a checkpoint and stop (SIGTERM to rank 0, which tells
every rank at the end of the step), wait until every node has exited, report the checkpoint.
`stop RUN --kill`: SIGKILL to every node's torchrun and ranks, for a trainer that does not stop.
Processes are recognised by pid and start time, never by a name (runs/stop.py)."""

from __future__ import annotations

import typer

from dflashops import context
from dflashops.commands import _options
from dflashops.runs.stop import running
from dflashops.runs.stop import stop as stop_run
from dflashops.runs.survey import find


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
        opts = context.get(ctx)
        as_json = opts.want_json(json_out)
        with opts.sessions() as (reader, writer):
            view = find(reader, run, host=host, checkpoints=True, records="none")
            if not running(view):
                if as_json:
                    opts.emit({**view.summary(), "stopped": False})
                else:
                    context.say(f"{run}: not running ({view.state}); nothing to stop")
                return
            stopped = stop_run(reader, writer, view, kill=kill, timeout=timeout)
            if stopped is None:
                opts.dry_run_done(**view.summary(), stopped=False)
                return
        newest = max(stopped.complete_steps(), default=None)
        if as_json:
            opts.emit({**stopped.summary(), "stopped": True, "checkpoint": newest})
            return
        saved = f"step_{newest}" if newest is not None else "no complete checkpoint"
        context.say(
            f"{run}: {stopped.state} at step {stopped.step}; newest checkpoint {saved}; "
            f"continue with: dflashops resume {run}"
        )
