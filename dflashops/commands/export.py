"""`export RUN --step N --to DIR|TARGET:PATH`: a checkpoint as a directory vLLM and SGLang load
as it is (runs/export/): the drafter's files, the chat template it was trained with and a model
card with the serving lines, copied verified and placed whole, here (DIR) or in a target."""

from __future__ import annotations

import os
import sys
from typing import Any

import typer

from dflashops import context
from dflashops.commands import _options
from dflashops.errors import UsageError
from dflashops.inventory import Inventory, Target
from dflashops.remote.layout import MODEL_CARD
from dflashops.runs.export.drafter import export
from dflashops.runs.lifecycle.rehearse import unread_is_said
from dflashops.runs.reading.survey import resolve
from dflashops.runs.reading.view import check_name

HERE = "this machine"  # the destination of --to DIR (no inventory name has a space)


def register(app: typer.Typer) -> None:
    @app.command("export")
    @context.command
    def export_cmd(
        ctx: typer.Context,
        run: str = typer.Argument(..., metavar="RUN", help="The run."),
        step: int = typer.Option(..., "--step", metavar="N", help="Its checkpoint step_N."),
        to: str = typer.Option(
            ...,
            "--to",
            metavar="DIR|TARGET:PATH",
            help="A new directory on this machine, or PATH in a target of the inventory.",
        ),
        host: str = _options.HOST_OPTION,
        json_out: bool = _options.JSON_OPTION,
    ) -> None:
        """Export a checkpoint for serving: vLLM and SGLang load the directory as it is."""
        opts = context.begin(ctx, json_out)
        check_name(run)
        dest, final = destination(opts.inventory(), to)
        with opts.sessions() as (reader, writer), unread_is_said(reader, f"run {run}"):
            view = resolve(reader, run, records="none", host=host)
            done = export(reader, writer, view, step, dest, final)
        if opts.dry_run:
            return opts.dry_run_done(**done)
        opts.answer(done, lambda: context.say(closing(done)))


def destination(inventory: Inventory, to: str) -> tuple[Target, str]:
    """(the target, the absolute path there): TARGET:PATH when TARGET is in the inventory (a
    relative PATH is under its workspace), else a directory on this machine."""
    name, sep, path = to.partition(":")
    if sep and name in inventory.targets:
        target = inventory.targets[name]
        if not path:
            raise UsageError(f"--to {to}: no PATH after {name}:")
        return target, os.path.normpath(os.path.join(target.workspace, path))
    if sep and "/" not in name:
        known = ", ".join(sorted(inventory.targets)) or "none"
        raise UsageError(f"--to {to}: no target {name!r} in {inventory.path} (targets: {known}); "
                         "a directory here is given without a colon")  # fmt: skip
    final = os.path.abspath(os.path.expanduser(to))
    here = Target(HERE, "local", os.path.dirname(final), sys.executable)
    return here, final


def closing(done: dict[str, Any]) -> str:
    where = done["dest"] if done["to"] == HERE else f"{done['to']}:{done['dest']}"
    if not done["copied"]:
        return f"{done['run']} step_{done['step']}: already exported at {where} and it verifies"
    return (
        f"{done['run']} step_{done['step']}: exported to {where} ({len(done['files'])} files, "
        f"{done['verified']}, {done['seconds']:.1f}s); the lines that serve it: "
        f"{os.path.join(done['dest'], MODEL_CARD)}"
    )
