"""`check RUN [--on TARGET] [--step N] [--serve-chat-template FILE] [--serve-chat-template-kwargs
JSON] [--num-speculative-tokens N]`: train-to-serve parity of a run against how it is served
(the engine's defaults where not said), one line per mismatch."""

from __future__ import annotations

import typer

from dflashops import context
from dflashops.commands import _options
from dflashops.errors import ExitCode
from dflashops.render import console
from dflashops.runs.evaluation.serving import ServingChat
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
            help="What the engine will be asked for (compared with the drafter's block size; "
            "default: block - 1, as eval --serve asks).",
        ),  # fmt: skip
        serve_template: str = _options.SERVE_CHAT_TEMPLATE_OPTION,
        serve_kwargs: str = _options.SERVE_CHAT_TEMPLATE_KWARGS_OPTION,
        host: str = _options.HOST_OPTION,
        json_out: bool = _options.JSON_OPTION,
    ) -> None:
        """Train-to-serve parity: the chat template and kwargs of the run's data, its training,
        its eval results and serving (as said, else the engine's defaults); the drafter's
        block size, mask token, taps, layers, layer types and dtype against the target and
        the engine. Exit 2 on any mismatch."""
        opts = context.begin(ctx, json_out)
        chat = ServingChat(serve_template, _options.json_object(serve_kwargs,
                                                                "--serve-chat-template-kwargs"))  # fmt: skip
        session = opts.session()
        dest = opts.inventory().target(on) if on is not None else None
        doc = check_run(session, session, run, on=dest, step=step, host=host,
                        spec_tokens=spec_tokens, chat=chat)  # fmt: skip
        if opts.dry_run:
            opts.dry_run_done(run=run)
            return
        keys = ("run", "target", "on", "step", "mismatches", "assumed", "notes", "facts")
        opts.answer({k: doc[k] for k in keys}, lambda: show(doc))
        if doc["mismatches"]:
            raise typer.Exit(int(ExitCode.USAGE))


def show(doc: dict) -> None:
    for note in doc.get("notes") or []:
        context.note(f"{doc['run']}: not checked: {note}")
    for said in doc.get("assumed") or []:
        context.note(f"{doc['run']}: assumed: {said}")
    out = console()
    step = f" step {doc['step']}" if doc["step"] is not None else " (no checkpoint yet)"
    for m in doc["mismatches"]:
        out.print(f"{doc['run']}{step}: {m['line']}", markup=False, highlight=False)
    if not doc["mismatches"]:
        out.print(f"{doc['run']}{step}: training ({doc['target']}) and serving ({doc['on']}) "
                  "agree on every setting checked", markup=False, highlight=False)  # fmt: skip
