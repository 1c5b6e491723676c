"""What the commands' lines share: the options several commands take, declared once (--json,
--host, --set, --secret, --follow, --wait), the default deadline of each command's remote calls
(the global --timeout overrides it), and the parsing of option values (step lists, target lists,
secrets from the environment). A command module imports this and the runs package, never
another command.

An option object may be shared by several commands (typer copies nothing from it); a RUN
argument never is: shell completion (complete.py) marks each command's own.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import typer

from dflashops.errors import UsageError

SECRET_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")

# The deadline of every remote call when --timeout is not given (see Machine.run): reading
# commands answer in well under a second, so their deadline is short. Where calls move data
# or do long steps, the deadline is one of progress (nothing moved for that long) and a
# target may hash a large file back from disk in between. cli.py gives it to the Context;
# other commands' deadline is targets.base.DEFAULT_TIMEOUT_S. fetch-model's helper says
# something every few seconds while bytes arrive or are hashed, so its deadline is one of
# silence: nothing moved for that long (the helper stops itself at 80% of it, cleanly).
COMMAND_TIMEOUT_S = {
    "hosts": 15.0,
    "fetch-model": 30.0,
    **dict.fromkeys(
        (
            "push",
            "setup",
            "run-script",
            "launch",
            "resume",
            "pull-ckpt",
            "export",
            "fetch-prompts",
            "eval",
            "archive",
            "datagen",
            "doctor",
        ),
        120.0,
    ),
}

JSON_OPTION = typer.Option(False, "--json", help="Print one JSON document.")

# `--host TARGET` of the commands that take a run's name (runs.survey.find/choose: the run on
# TARGET where the name exists on several targets; without a name, the newest running run there)
HOST_OPTION = typer.Option(
    None, "--host", metavar="TARGET", help="Where the name exists on several targets."
)

# what `launch` and `resume` share
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


def json_option(help: str) -> bool:  # noqa: A002 (typer's own keyword)
    """--json with a command's own words for what it prints."""
    return typer.Option(False, "--json", help=help)


def set_option(help: str) -> list[str]:  # noqa: A002
    """--set KEY=VALUE, repeated: config overrides (runs/training/config.py applies them)."""
    return typer.Option(None, "--set", metavar="KEY=VALUE", help=help)


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


MAX_INTERVAL_S = 86400.0


def check_interval(seconds: float, least: float = 1.0) -> float:
    """A polling period: a finite number of seconds, `least`..a day (never inf, nan, 0 or <0)."""
    if not math.isfinite(seconds) or not least <= seconds <= MAX_INTERVAL_S:
        raise UsageError(
            f"--interval {seconds}: a number of seconds, {least:g}..{MAX_INTERVAL_S:g}"
        )
    return seconds


def json_object(text: str | None, flag: str) -> dict[str, Any] | None:
    """A JSON object option (--chat-template-kwargs and its kin); None when not given."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{flag} {text}: not JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise UsageError(f"{flag} {text}: a JSON object, e.g. '{{\"enable_thinking\": false}}'")
    return value


SERVE_CHAT_TEMPLATE_OPTION = typer.Option(
    None,
    "--serve-chat-template",
    metavar="FILE",
    help="The chat template the engine serves with (vLLM's --chat-template): a file here, or "
    "an absolute path on the target (default: the target tokenizer's own).",
)
SERVE_CHAT_TEMPLATE_KWARGS_OPTION = typer.Option(
    None,
    "--serve-chat-template-kwargs",
    metavar="JSON",
    help="The kwargs the engine renders with (vLLM's --default-chat-template-kwargs), e.g. "
    "'{\"enable_thinking\": false}' (default: none).",
)
