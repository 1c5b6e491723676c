"""`resume RUN`: start a stopped or failed run again from its newest complete checkpoint, with
the same tmux session and launch script as `launch` (the trainer's --resume)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import typer

from dflashops import context, runs, transfer
from dflashops.commands import launch as launching
from dflashops.commands.setup import sync_workload
from dflashops.errors import NotFoundError, UsageError


def register(app: typer.Typer) -> None:
    @app.command("resume")
    @context.command
    def resume(
        ctx: typer.Context,
        run: str = typer.Argument(..., metavar="RUN", help="A stopped or failed run."),
        secrets: list[str] = launching.SECRETS_OPTION,
        follow: bool = launching.FOLLOW_OPTION,
        wait: float = launching.WAIT_OPTION,
        json_out: bool = launching.JSON_OPTION,
    ) -> None:
        """Start a run again from its newest complete checkpoint."""
        opts = context.get(ctx)
        opts.want_json(json_out)
        env_file = launching.secret_file(secrets or [])
        with runs.sessions(opts) as (reader, writer):
            view = runs.find(reader, run, checkpoints=True, records="none")
            if view.where == "archive":
                raise UsageError(f"{run} is archived ({view.target}:{view.dir}); it cannot resume")
            if view.running:
                raise UsageError(f"{run} is {view.state} on {view.target}; nothing to resume")
            steps = view.complete_steps()
            if not steps:
                raise NotFoundError(f"{run} has no complete checkpoint to resume from")
            machine = writer.machine(view.target)
            context.note(f"{view.target}: syncing the workload")
            sync_workload(machine)
            with tempfile.TemporaryDirectory(prefix="dflashops-resume-") as tmp:
                script = Path(tmp) / launching.LAUNCH_SCRIPT
                script.write_text(launching.launch_script(machine.target, run, view.dir))
                script.chmod(0o755)
                transfer.put(machine, Path(tmp), view.dir)
            if env_file is not None:
                launching.write_secrets(machine, view.dir, env_file)
            reset = {"status": "launching", "exit_code": None, "finished": None}
            runs.control(machine, "relaunch", view.dir, **reset, resumed=time.time())
            launching.start(machine, run, view.dir, resume=True)
            if opts.dry_run:
                context.note("dry run: nothing was changed")
                runs.dry_run_done(opts, run=run, target=view.target, dir=view.dir,
                                  from_step=max(steps))  # fmt: skip
                return
            context.note(f"{run}: resuming from step_{max(steps)}")
            view = launching.wait_for_life(reader.machine(view.target), run, timeout=wait)
            launching.then_follow(opts, reader, view, follow)
