"""`archive RUN [--keep-last N] [--keep-every K]`: move runs/RUN to archive/RUN on its target,
pruning checkpoints: keep the newest N complete ones and every multiple of K (the newest
complete one always stays); incomplete ones are removed. No option: keep every complete one.
`--dry-run` shows the plan and the command, and changes nothing."""

from __future__ import annotations

import typer

from dflashops import context
from dflashops.commands import _options
from dflashops.errors import UsageError
from dflashops.render import console, human_bytes, styled, table
from dflashops.runs.lifecycle.archive import Plan, archive_dir, make_plan
from dflashops.runs.lifecycle.archive import archive as archive_run
from dflashops.runs.lifecycle.rehearse import unread_is_said
from dflashops.runs.lifecycle.stop import running
from dflashops.runs.reading.survey import find
from dflashops.runs.reading.view import RunView


def register(app: typer.Typer) -> None:
    @app.command("archive")
    @context.command
    def archive(
        ctx: typer.Context,
        run: str = typer.Argument(..., metavar="RUN", help="A run that is not running."),
        keep_last: int = typer.Option(
            None, "--keep-last", metavar="N", help="Keep the newest N complete checkpoints."
        ),
        keep_every: int = typer.Option(
            None,
            "--keep-every",
            metavar="K",
            help="Keep checkpoints whose step is a multiple of K.",
        ),
        host: str = _options.HOST_OPTION,
        json_out: bool = _options.JSON_OPTION,
    ) -> None:
        """Move a finished run to the target's archive/ (every node's), pruning checkpoints."""
        opts = context.begin(ctx, json_out)
        if keep_last is not None and keep_last < 0:
            raise UsageError("--keep-last: expected 0 or more")
        if keep_every is not None and keep_every < 1:
            raise UsageError("--keep-every: expected 1 or more")
        what = f"run {run}" if run else "the newest running run"
        with opts.sessions() as (reader, writer), unread_is_said(reader, what):
            view = find(reader, run, host=host, records="none", checkpoints=True)
            if view.where == "archive":
                raise UsageError(f"{run} is already archived ({view.target}:{view.dir})")
            if view.queued:
                raise UsageError(f"{run} is a launch queued on {view.target} that never started; "
                                 f"`dflashops stop {run}` cancels it")  # fmt: skip
            if running(view):
                raise UsageError(
                    f"{run} is {view.state} on {view.target}; stop it first (dflashops stop {run})"
                )
            plan = make_plan(view.checkpoints, keep_last, keep_every)
            dest = archive_dir(writer, view)
            if not opts.json:
                show_plan(view, plan, dest)
            done = archive_run(writer, view, plan)
        doc = {"run": run, "target": view.target, "from": view.dir, "to": dest,
               "kept": [c.name for c in plan.keep]}  # fmt: skip
        if opts.dry_run:
            context.note("dry run: nothing was changed")
            removed = [c.name for c in plan.remove]
            opts.dry_run_done(**doc, removed=removed, freed_bytes=plan.freed)
            return
        said = (
            f"{run}: archived on {view.target} to {dest}; removed {len(done.get('removed', []))} "
            f"checkpoint(s), freed {human_bytes(done.get('freed', 0))}"
        )
        opts.answer({**doc, "to": done.get("dir", dest), "removed": done.get("removed", []),
                     "freed_bytes": done.get("freed", 0)}, said)  # fmt: skip


def show_plan(view: RunView, plan: Plan, dest: str) -> None:
    out = console()
    out.print(f"{view.name}: {view.target}:{view.dir} -> {dest}")
    if plan.keep or plan.remove:
        grid = table("CHECKPOINT", "SIZE", "ACTION")
        for c in sorted(plan.keep + plan.remove, key=lambda c: (c.step, c.name)):
            if c in plan.keep:
                action = styled("keep", "green")
            else:
                action = styled("remove", "red") + ("" if c.complete else " (incomplete)")
            grid.add_row(c.name, human_bytes(c.bytes), action)
        out.print(grid)
    out.print(
        f"keeps {len(plan.keep)} checkpoint(s), removes {len(plan.remove)}, "
        f"frees {human_bytes(plan.freed)}"
    )
