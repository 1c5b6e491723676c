"""`fetch-prompts TARGET SET... [--to DIR] [--secret NAME]`: the public benchmark sets the
evaluator reads (gsm8k, math500, humaneval, mbpp, mt-bench), downloaded inside the target from
the hub by their names, resumable and verified (runs/evaluation/prompt_sets.py); each line
ends with the file to give `eval --prompts`."""

from __future__ import annotations

import posixpath

import typer

from dflashops import context
from dflashops.commands import _options
from dflashops.remote.layout import PROMPTS
from dflashops.render import human_bytes
from dflashops.runs.evaluation.prompt_sets import SETS, check_sets, fetch_set


def register(app: typer.Typer) -> None:
    @app.command("fetch-prompts")
    @context.command
    def fetch_prompts(
        ctx: typer.Context,
        target: str = typer.Argument(..., metavar="TARGET", help="A target of the inventory."),
        sets: list[str] = typer.Argument(..., metavar="SET...", help=", ".join(SETS) + "."),
        to: str = typer.Option(
            None, "--to", metavar="DIR", help="Where in the target (default <workspace>/prompts)."
        ),
        secrets: list[str] = typer.Option(
            None,
            "--secret",
            metavar="NAME",
            help="A hub token: NAME from your environment, sent on the helper's stdin.",
        ),
        json_out: bool = _options.JSON_OPTION,
    ) -> None:
        """Download benchmark prompt sets inside the target, verified: files for eval --prompts."""
        opts = context.begin(ctx, json_out)
        check_sets(sets)
        machine = opts.session().machine(target)
        root = to or posixpath.join(machine.target.workspace, PROMPTS)
        token = next(iter(_options.secret_values(secrets or []).values()), None)
        done = [fetch_set(machine, name, root, token) for name in dict.fromkeys(sets)]
        if opts.dry_run:
            return opts.dry_run_done(target=target, sets=done)
        if opts.json:
            return opts.emit({"target": target, "sets": done})
        for d in done:
            context.say(f"{target}: {d['set']} ({d['repo']}, commit {d['commit'][:12]}): "
                        f"{human_bytes(d['bytes'])}, verified; eval --prompts {d['prompts']}")  # fmt: skip
