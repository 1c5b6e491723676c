"""`push TARGET LOCAL REMOTE`: copy a file or a directory in, verified there (CRC-32 and size
of each file against what was read here; sha256 with --checksum).

Like `sync` (but deleting nothing there), only what differs is sent: files whose size, mtime or
mode differ (rsync's quick check), or, with --checksum, whose sha256 differs.
"""

from __future__ import annotations

from pathlib import Path

import typer

from dflashops import context, transfer
from dflashops.commands import _options
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
        checksum: bool = typer.Option(
            False,
            "--checksum",
            help="Compare files by sha256 on both sides (reads them all) instead of by size, "
            "mtime and mode, and check what is sent by sha256 (not CRC-32).",
        ),
        json_out: bool = _options.JSON_OPTION,
    ) -> None:
        """Copy a file or a directory into TARGET (only what differs there), every sent file
        checked there against what was read here (CRC-32 and size; sha256 with --checksum)."""
        opts = context.begin(ctx, json_out)
        machine = opts.session().machine(target)
        clock = Stopwatch()
        with progress(f"push {local.name}", None) as meter:
            todo, sent = transfer.push(machine, local, remote, checksum=checksum, progress=meter)
        files, bytes_ = sent.files, sent.bytes
        for warning in sent.warnings:
            context.note(f"warning: {target}: {warning}")
        if opts.dry_run:
            return
        seconds = clock.seconds
        verified = "sha256" if checksum else "crc32"
        if opts.json:
            opts.emit(
                {
                    "target": target,
                    "dest": todo.dest,
                    "files": files,
                    "bytes": bytes_,
                    "unchanged": todo.unchanged,
                    "seconds": round(seconds, 3),
                    "verified": verified,
                }  # fmt: skip
            )
            return
        rate = f" ({human_bytes(bytes_ / seconds)}/s)" if seconds > 0 and bytes_ else ""
        same = f", {todo.unchanged} unchanged" if todo.unchanged else ""
        context.say(
            f"{target}:{todo.dest}: {files} files, {human_bytes(bytes_)} in {seconds:.1f}s"
            f"{rate}{same}, {verified} verified"
        )
