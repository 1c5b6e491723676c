"""`doctor TARGET [--config FILE|TEMPLATE] [--set KEY=VALUE]...`: is the target ready to run
that config? One read of the target, one line per requirement (ok / missing / wrong, and what
to do); exit 0 only when it is ready (runs/readiness/doctor.py judges)."""

from __future__ import annotations

from typing import Any

import typer
import yaml

from dflashops import context
from dflashops.commands import _options
from dflashops.inventory import Target
from dflashops.runs.readiness import doctor as checks
from dflashops.runs.training.config import resolve_config


def register(app: typer.Typer) -> None:
    @app.command("doctor")
    @context.command
    def doctor(
        ctx: typer.Context,
        target: str = typer.Argument(..., help="A target of the inventory."),
        config: str = typer.Option(
            None,
            "--config",
            metavar="FILE|TEMPLATE",
            help="The run config to be ready for (default: tiny on a target without gpus in "
            "hosts.yaml, else qwen36-27b).",
        ),
        sets: list[str] = _options.set_option("Override a config key, e.g. target.path=/m."),
        json_out: bool = _options.JSON_OPTION,
    ) -> None:
        """Check every requirement of a run on TARGET, one line each; exit 0 when ready."""
        opts = context.begin(ctx, json_out)
        found = opts.inventory().target(target)
        spec = config or default_config(found)
        model = model_of(resolve_config(spec, sets or [], "doctor"))
        machine = opts.session().machine(found)
        facts = checks.read(machine, model)
        if opts.dry_run:
            opts.dry_run_done(target=target, config=spec)
            return
        verdicts = checks.judge(found, facts, model)
        ready = not any(c.failed for c in verdicts)
        if opts.json:
            opts.emit({"target": target, "config": spec, "ready": ready,
                       "checks": [vars(c) for c in verdicts]})  # fmt: skip
        else:
            context.say(f"{target}: ready for {spec}?")
            for check in verdicts:
                context.say(check.line())
            for check in verdicts:
                for line in check.host_fix if check.failed else []:
                    context.say(line)
            context.say(f"{target}: {'ready' if ready else 'NOT ready'} for {spec}")
        if not ready:
            raise typer.Exit(1)


def default_config(target: Target) -> str:
    return "qwen36-27b" if target.gpus else "tiny"


def model_of(text: str) -> str | None:
    data: Any = yaml.safe_load(text) or {}
    section = data.get("target") if isinstance(data, dict) else None
    path = section.get("path") if isinstance(section, dict) else None
    return str(path) if path else None
