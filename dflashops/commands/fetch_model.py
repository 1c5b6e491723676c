"""`fetch-model TARGET REPO [--revision REV] [--to PATH] [--secret HF_TOKEN]`: a hub model
downloaded inside the target (huggingface_hub in its venv; $HF_ENDPOINT there picks the hub),
resumable, and verified file by file against the hub's hashes (remote/hub_fetch.py)."""

from __future__ import annotations

import json
import posixpath
import sys

import typer

from dflashops import context, remote
from dflashops.commands import _options
from dflashops.errors import NotFoundError, OpsError, UnreachableError
from dflashops.render import human_bytes


def register(app: typer.Typer) -> None:
    @app.command("fetch-model")
    @context.command
    def fetch_model(
        ctx: typer.Context,
        target: str = typer.Argument(..., metavar="TARGET", help="A target of the inventory."),
        repo: str = typer.Argument(..., metavar="REPO", help="A hub model, e.g. Qwen/Qwen3-8B."),
        revision: str = typer.Option("main", "--revision", metavar="REV", help="Branch or commit."),
        to: str = typer.Option(
            None, "--to", metavar="PATH", help="Where in the target (default <workspace>/hf/NAME)."
        ),
        secrets: list[str] = typer.Option(
            None,
            "--secret",
            metavar="NAME",
            help="The hub token: NAME from your environment (e.g. HF_TOKEN), sent on the "
            "helper's stdin, never on a command line.",
        ),
        json_out: bool = _options.JSON_OPTION,
    ) -> None:
        """Download a hub model inside the target, resumable, verified against the hub's hashes."""
        opts = context.begin(ctx, json_out)
        machine = opts.session().machine(target)
        dest = to or posixpath.join(machine.target.workspace, "hf", repo.rsplit("/", 1)[-1])
        token = next(iter(_options.secret_values(secrets or []).values()), None)
        request = {"repo": repo, "revision": revision, "dest": dest, "token": token}
        argv = remote.argv("hub_fetch.py")
        argv[0] = machine.target.python
        if not opts.dry_run:
            context.note(f"{target}: downloading {repo}@{revision} to {dest}")
        result = machine.run(argv, stdin=json.dumps(request).encode(),
                             stderr=context.stream_sink(sys.stderr))  # fmt: skip
        if opts.dry_run:
            return opts.dry_run_done(target=target, repo=repo, dest=dest)
        failed = {3: UnreachableError, 4: NotFoundError}.get(result.returncode, OpsError)
        if not result.ok:
            raise failed(f"{target}: {repo}: {result.error_text}")
        done = json.loads(result.stdout)
        if done["bad"]:
            raise OpsError(f"{target}: {repo}: do not match the hub's hashes: "
                           f"{', '.join(done['bad'])}; run fetch-model again")  # fmt: skip
        if opts.json:
            return opts.emit({"target": target, "dest": dest, **done})
        context.say(f"{target}: {repo} at {dest}: {done['files']} files, "
                    f"{human_bytes(done['bytes'])}, commit {done['commit'][:12]}, verified")  # fmt: skip
