"""What the commands' lines share: options declared once (--json, --host, --set, --secret,
--follow, --wait, timeouts) and the parsing of their values (step lists, target lists,
secrets from the environment)."""

from __future__ import annotations

import os
import re

import typer

from dflashops.errors import UsageError

SECRET_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# `--host TARGET` of the commands that take a run's name (runs.survey.find/choose: the run on
# TARGET where the name exists on several targets; without a name, the newest running run there)
HOST_OPTION = typer.Option(
    None, "--host", metavar="TARGET", help="Where the name exists on several targets."
)

# options that `launch` and `resume` share
SECRETS_OPTION = typer.Option(
    None,
    "--secret",
    metavar="NAME",
    help="Pass NAME from your environment (e.g. WANDB_API_KEY) to the trainer through a 0600 "
    "file outside the run directory, read and deleted as the trainer starts; never on a "
    "command line. resume asks for it again.",
)


FOLLOW_OPTION = typer.Option(
    False, "--follow", "-f", help="Then watch it, as status --follow does."
)


WAIT_OPTION = typer.Option(
    900, "--wait", metavar="SECONDS", help="How long to wait for the first sign of life."
)


JSON_OPTION = typer.Option(False, "--json", help="Print one JSON document.")


def parse_steps(
    text: str | None, option: str = "--steps", *, least: int = 0, example: str = "100,500"
) -> list[int]:
    """Comma-separated integers >= least, sorted, each once (--steps; eval's --budgets)."""
    if not text:
        return []
    try:
        steps = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UsageError(
            f"{option} {text}: expected comma-separated integers, e.g. {example}"
        ) from None
    if any(s < least for s in steps):
        raise UsageError(f"{option} {text}: {option.removeprefix('--')} are >= {least}")
    return steps


def parse_hosts(spec: str) -> list[str]:
    names = [part.strip() for part in spec.split(",")]
    if not all(names):
        raise UsageError(f"--host {spec}: give target names separated by commas (ct200,ct201)")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UsageError(f"--host {spec}: {', '.join(twice)} named twice; a target is one node")
    return names


def secret_values(names: list[str]) -> dict[str, str]:
    """--secret NAME...: the values from our environment (they travel on stdin only)."""
    values = {}
    for name in names:
        if not SECRET_NAME.match(name):
            raise UsageError(
                f"--secret {name}: give an environment variable's name (its value is read from "
                "your environment), e.g. --secret WANDB_API_KEY"
            )
        value = os.environ.get(name)
        if value is None:
            raise UsageError(f"--secret {name}: not set in your environment")
        values[name] = value
    return values
