"""`ckpts [RUN] [--verify]`: a run's checkpoints, complete (MANIFEST.sha256 present) or not."""

from __future__ import annotations

import typer

from dflashops import context
from dflashops.commands import _options
from dflashops.errors import ExitCode
from dflashops.render import console, duration, human_bytes, styled, table
from dflashops.runs.reading.survey import reread, resolve, survey
from dflashops.runs.reading.view import Checkpoint, RunView
from dflashops.tables import Col


def register(app: typer.Typer) -> None:
    @app.command("ckpts")
    @context.command
    def ckpts(
        ctx: typer.Context,
        run: str = typer.Argument(
            None, metavar="RUN", help="A run (default: the newest running one)."
        ),
        verify: bool = typer.Option(
            False, "--verify", help="Check every file's sha256 against the manifest (reads all)."
        ),
        host: str = _options.HOST_OPTION,
        json_out: bool = _options.JSON_OPTION,
    ) -> None:
        """List a run's checkpoints: step, complete or not, size (and --verify their hashes)."""
        opts = context.begin(ctx, json_out)
        session = opts.session()
        if opts.dry_run:
            survey(session, names=[run] if run else None, archive=True, checkpoints=True)
            opts.dry_run_done(run=run)
            return
        view = resolve(session, run, records="none", host=host)
        if verify:
            context.note(f"{view.name}: hashing every checkpoint file on {view.target}")
        machine = session.machine(view.target)
        view = reread(machine, view.name, records="none", checkpoints=True, verify=verify)
        points = view.checkpoints
        opts.answer({"run": view.name, "target": view.target, "dir": view.dir,
                     "checkpoints": [checkpoint_doc(c) for c in points]},
                    lambda: show(view, points, verify))  # fmt: skip
        if verify and any(c.verified is False for c in points):
            raise typer.Exit(int(ExitCode.FAILED))


def checkpoint_doc(c: Checkpoint) -> dict:
    return {
        "step": c.step,
        "name": c.name,
        "complete": c.complete,
        "bytes": c.bytes,
        "files": c.files,
        "mtime": c.mtime,
        "verified": c.verified,
        "problem": c.problem,
    }


def state_of(c: Checkpoint):  # noqa: ANN201 (rich Text: the problem shown literally)
    if c.temporary:
        return styled("being written", "yellow")
    if not c.complete:
        return styled("incomplete (no manifest)", "red")
    if c.verified is False:
        return styled(f"CORRUPT: {c.problem}", "red")
    return styled("complete, verified" if c.verified else "complete", "green")


def show(view: RunView, points: list[Checkpoint], verify: bool) -> None:
    out = console()
    if not points:
        out.print(f"{view.name} ({view.target}:{view.dir}): no checkpoints yet")
        return
    grid = table(Col("STEP", keep=True), Col("STATE", keep=True, wrap=True),
                 Col("SIZE", priority=3), Col("FILES", priority=1), Col("WRITTEN", priority=2),
                 Col("DIR", priority=4), title=f"{view.name} on {view.target} ({view.state})")  # fmt: skip
    for c in points:
        age = f"{duration(view.now - c.mtime)} ago"
        grid.add_row(str(c.step), state_of(c), human_bytes(c.bytes), str(c.files), age, c.name)
    out.print(grid)
    total = sum(c.bytes for c in points)
    complete = sum(1 for c in points if c.complete)
    out.print(f"{complete} complete of {len(points)}, {human_bytes(total)} in all")
    if not verify:
        out.print("(complete = MANIFEST.sha256 present; --verify checks every hash)")
