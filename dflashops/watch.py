"""Showing runs: their tables (`status`, `compare`) and following one until it ends
(`status --follow`, and `launch`/`resume --follow`).

Following polls the run's target every few seconds and returns when the run reaches a terminal
state: exit 0 when it finished or was stopped, 1 when it failed. Ctrl-C only detaches (the run
goes on) and exits 130, as every interrupted command does.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from dflashops import context, runs
from dflashops.errors import ExitCode, NotFoundError, OpsError
from dflashops.render import console, duration, metric, styled, table
from dflashops.runs import RunView
from dflashops.tables import Col, Grid

COLOURS = {
    "running": "green",
    "starting": "cyan",
    "finished": "blue",
    "stopped": "yellow",
    "failed": "red",
    "archived": "dim",
    "unknown": "magenta",
}
ROW_METRICS = ("loss", "acc", "streak", "dds8", "tok_s")
HISTORY_METRICS = ("loss", "acc", "streak", "dds8", "lr", "noise", "grad_norm", "tok_s")


# ---------------------------------------------------------------- tables


def warn_logs(views: list[RunView]) -> None:
    for view in views:
        for warning in view.warnings:
            context.note(f"warning: {view.name} ({view.target}): {warning}")


def state_cell(view: RunView):  # noqa: ANN201 (rich Text)
    return styled(view.state, COLOURS.get(view.state, "white"))


def step_cell(view: RunView) -> str:
    step, total = view.step, view.total_steps
    if step is None:
        return "-"
    return f"{step}/{total}" if total else str(step)


def runs_table(views: list[RunView]) -> Grid:
    notes = any(v.note for v in views)
    columns = [Col("RUN", keep=True), Col("TARGET", keep=True), Col("STATE", keep=True),
               Col("STEP", keep=True), Col("LOSS", priority=8), Col("ACC", priority=7),
               Col("STREAK", priority=4), Col("DDS8", priority=3), Col("TOK/S", priority=2),
               Col("ETA", priority=6), Col("LAST LOG", priority=1)]  # fmt: skip
    columns += [Col("NOTE", priority=5, wrap=True)] if notes else []
    out = table(*columns)
    for v in views:
        last = v.last or {}
        cells = [v.name, ",".join(v.node_targets), state_cell(v), step_cell(v)]
        cells += [metric(last.get(k), k) for k in ROW_METRICS]
        cells += [duration(v.eta), f"{duration(v.age)} ago" if v.age is not None else "-"]
        if notes:
            cells.append(v.note or "")
        out.add_row(*cells)
    return out


def history_table(records: list[dict[str, Any]], title: str | None = "recent log lines") -> Grid:
    keys = [k for k in HISTORY_METRICS if any(k in r for r in records)]
    headers = [k.upper().replace("_", "/" if k == "tok_s" else " ") for k in keys]
    rank = len(keys)  # the first metrics stay longest
    cols = [Col(h, priority=rank - i) for i, h in enumerate(headers)]
    out = table(Col("STEP", keep=True), *cols, title=title)
    for r in records:
        out.add_row(str(r["step"]), *(metric(r.get(k), k) for k in keys))
    return out


# ---------------------------------------------------------------- --vs: two runs at the same steps


def vs_rows(a: RunView, b: RunView, count: int = 12) -> list[dict[str, Any]]:
    steps = sorted({r["step"] for r in a.records})[-count:]
    return [
        {"step": s, a.name: runs.value_at(a.records, s), b.name: runs.value_at(b.records, s)}
        for s in steps
    ]


def vs_table(a: RunView, b: RunView) -> Grid:
    """A row per run at each step: the names stay whole at any width."""
    columns = [Col("STEP", keep=True, head=True), Col("RUN", keep=True, head=True)]
    columns += [Col(k.upper(), priority=len(runs.METRICS) - i) for i, k in enumerate(runs.METRICS)]
    out = table(*columns, title=f"{a.name} ({a.target}) vs {b.name} ({b.target})")
    for row in vs_rows(a, b):
        for name in (a.name, b.name):
            rec = row[name]
            out.add_row(str(row["step"]), name, *(_at(rec, k, row["step"]) for k in runs.METRICS))
    return out


def _at(rec: dict[str, Any] | None, key: str, step: int) -> str:
    if rec is None:
        return "-"
    text = metric(rec.get(key), key)
    return text if rec["step"] == step else f"{text} @{rec['step']}"


# ---------------------------------------------------------------- --follow


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
        context.note(f"{view.name}: {view.state} at step {view.step}{_end_note(view)}")
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
        return runs.refresh(session, self.view, records="all", cursor=self.cursor)

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
    while view.state not in runs.TERMINAL:
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
        if view.state != self.state and view.state not in runs.TERMINAL:
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
        parts += [f"{k} {metric(rec.get(k), k)}" for k in ROW_METRICS if k in rec]
        if rec["step"] == view.step and view.eta is not None:  # the ETA is as of now
            parts.append(f"eta {duration(view.eta)}")
        if other is not None:
            orec = runs.value_at(other.records, rec["step"])
            if orec is not None:
                theirs = " ".join(
                    f"{k} {metric(orec.get(k), k)}" for k in runs.METRICS if k in orec
                )
                parts.append(f"| {other.name} @{orec['step']}: {theirs}")
        return "  ".join(parts)
