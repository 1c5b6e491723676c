"""`exec TARGET -- ARGV...`: run ARGV exactly as given; its output streams, its exit code is ours."""

from __future__ import annotations

import os
import sys

import typer

from dflashops import context
from dflashops.errors import UsageError
from dflashops.targets.base import Result


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
        opts = context.get(ctx)
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


def run_streaming(  # noqa: ANN001
    machine, argv: list[str], *, env=None, cwd=None, forward_stdin: bool = True
) -> Result:
    """Run with our stdin (when it is not a terminal) and our stdout/stderr attached."""
    attach = forward_stdin and sys.stdin is not None and not sys.stdin.isatty()
    stdin = _FdReader(sys.stdin.fileno()) if attach else None
    result = machine.run(
        argv,
        stdin=stdin,
        env=env,
        cwd=cwd,
        stdout=context.stream_sink(sys.stdout),
        stderr=context.stream_sink(sys.stderr),
    )
    return result


class _FdReader:
    """Our stdin read at the fd level: a thread blocked in it never holds a Python buffer lock."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def read1(self, size: int) -> bytes:
        return os.read(self.fd, size)

    read = read1
