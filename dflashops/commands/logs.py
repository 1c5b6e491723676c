"""`logs [RUN] [--tail N] [--follow] [--rank K]`: a run's console.log (rank 0's output, on
node 0), or rank K's own log (ranks/rank_K.log on the node that runs it); following resumes
at the byte it had reached when the connection drops, and ends when the node does (Ctrl-C
only detaches)."""

from __future__ import annotations

import posixpath
import sys
import threading
import time
from collections.abc import Callable

import typer

from dflashops import context, runs
from dflashops.errors import ExitCode, NotFoundError, OpsError, UsageError
from dflashops.remote import argv as helper_argv
from dflashops.runs import RunView
from dflashops.targets.base import Machine

RETRY_S = 3.0


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
        host: str = context.HOST_OPTION,
    ) -> None:
        """Print a run's console.log (everything the trainer printed)."""
        opts = context.get(ctx)
        if opts.json and follow:
            raise UsageError("logs --follow streams text; drop --json (or follow `status --json`)")
        session = opts.session()
        if opts.dry_run:
            runs.survey(session, names=[run] if run else None, archive=True, records="none")
            runs.dry_run_done(opts, run=run)
            return
        view = runs.resolve(session, run, records="none", host=host)
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


class _Held:
    """A stdin that stays open (and sends nothing) until released: the remote follower exits
    when it closes, i.e. when we go away."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def read(self, size: int = -1) -> bytes:
        self.released.wait()
        return b""

    read1 = read


class _Sinks:
    """stdout to ours, counted; stderr parsed for the follower's offset lines."""

    def __init__(self, write: Callable[[bytes], None]) -> None:
        self.write = write
        self.start = 0
        self.received = 0
        self.pending = b""

    @property
    def position(self) -> int:
        return self.start + self.received

    def out(self, chunk: bytes) -> None:
        self.write(chunk)
        self.received += len(chunk)

    def err(self, chunk: bytes) -> None:
        self.pending += chunk
        *lines, self.pending = self.pending.split(b"\n")
        for line in lines:
            if line.startswith(b"offset="):
                self.start, self.received = int(line[7:]), 0
            elif line.strip():
                context.note(line.decode("utf-8", "replace"))


def console_path(view: RunView) -> str:
    return posixpath.join(view.dir, "console.log")


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


def stream_log(
    machine: Machine,
    view: RunView,
    *,
    tail: int,
    follow: bool,
    out: Callable[[bytes], None] | None = None,
    path: str | None = None,
) -> None:
    """A log's bytes (default console.log) to `out` (default: our stdout; a reader that went
    away there ends the command quietly, see context.command)."""
    path = path or console_path(view)
    sinks = _Sinks(out or context.stream_sink(sys.stdout))
    offset = -1
    while True:
        argv = helper_argv("follow.py", path)
        argv += [
            runs.tmux_session(view.name),
            view.dir,
            str(offset),
            str(tail),
            "1" if follow else "0",
        ]
        held = _Held() if follow else None
        try:
            result = machine.run(argv, stdin=held, stdout=sinks.out, stderr=sinks.err)
        except OpsError as exc:
            if not follow:
                raise
            result = None
            context.note(f"{view.target}: {exc.message}; reconnecting in {RETRY_S:.0f}s")
        finally:
            if held is not None:
                held.released.set()
        if result is not None and result.returncode == 4:
            raise NotFoundError(f"{view.name}: no console.log in {view.target}:{view.dir}")
        if result is not None and result.ok:
            return
        if result is not None and (not follow or result.returncode > 0):
            raise OpsError(f"{view.target}: reading {path} failed: {result.error_text}")
        if result is not None:  # the connection dropped (no exit status): resume
            context.note(f"{view.target}: the log stream broke; resuming at byte {sinks.position}")
        offset = sinks.position
        time.sleep(RETRY_S)
