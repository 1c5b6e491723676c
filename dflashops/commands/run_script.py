"""`run-script TARGET SCRIPT [-- ARGS...]`: send a script as a file, run it with the target's python."""

from __future__ import annotations

import hashlib
from pathlib import Path

import typer

from dflashops import context, transfer
from dflashops.attached import run_streaming
from dflashops.errors import NotFoundError, UsageError

SCRIPTS = "dflashops/scripts"


def register(app: typer.Typer) -> None:
    @app.command(
        "run-script",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )
    @context.command
    def run_script(
        ctx: typer.Context,
        target: str = typer.Argument(..., help="A target of the inventory."),
        script: Path = typer.Argument(..., help="A local Python script."),
        args: list[str] = typer.Argument(None, help="Arguments for the script, after --."),
        python: str = typer.Option(
            None, "--python", help="Interpreter to use (default: the target's python)."
        ),
    ) -> None:
        """Copy SCRIPT into TARGET as a file and run it there; its exit code becomes ours."""
        if not script.is_file():
            raise UsageError(f"{script}: no such script")
        opts = context.begin(ctx)
        machine = opts.session().machine(target)
        remote = stage_script(machine, script)
        interpreter = python or machine.target.python
        result = run_streaming(machine, [interpreter, remote, *(args or [])], cwd=None)
        if result.returncode == 127 and interpreter.encode() in result.stderr:
            raise NotFoundError(
                f"{target}: cannot run {interpreter}; run `dflashops setup {target}` first "
                f"or give --python"
            )
        raise typer.Exit(result.returncode)


def stage_script(machine, script: Path) -> str:  # noqa: ANN001
    """Copy a script under <workspace>/dflashops/scripts, named by its content (verified)."""
    digest = hashlib.sha256(script.read_bytes()).hexdigest()[:12]
    remote = f"{machine.target.workspace}/{SCRIPTS}/{digest}-{script.name}"
    transfer.put(machine, script, remote)
    return remote
