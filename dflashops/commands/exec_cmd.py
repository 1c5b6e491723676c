"""`exec TARGET -- ARGV...`: run ARGV exactly as given; its output streams, its exit code is ours."""

from __future__ import annotations

import typer

from dflashops import context
from dflashops.attached import run_streaming
from dflashops.errors import UsageError


def register(app: typer.Typer) -> None:
    @app.command(
        "exec",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )
    @context.command
    def exec_(
        ctx: typer.Context,
        target: str = typer.Argument(..., help="A target of the inventory."),
        argv: list[str] = typer.Argument(None, help="The command and its arguments, after --."),
        cwd: str = typer.Option(
            None, "--cwd", help="Directory to run in (default: the login's or /)."
        ),
        env: list[str] = typer.Option(
            None,
            "--env",
            "-e",
            help="NAME=VALUE for the command (repeatable; visible in ps on "
            "the host: use `launch --secret` for secrets).",
        ),
        no_stdin: bool = typer.Option(
            False, "--no-stdin", "-n", help="Give the command no stdin (for loops that read ours)."
        ),
    ) -> None:
        """Run ARGV on TARGET exactly as given: no shell unless ARGV is one."""
        if not argv:
            raise UsageError(
                "nothing to run: give the command after --, e.g. exec ct200 -- nvidia-smi"
            )
        opts = context.begin(ctx)
        machine = opts.session().machine(target)
        result = run_streaming(
            machine, list(argv), env=parse_env(env), cwd=cwd, forward_stdin=not no_stdin
        )
        raise typer.Exit(result.returncode)


def parse_env(items: list[str] | None) -> dict[str, str]:
    out = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise UsageError(f"--env {item!r}: expected NAME=VALUE")
        out[name] = value
    return out
