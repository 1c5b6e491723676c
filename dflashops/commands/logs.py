"""`logs [RUN] [--tail N] [--follow] [--rank K]`: a run's console.log (rank 0's output, on
node 0), or rank K's own log (ranks/rank_K.log on the node that runs it); following resumes
at the byte it had reached when the connection drops, and ends when the node does (Ctrl-C
only detaches)."""

from __future__ import annotations

import posixpath

import typer

from dflashops import context
from dflashops.commands import _options
from dflashops.errors import ExitCode, NotFoundError, UsageError
from dflashops.runs.reading.survey import resolve, survey
from dflashops.runs.reading.view import RunView
from dflashops.runs.watching.log_stream import console_path, stream_log


def register(app: typer.Typer) -> None:
    @app.command("logs")
    @context.command
    def logs(
        ctx: typer.Context,
        run: str = typer.Argument(
            None, metavar="RUN", help="A run (default: the newest running one)."
        ),
        tail: int = typer.Option(0, "--tail", "-n", metavar="N", help="Only the last N lines."),
        follow: bool = typer.Option(
            False,
            "--follow",
            "-f",
            help="Keep printing until the run ends (Ctrl-C detaches, exit 130; the run goes on).",
        ),
        rank: int = typer.Option(
            None, "--rank", min=0, metavar="K", help="Rank K's output (default: rank 0's)."
        ),
        host: str = _options.HOST_OPTION,
    ) -> None:
        """Print a run's console.log (everything the trainer printed)."""
        opts = context.begin(ctx)
        if opts.json and follow:
            raise UsageError("logs --follow streams text; drop --json (or follow `status --json`)")
        session = opts.session()
        if opts.dry_run:
            survey(session, names=[run] if run else None, archive=True, records="none")
            opts.dry_run_done(run=run)
            return
        view = resolve(session, run, records="none", host=host)
        view, path = rank_log(view, rank)
        machine = session.machine(view.target)
        if opts.json:
            text = bytearray()
            stream_log(machine, view, tail=max(0, tail), follow=False, out=text.extend, path=path)
            opts.emit({"run": view.name, "target": view.target, "file": path, "rank": rank or 0,
                       "text": text.decode("utf-8", "replace")})  # fmt: skip
            return
        try:
            stream_log(machine, view, tail=max(0, tail), follow=follow, path=path)
        except KeyboardInterrupt:
            context.note(f"detached; {view.name} keeps running on {view.target}")
            raise typer.Exit(int(ExitCode.INTERRUPTED)) from None


def rank_log(view: RunView, rank: int | None) -> tuple[RunView, str]:
    """(the node's view, the file) holding rank `rank`'s output: rank 0's is node 0's
    console.log; the others write ranks/rank_K.log where they run."""
    if not rank:
        return view, console_path(view)
    beats = {r.get("rank"): r for r in view.ranks}
    if rank not in beats:
        known = ", ".join(str(k) for k in sorted(beats)) or "none recorded yet"
        raise NotFoundError(f"{view.name}: no rank {rank} (ranks: {known})")
    node = next((v for v in view.nodes or [view] if v.target == beats[rank]["target"]), view)
    return node, posixpath.join(node.dir, "ranks", f"rank_{rank}.log")
