"""`check RUN [--on TARGET] [--step N]`: train-to-serve parity of a run, one line per mismatch."""

from __future__ import annotations

import typer

from dflashops import context
from dflashops.commands import _options
from dflashops.errors import ExitCode
from dflashops.render import console
from dflashops.runs.training.parity import check_run


def register(app: typer.Typer) -> None:
    @app.command("check")
    @context.command
    def check(
        ctx: typer.Context,
        run: str = typer.Argument(..., metavar="RUN", help="The run to check."),
        on: str = typer.Option(
            None,
            "--on",
            metavar="TARGET",
            help="The eval target that will serve it (default: the run's own target).",
        ),  # fmt: skip
        step: int = typer.Option(
            None, "--step", min=0, help="A checkpoint (default: the newest complete one)."
        ),
        spec_tokens: int = typer.Option(
            None,
            "--num-speculative-tokens",
            min=1,
            metavar="N",
            help="What the engine will be asked for (compared with the drafter's block size).",
        ),  # fmt: skip
        host: str = _options.HOST_OPTION,
        json_out: bool = _options.JSON_OPTION,
    ) -> None:
        """Train-to-serve parity: the chat template and kwargs of the run's data, its training,
        its eval and the serving engine's defaults; the drafter's block size, mask token,
        taps, layer types and dtype against the target and the engine. Exit 2 on any mismatch."""
        opts = context.begin(ctx, json_out)
        session = opts.session()
        dest = opts.inventory().target(on) if on is not None else None
        doc = check_run(session, session, run, on=dest, step=step, host=host,
                        spec_tokens=spec_tokens)  # fmt: skip
        if opts.dry_run:
            opts.dry_run_done(run=run)
            return
        keys = ("run", "target", "on", "step", "mismatches", "facts")
        opts.answer({k: doc[k] for k in keys}, lambda: show(doc))
        if doc["mismatches"]:
            raise typer.Exit(int(ExitCode.USAGE))


def show(doc: dict) -> None:
    for note in doc.get("notes") or []:
        context.note(f"{doc['run']}: not checked: {note}")
    out = console()
    step = f" step {doc['step']}" if doc["step"] is not None else " (no checkpoint yet)"
    for m in doc["mismatches"]:
        out.print(f"{doc['run']}{step}: {m['line']}", markup=False, highlight=False)
    if not doc["mismatches"]:
        out.print(f"{doc['run']}{step}: training ({doc['target']}) and serving ({doc['on']}) "
                  "agree on every setting checked", markup=False, highlight=False)  # fmt: skip
