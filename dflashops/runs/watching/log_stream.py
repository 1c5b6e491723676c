"""A log's bytes from its target as they are written (`logs`, and `eval` following its job),
through the remote follower (remote/log_tail.py): following resumes at the byte it had reached
when the connection drops, and ends when the node does (Ctrl-C only detaches)."""

from __future__ import annotations

import posixpath
import sys
import threading
import time
from collections.abc import Callable

from dflashops import context
from dflashops.errors import NotFoundError, OpsError
from dflashops.remote import argv as helper_argv
from dflashops.remote import layout
from dflashops.runs.reading.view import RunView, tmux_session
from dflashops.targets.base import Machine

RETRY_S = 3.0


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
    return posixpath.join(view.dir, layout.CONSOLE_LOG)


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
        argv = helper_argv("log_tail.py", path)
        argv += [
            tmux_session(view.name),
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
