"""Following a run until it ends (`status --follow`, and `launch`/`resume --follow`).

Following polls the run's target every few seconds and returns when the run reaches a terminal
state: exit 0 when it finished or was stopped, 1 when it failed. Ctrl-C only detaches (the run
goes on) and exits 130, as every interrupted command does.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from dflashops import context, metrics
from dflashops.errors import ExitCode, NotFoundError, OpsError
from dflashops.render import console, duration, metric
from dflashops.runs.lifecycle.queue import said
from dflashops.runs.reading.survey import refresh
from dflashops.runs.reading.view import TERMINAL, RunView, tmux_session, value_at
from dflashops.runs.watching.status_tables import history_table, runs_table, vs_table


def follow_run(
    session: Any,
    view: RunView,
    other: RunView | None,
    *,
    interval: float,
    emit: Callable[[Any], None] | None = None,
) -> int:
    """Poll until the run is in a terminal state; the exit code of `status --follow`.
    `emit` (for --json) receives the final summary instead of the lines and the live view."""
    live = sys.stdout.isatty() and emit is None
    context.note(f"following {view.name} on {view.target} (Ctrl-C detaches; the run goes on)")
    try:
        if live:
            view = _follow_live(session, view, other, interval)
        else:
            printer = _PlainPrinter(quiet=emit is not None)
            view = _follow_plain(session, view, other, interval, printer)
    except KeyboardInterrupt:
        context.note(f"detached; {view.name} keeps running ({view.state}) on {view.target}")
        return int(ExitCode.INTERRUPTED)
    if emit is not None:
        emit(view.summary())
    else:
        context.note(f"{view.name}: {view.state} at {view.progress.text()}{_end_note(view)}")
    return 1 if view.state == "failed" else 0


def _end_note(view: RunView) -> str:
    parts = []
    if view.exit_code is not None:
        parts.append(f"exit code {view.exit_code}")
    if view.note:
        parts.append(view.note)
    return f" ({', '.join(parts)})" if parts else ""


class _Followed:
    """A followed run: its newest view, with train_log.jsonl read on from where the previous
    read ended (the probe's cursor), so a poll parses only the lines written since. Keeps the
    newest `keep` records (all of them when None: a --vs run is looked up at any step)."""

    def __init__(self, view: RunView, keep: int | None) -> None:
        self.view, self.keep = view, keep
        self.records, self.warnings = list(view.records), list(view.warnings)
        self.new: list[dict[str, Any]] = []  # the records the last read added
        self.cursor = view.log.get("cursor")

    def read(self, session: Any) -> RunView:
        """Every node of a run over several (it has ended once all of them have), node 0's log."""
        return refresh(session, self.view, records="all", cursor=self.cursor)

    def take(self, fresh: RunView) -> None:
        log = fresh.log
        if log.get("reset") or self.cursor is None:  # read from the start
            self.records, self.warnings = [], []
        self.new = log.get("records") or []
        self.records = self.records + self.new
        if self.keep is not None:
            self.records = self.records[-self.keep :]
        self.warnings = self.warnings + (log.get("warnings") or [])
        self.cursor = log.get("cursor", self.cursor)
        last = self.records[-1] if self.records else None
        fresh.raw["log"] = {**log, "records": self.records, "warnings": self.warnings, "last": last}
        self.view = fresh


ROW = tuple(m.name for m in metrics.ROW)  # a line per record shows these (status's columns)
KEEP = 200  # records kept of the followed run: enough for the ETA, the views and --vs rows


def _poll(session: Any, followed: list[_Followed]) -> None:
    """Read the followed run (and the --vs one) again, in parallel."""
    fresh = session.each(lambda f: f.read(session), followed)
    for got in fresh:
        if isinstance(got, OpsError):
            raise got
    for f, got in zip(followed, fresh, strict=True):
        f.take(got)


def _retry(view: RunView, exc: OpsError) -> None:
    if isinstance(exc, NotFoundError):
        raise exc
    context.note(f"{view.target}: {exc.message}; retrying")


def _follow(
    session: Any, view: RunView, other: RunView | None, interval: float,
    show: Callable[[_Followed, RunView | None], None],
) -> RunView:  # fmt: skip
    """Poll until the followed run ends; `show` gets each update (the run, the other run)."""
    followed = [_Followed(view, KEEP)] + ([_Followed(other, None)] if other else [])
    while view.state not in TERMINAL:
        time.sleep(interval)
        try:
            _poll(session, followed)
        except OpsError as exc:
            _retry(view, exc)
            continue
        view, other = followed[0].view, followed[1].view if other else None
        show(followed[0], other)
    return view


def _follow_plain(
    session: Any, view: RunView, other: RunView | None, interval: float, printer: _PlainPrinter
) -> RunView:
    printer.show(view, view.records[-5:], other)
    return _follow(session, view, other, interval, lambda f, o: printer.show(f.view, f.new, o))


def _follow_live(session: Any, view: RunView, other: RunView | None, interval: float) -> RunView:
    from rich.console import Group
    from rich.live import Live

    def render(v: RunView, o: RunView | None) -> Any:
        top = runs_table([v] + ([o] if o else []))
        return Group(top, vs_table(v, o) if o else history_table(v.records[-10:], title=None))

    screen = console()
    screen.soft_wrap = False  # redrawn in place, it wraps its own lines (between words)
    with Live(render(view, other), console=screen, refresh_per_second=2) as live:
        return _follow(session, view, other, interval, lambda f, o: live.update(render(f.view, o)))


class _PlainPrinter:
    """Without a terminal: one line per new log record, and a line when the state changes."""

    def __init__(self, *, quiet: bool = False) -> None:
        self.quiet = quiet
        self.state: str | None = None
        self.since: int | None = None  # the step of the last line shown
        self.warned: set[str] = set()

    def write(self, line: str) -> None:
        if not self.quiet:
            context.say(line)

    def show(self, view: RunView, records: list[dict[str, Any]], other: RunView | None) -> None:
        """The state when it changed, new warnings, and a line per record after the last shown."""
        for w in view.warnings:
            if w not in self.warned:
                self.warned.add(w)
                context.note(f"warning: {view.name} ({view.target}): {w}")
        if view.state != self.state and view.state not in TERMINAL:
            self.write(f"{view.name}: {view.state} on {view.target}")
        self.state = view.state
        for rec in records:
            if self.since is None or rec["step"] > self.since:
                self.write(self.line(view, rec, other))
                self.since = rec["step"]

    @staticmethod
    def line(view: RunView, rec: dict[str, Any], other: RunView | None) -> str:
        total = view.total_steps
        step = f"{rec['step']}/{total}" if total else str(rec["step"])
        parts = [f"{view.name} step {step}"]
        parts += [f"{k} {metric(rec.get(k), k)}" for k in ROW if k in rec]
        if rec["step"] == view.step and view.eta is not None:  # the ETA is as of now
            parts.append(f"eta {duration(view.eta)}")
        if other is not None:
            orec = value_at(other.records, rec["step"])
            if orec is not None:
                theirs = " ".join(f"{k} {metric(orec.get(k), k)}" for k in metrics.VS if k in orec)
                parts.append(f"| {other.name} @{orec['step']}: {theirs}")
        return "  ".join(parts)


def then_follow(
    reader: Any, view: RunView, follow: bool, emit: Callable[[Any], None] | None
) -> int | None:
    """Report the started run; with --follow, go on as `status --follow` and return its exit
    code (`emit`, under --json: one JSON document, at the end when following)."""
    if not (follow and emit is not None):
        report(view, emit)
    if follow:
        return follow_run(reader, view, None, interval=5.0, emit=emit)
    return None


def report(view: RunView, emit: Callable[[Any], None] | None = None) -> None:
    """The started run in one line (its summary to `emit`, under --json)."""
    if emit is not None:
        emit(view.summary())
        return
    if view.state == "queued":
        context.say(said(view))
        return
    step = f", step {view.step}/{view.total_steps}" if view.step is not None else ""
    where = ", ".join(view.node_targets)
    context.say(
        f"{view.name}: {view.state} on {where} (tmux {tmux_session(view.name)}"
        f"{step}); watch it with: dflashops status {view.name} --follow"
    )
