"""`status [RUN] [--follow] [--vs RUN] [--all]`: runs, their state and latest metrics.

One probe per target, all in parallel. `--follow` polls the run's target every few seconds and
returns when the run reaches a terminal state: exit 0 when it finished or was stopped, 1 when it
failed. Ctrl-C only detaches (the run goes on) and exits 130, as every interrupted command does.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import typer

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


def register(app: typer.Typer) -> None:
    @app.command("status")
    @context.command
    def status(
        ctx: typer.Context,
        run: str = typer.Argument(
            None,
            metavar="RUN",
            help="A run (default: every run; with --follow, the newest running one).",
        ),
        follow: bool = typer.Option(
            False,
            "--follow",
            "-f",
            help="Watch until the run ends (Ctrl-C detaches, exit 130; the run goes on).",
        ),
        vs: str = typer.Option(
            None, "--vs", metavar="RUN", help="Show another run beside it at the same steps."
        ),
        all_: bool = typer.Option(False, "--all", "-a", help="Include finished and archived runs."),
        host: str = context.HOST_OPTION,
        interval: float = typer.Option(
            5.0, "--interval", metavar="SECONDS", help="Polling period of --follow."
        ),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON document."),
    ) -> None:
        """Runs across the inventory: state, step, loss, acc, streak, dds8, tok/s, ETA.

        --follow exits 0 when the run finishes or is stopped, 1 when it fails, and 130 on
        Ctrl-C, which only detaches: the run goes on."""
        opts = context.get(ctx)
        as_json = opts.want_json(json_out)
        session = opts.session()
        if opts.dry_run:
            runs.survey(session, archive=all_)
            runs.dry_run_done(opts, run=run)
            return
        if follow:
            view = runs.resolve(session, run, records="recent", host=host)
            other = runs.find(session, vs, records="all", host=host, strict=False) if vs else None
            emit = opts.emit if as_json else None
            code = follow_run(session, view, other, interval=max(1.0, interval), emit=emit)
            raise typer.Exit(code)
        if vs:
            view = runs.resolve(session, run, records="all", host=host)
            other = runs.find(session, vs, records="all", host=host, strict=False)
            show_vs(view, other, as_json, opts)
            return
        if run:
            view = runs.find(session, run, host=host, records="recent", checkpoints=True,
                             console=8192)  # fmt: skip
            show_one(view, as_json, opts)
            return
        if host is not None:
            opts.inventory().target(host)  # a name that is no target: one line, exit 4
        found = runs.survey(session, archive=all_, records="recent")
        show_all(found, all_, as_json, opts, host=host)
        raise typer.Exit(found.exit_code())


# ---------------------------------------------------------------- one-shot views


def show_all(
    found: runs.Survey, all_: bool, as_json: bool, opts: context.Context, host: str | None = None
) -> None:
    """Every run (on `host`, when given) but finished and archived ones, unless `all_`."""
    views = [v for v in found.runs() if host is None or host in v.node_targets]
    views.sort(key=lambda r: (-(r.started or 0), r.target, r.name))
    shown = [v for v in views if all_ or v.state not in ("finished", "archived")]
    hidden = len(views) - len(shown)
    warn_logs(shown)
    if as_json:
        opts.emit(
            {
                "runs": [v.summary() for v in shown],
                "hidden": hidden,
                "errors": {t: e.message for t, e in found.errors.items()},
            }
        )
    else:
        out = console()
        if shown:
            out.print(runs_table(shown))
        else:
            out.print("no runs" + (" running" if hidden else ""))
        if hidden:
            out.print(f"({hidden} finished or archived run(s) not shown: --all shows them)")
    found.warn_errors()


def show_one(view: RunView, as_json: bool, opts: context.Context) -> None:
    warn_logs([view])
    if as_json:
        doc = view.summary()
        doc["checkpoints"] = [
            {"step": c.step, "complete": c.complete, "bytes": c.bytes} for c in view.checkpoints
        ]
        doc["records"] = view.records
        opts.emit(doc)
        return
    out = console()
    out.print(runs_table([view]))
    out.print()
    for label, value in details(view):
        out.print(f"{label + ':':<13}{value}")
    if view.records:
        out.print()
        out.print(history_table(view.records[-8:]))


def details(view: RunView) -> list[tuple[str, str]]:
    st = view.status
    rows = [("dir", f"{view.target}:{view.dir}")]
    if view.raw.get("tmux"):
        rows.append(("tmux", f"{runs.tmux_session(view.name)} (on {view.target}, our tmux "
                             "server: tmux -L dflashops)"))  # fmt: skip
    if st.get("pid"):
        rows.append(("pid", str(st["pid"])))
    rows += node_rows(view)
    ranks = view.ranks
    if ranks:
        rows.append(("ranks", ranks_cell(ranks)))
    if view.started:
        rows.append(("started", f"{duration(view.now - view.started)} ago"))
    if st.get("finished"):
        rows.append(("ended", f"{duration(view.now - st['finished'])} ago"))
    if view.exit_code is not None:
        rows.append(("exit code", str(view.exit_code)))
    if view.note:
        rows.append(("note", view.note))
    if st.get("wandb_url"):
        rows.append(("wandb", st["wandb_url"]))
    ckpts = view.checkpoints
    if ckpts:
        names = [c.name + ("" if c.complete else " (incomplete)") for c in ckpts]
        rows.append(("checkpoints", ", ".join(names)))
    else:
        rows.append(("checkpoints", "none yet"))
    return rows


def node_rows(view: RunView) -> list[tuple[str, str]]:
    """One row per node of a run over several targets: state, exit code, what it said last."""
    if not view.multi:
        return []
    rows = []
    for node in view.nodes:
        code = f", exit code {node.exit_code}" if node.exit_code is not None else ""
        note = f" ({node.note})" if node.note else ""
        rows.append((f"node {node.node_index}", f"{node.target}: {node.state}{code}{note}"))
        if node.state == "failed":
            for line in runs.trainer_lines(node)[-3:]:
                rows.append(("", f"  {line}"))
    missing = [t for t in view.node_targets if t not in {n.target for n in view.nodes}]
    rows += [("node", f"{t}: not read") for t in missing]
    return rows


def ranks_cell(ranks: list[dict[str, Any]]) -> str:
    """'4/4 alive', or which ranks are gone and where."""
    alive = [r for r in ranks if r.get("alive")]
    text = f"{len(alive)}/{len(ranks)} alive"
    gone = [r for r in ranks if not r.get("alive") and r.get("status") not in ("finished",
                                                                                "stopped")]  # fmt: skip
    if gone:
        text += "; not alive: " + ", ".join(
            f"rank {r.get('rank')} on {r.get('target')} ({r.get('status')})" for r in gone
        )
    return text


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


def show_vs(a: RunView, b: RunView, as_json: bool, opts: context.Context) -> None:
    warn_logs([a, b])
    if as_json:
        opts.emit(
            {
                "runs": [a.summary(), b.summary()],
                "rule": runs.VALUE_RULE,
                "rows": vs_rows(a, b),
            }
        )
        return
    out = console()
    out.print(vs_table(a, b))
    out.print("(values at each step are from the last record at or before it; @N marks step N)")


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
