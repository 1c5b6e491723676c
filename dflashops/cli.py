"""The `dflashops` command line: global options, one sub-module per verb (loaded when it runs:
verbs.py), contract exit codes."""

from __future__ import annotations

import typer

from dflashops.commands import _options
from dflashops.context import Context
from dflashops.verbs import LazyVerbs

app = typer.Typer(
    name="dflashops",
    cls=LazyVerbs,  # a verb's module is imported only when it runs
    help="Train and evaluate DFlash drafters on Proxmox GPU servers.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def show_version(value: bool) -> None:
    if not value:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        typer.echo(f"dflashops {version('dflashops')}")
    except PackageNotFoundError:
        typer.echo("dflashops (not installed: no package metadata)")
    raise typer.Exit()


@app.callback()
def global_options(
    ctx: typer.Context,
    inventory: str = typer.Option(
        None,
        "--inventory",
        metavar="PATH",
        help="hosts.yaml to use (else $DFLASHOPS_INVENTORY, ./hosts.yaml, ~/.config/dflashops/hosts.yaml).",
    ),
    json_out: bool = typer.Option(
        False, "--json", help="Print one JSON document (reading commands)."
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print the exact argv per host; change nothing."
    ),
    verbose: int = typer.Option(0, "-v", "--verbose", count=True, help="More detail on stderr."),
    timeout: float = typer.Option(
        None,
        "--timeout",
        metavar="SECONDS",
        min=0.1,
        help="How long any remote call may go without an answer before it fails with exit 3 "
        "(default: 15 for hosts, 120 for copies and launches, else 30; a call that streams "
        "output or keeps copying bytes runs on while the connection answers).",
    ),
    _version: bool = typer.Option(
        False,
        "--version",
        callback=show_version,
        is_eager=True,
        help="Print the version and exit.",
    ),
) -> None:
    ctx.obj = Context(
        inventory_path=inventory,
        json=json_out,
        dry_run=dry_run,
        verbose=verbose,
        timeout=timeout,
        deadlines=_options.COMMAND_TIMEOUT_S,
    )


def dry_run_first(argv: list[str]) -> list[str]:
    """`--dry-run` given after the verb (`launch RUN ... --dry-run`) moved before it, where
    the global option is read; nothing after a `--` (exec's ARGV) is touched."""
    end = argv.index("--") if "--" in argv else len(argv)
    if "--dry-run" not in argv[:end]:
        return argv
    rest = [a for i, a in enumerate(argv) if i >= end or a != "--dry-run"]
    return ["--dry-run", *rest]


def main() -> None:
    import sys

    app(args=dry_run_first(sys.argv[1:]), prog_name="dflashops")


if __name__ == "__main__":
    main()
