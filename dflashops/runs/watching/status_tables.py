"""The tables of runs (`status`, and the live view of a followed run): a row per run, its recent
log lines, and two runs side by side at the same steps (--vs)."""

from __future__ import annotations

from typing import Any

from dflashops import context, metrics
from dflashops.render import duration, metric, styled, table
from dflashops.runs.reading.view import RunView, value_at
from dflashops.tables import Col, Grid

COLOURS = {
    "running": "green",
    "starting": "cyan",
    "queued": "cyan",
    "finished": "blue",
    "stopped": "yellow",
    "failed": "red",
    "archived": "dim",
    "unknown": "magenta",
}


def warn_logs(views: list[RunView]) -> None:
    for view in views:
        for warning in view.warnings:
            context.note(f"warning: {view.name} ({view.target}): {warning}")


def state_cell(view: RunView):  # noqa: ANN201 (rich Text)
    return styled(view.state, COLOURS.get(view.state, "white"))


def step_cell(view: RunView) -> str:
    """Its progress as its kind reads it: a run's step of its total steps."""
    progress = view.progress
    step, total = progress.done, progress.total
    if step is None:
        return "-"
    rate = f" ({progress.rate:.2f}/s)" if progress.unit != "step" and progress.rate else ""
    return (f"{step}/{total}" if total else str(step)) + rate


def runs_table(views: list[RunView]) -> Grid:
    notes = any(v.note for v in views)
    columns = [Col("RUN", keep=True), Col("TARGET", keep=True), Col("STATE", keep=True),
               Col("STEP", keep=True), *(Col(m.header, priority=m.row) for m in metrics.ROW),
               Col("ETA", priority=6), Col("LAST LOG", priority=1)]  # fmt: skip
    columns += [Col("NOTE", priority=5, wrap=True)] if notes else []
    out = table(*columns)
    for v in views:
        last = v.last or {}
        cells = [v.name, ",".join(v.node_targets), state_cell(v), step_cell(v)]
        cells += [metric(last.get(m.name), m.name) for m in metrics.ROW]
        cells += [duration(v.progress.eta), f"{duration(v.age)} ago" if v.age is not None else "-"]
        if notes:
            cells.append(v.note or "")
        out.add_row(*cells)
    return out


def history_table(records: list[dict[str, Any]], title: str | None = "recent log lines") -> Grid:
    keys = [k for k in metrics.HISTORY if any(k in r for r in records)]
    headers = [metrics.BY_NAME[k].header for k in keys]
    rank = len(keys)  # the first metrics stay longest
    cols = [Col(h, priority=rank - i) for i, h in enumerate(headers)]
    out = table(Col("STEP", keep=True), *cols, title=title)
    for r in records:
        out.add_row(str(r["step"]), *(metric(r.get(k), k) for k in keys))
    return out


def vs_rows(a: RunView, b: RunView, count: int = 12) -> list[dict[str, Any]]:
    steps = sorted({r["step"] for r in a.records})[-count:]
    return [
        {"step": s, a.name: value_at(a.records, s), b.name: value_at(b.records, s)} for s in steps
    ]


def vs_table(a: RunView, b: RunView) -> Grid:
    """A row per run at each step: the names stay whole at any width."""
    columns = [Col("STEP", keep=True, head=True), Col("RUN", keep=True, head=True)]
    columns += [Col(k.upper(), priority=len(metrics.VS) - i) for i, k in enumerate(metrics.VS)]
    out = table(*columns, title=f"{a.name} ({a.target}) vs {b.name} ({b.target})")
    for row in vs_rows(a, b):
        for name in (a.name, b.name):
            rec = row[name]
            out.add_row(str(row["step"]), name, *(_at(rec, k, row["step"]) for k in metrics.VS))
    return out


def _at(rec: dict[str, Any] | None, key: str, step: int) -> str:
    if rec is None:
        return "-"
    text = metric(rec.get(key), key)
    return text if rec["step"] == step else f"{text} @{rec['step']}"
