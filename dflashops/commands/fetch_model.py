"""`fetch-model TARGET REPO [--revision REV] [--to PATH] [--secret HF_TOKEN]`: a hub model
downloaded inside the target (huggingface_hub in its venv; $HF_ENDPOINT there picks the hub)
to <workspace>/hf/ORG/NAME, verified file by file against the hub's hashes, with progress on
stderr (runs/readiness/hub.py)."""

from __future__ import annotations

import typer

from dflashops import context
from dflashops.commands import _options
from dflashops.errors import OpsError, UsageError
from dflashops.render import human_bytes
from dflashops.runs.readiness import hub


def register(app: typer.Typer) -> None:
    @app.command("fetch-model")
    @context.command
    def fetch_model(
        ctx: typer.Context,
        target: str = typer.Argument(..., metavar="TARGET", help="A target of the inventory."),
        repo: str = typer.Argument(..., metavar="REPO", help="A hub model, e.g. Qwen/Qwen3-8B."),
        revision: str = typer.Option("main", "--revision", metavar="REV", help="Branch or commit."),
        to: str = typer.Option(
            None,
            "--to",
            metavar="PATH",
            help="Where in the target (default <workspace>/hf/ORG/NAME).",
        ),
        secrets: list[str] = typer.Option(
            None,
            "--secret",
            metavar="NAME",
            help="The hub token: NAME from your environment (e.g. HF_TOKEN), sent on the "
            "helper's stdin, never on a command line (one: the hub takes one token).",
        ),
        json_out: bool = _options.JSON_OPTION,
    ) -> None:
        """Download a hub model inside the target, verified against the hub's hashes."""
        opts = context.begin(ctx, json_out)
        hub.check_repo(repo)
        token = _token(secrets or [])
        machine = opts.session().machine(target)
        dest = to or hub.default_dest(machine.target.workspace, repo)
        if not opts.dry_run:
            context.note(f"{target}: downloading {repo}@{revision} to {dest}")
        request = hub.HubFetch(repo=repo, dest=dest, revision=revision, token=token)
        done = hub.fetch(machine, request)
        if opts.dry_run:
            return opts.dry_run_done(target=target, repo=repo, dest=dest)
        if done["bad"]:
            raise OpsError(f"{target}: {repo}: do not match the hub's hashes: "
                           f"{', '.join(done['bad'])} (removed: run fetch-model again to "
                           "fetch them anew)")  # fmt: skip
        if opts.json:
            return opts.emit({"target": target, "dest": dest, **done})
        context.say(f"{target}: {repo} at {dest}: {done['files']} files, "
                    f"{human_bytes(done['bytes'])}, commit {done['commit'][:12]}, verified")  # fmt: skip


def _token(names: list[str]) -> str | None:
    """The one --secret: the hub takes one token."""
    if len(names) > 1:
        raise UsageError(f"--secret {' '.join(names)}: the hub takes one token; give --secret once")
    return next(iter(_options.secret_values(names).values()), None)
