"""`resume RUN`: start a stopped or failed run again from its newest complete checkpoint, on all
its nodes with the same number of processes each, or `--nproc N` each (another world size: the
trainer reshards and keeps the global batch), through the same launcher as `launch` (the
trainer's --resume). `--host T[,T...]` naming targets the run is not on moves it there
(runs/lifecycle/move.py: the checkpoint copied and verified, the old copy set aside). The run
keeps the code it ran unless `--update-code` takes the workload as it is now; secrets are
asked for again (--secret)."""

from __future__ import annotations

import typer

from dflashops import context
from dflashops.commands import _options
from dflashops.remote import layout
from dflashops.runs.lifecycle.move import locate, move, moves
from dflashops.runs.lifecycle.rehearse import unread_is_said
from dflashops.runs.lifecycle.resume import resume as start_again
from dflashops.runs.watching.status_follow import then_follow


def register(app: typer.Typer) -> None:
    @app.command("resume")
    @context.command
    def resume(
        ctx: typer.Context,
        run: str = typer.Argument(..., metavar="RUN", help="A stopped or failed run."),
        host: str = typer.Option(
            None,
            "--host",
            metavar="TARGET[,TARGET...]",
            help="Where it runs next: a target holding the run (where the name exists on "
            "several), or others: the run moves there from its newest complete checkpoint.",
        ),
        update_code: bool = typer.Option(
            False,
            "--update-code",
            help="Run the workload as it is now, not the snapshot the run started with.",
        ),
        nproc: int = typer.Option(
            None,
            "--nproc",
            min=1,
            metavar="N",
            help="Processes per target from now on (default: as before); the trainer keeps "
            "the global batch by scaling optim.grad_accum where a whole number does.",
        ),
        secrets: list[str] = _options.SECRETS_OPTION,
        force: bool = typer.Option(
            False,
            "--force",
            help="Resume even where another run of ours runs, or a launch is queued, on its "
            "targets.",
        ),
        follow: bool = _options.FOLLOW_OPTION,
        wait: float = _options.WAIT_OPTION,
        json_out: bool = _options.JSON_OPTION,
    ) -> None:
        """Start a run again from its newest complete checkpoint."""
        opts = context.begin(ctx, json_out)
        values = _options.secret_values(secrets or [])
        what = f"run {run}" if run else "the newest running run"
        with opts.sessions() as (reader, writer), unread_is_said(reader, what):
            hosts = _options.parse_hosts(host) if host else []
            targets = [reader.inventory.target(name) for name in hosts]
            view = locate(reader, run, hosts, checkpoints=True, records="none",
                          files=[layout.LAUNCH_FILE])  # fmt: skip
            if targets and moves(view, targets):
                started = move(reader, writer, view, targets, values, nproc=nproc,
                                update_code=update_code, wait=wait, force=force)  # fmt: skip
            else:
                started = start_again(reader, writer, view, values, update_code=update_code,
                                      wait=wait, nproc=nproc, force=force)  # fmt: skip
            if started is None:
                opts.dry_run_done(run=run, target=view.target, dir=view.dir, to=hosts or None,
                                  from_step=max(view.complete_steps()))  # fmt: skip
                return
            code = then_follow(reader, started, follow, opts.emit if opts.json else None)
            if code is not None:
                raise typer.Exit(code)
