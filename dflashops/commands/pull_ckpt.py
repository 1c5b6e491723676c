"""`pull-ckpt STEP --to TARGET [--run RUN]`: copy a complete checkpoint to another target.

The copy (a tar stream through this process into a partial directory there, every file verified
against the checkpoint's MANIFEST.sha256 before it is put in place; resumed when cut short) is
runs/evaluation/pulls.py's, which `eval` shares.
"""

from __future__ import annotations

from typing import Any

import typer

from dflashops import context
from dflashops.commands import _options
from dflashops.render import human_bytes
from dflashops.runs.evaluation.pulls import MANIFEST, pull
from dflashops.runs.lifecycle.rehearse import unread_is_said
from dflashops.runs.reading.survey import resolve


def register(app: typer.Typer) -> None:
    @app.command("pull-ckpt")
    @context.command
    def pull_ckpt(
        ctx: typer.Context,
        step: int = typer.Argument(
            ..., metavar="STEP", help="The checkpoint's step (checkpoints/step_STEP)."
        ),
        to: str = typer.Option(..., "--to", metavar="TARGET", help="The target to copy it to."),
        run: str = typer.Option(
            None, "--run", metavar="RUN", help="The run (default: the newest running one)."
        ),
        host: str = _options.HOST_OPTION,
        json_out: bool = _options.JSON_OPTION,
    ) -> None:
        """Copy a run's checkpoint to <ws>/ckpts/RUN/step_STEP on TARGET, verified."""
        opts = context.begin(ctx, json_out)
        dest = opts.inventory().target(to)
        what = f"run {run}" if run else "the newest running run"
        with opts.sessions() as (reader, writer), unread_is_said(reader, what):
            view = resolve(reader, run, records="none", host=host)
            done = pull(reader, writer, view, step, dest)
        if opts.dry_run:
            opts.dry_run_done(**done)
            return
        if opts.json:
            opts.emit(done)
        elif not done["copied"]:
            context.say(
                f"{view.name} step_{step}: already on {dest.name} at {done['dest']} "
                "and it verifies against its MANIFEST.sha256; nothing copied"
            )
        else:
            context.say(copied_line(view.name, step, view.target, done))


def copied_line(run: str, step: int, source: str, done: dict[str, Any]) -> str:
    rate = done["sent_bytes"] / done["seconds"] if done["seconds"] else 0
    line = (
        f"{run} step_{step}: {source} -> {done['to']}:{done['dest']}, {done['files']} files, "
        f"{human_bytes(done['bytes'])}; sent {human_bytes(done['sent_bytes'])} in "
        f"{done['seconds']:.1f}s ({human_bytes(rate)}/s), verified against {MANIFEST}"
    )
    if done["kept_files"]:
        line += f"; {done['kept_files']} files verified by an earlier try were not sent again"
    return line
