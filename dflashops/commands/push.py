"""`push TARGET LOCAL REMOTE`: copy a file or a directory in, verified by sha256."""

from __future__ import annotations

from pathlib import Path

import typer

from dflashops import context, transfer
from dflashops.render import Stopwatch, human_bytes, progress


def register(app: typer.Typer) -> None:
    @app.command("push")
    @context.command
    def push(
        ctx: typer.Context,
        target: str = typer.Argument(..., help="A target of the inventory."),
        local: Path = typer.Argument(..., help="A local file or directory."),
        remote: str = typer.Argument(
            ...,
            help="Destination in the target (relative paths are under its workspace); "
            "a trailing / puts a file inside that directory.",
        ),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON document."),
    ) -> None:
        """Copy a file or a directory into TARGET, then check every file's sha256 there."""
        opts = context.get(ctx)
        opts.want_json(json_out)
        machine = opts.session().machine(target)
        entries = transfer.scan(local) if local.is_dir() else None
        total = (
            sum(e.size for e in entries)
            if entries
            else (local.stat().st_size if local.is_file() else 0)
        )
        clock = Stopwatch()
        with progress(f"push {local.name}", total) as advance:
            sent = transfer.put(machine, local, remote, progress=advance, entries=entries)
        if opts.dry_run:
            return
        dest = transfer.remote_path(machine, remote)
        seconds = clock.seconds
        if opts.json:
            opts.emit(
                {
                    "target": target,
                    "dest": dest,
                    "files": sent.files,
                    "bytes": sent.bytes,
                    "seconds": round(seconds, 3),
                    "verified": "sha256",
                }
            )
        else:
            rate = human_bytes(sent.bytes / seconds) + "/s" if seconds > 0 else ""
            context.say(
                f"{target}:{dest}: {sent.files} files, {human_bytes(sent.bytes)} "
                f"in {seconds:.1f}s ({rate}), sha256 verified"
            )
