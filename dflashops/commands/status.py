"""`status [RUN] [--follow] [--vs RUN] [--all]`: runs, their state and latest metrics.

One probe per target, all in parallel. `--follow` polls the run's target every few seconds and
returns when the run reaches a terminal state: exit 0 when it finished or was stopped, 1 when it
failed. Ctrl-C only detaches (the run goes on) and exits 130, as every interrupted command does.
"""

from __future__ import annotations

import os
from typing import Any

import typer

from dflashops import context
from dflashops.commands import _options
from dflashops.errors import NotFoundError, UnreachableError
from dflashops.render import console, duration, metric
from dflashops.runs.evaluation.results import latest_eval
from dflashops.runs.lifecycle import kinds
from dflashops.runs.reading.failure import trainer_lines
from dflashops.runs.reading.survey import Survey, expand, find, resolve, survey
from dflashops.runs.reading.view import VALUE_RULE, RunView, lived_text, tmux_session
from dflashops.runs.watching.status_follow import follow_run
from dflashops.runs.watching.status_tables import (
    history_table,
    runs_table,
    vs_rows,
    vs_table,
    warn_logs,
)


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
        host: str = _options.HOST_OPTION,
        interval: float = typer.Option(
            5.0, "--interval", metavar="SECONDS", help="Polling period of --follow."
        ),
        json_out: bool = _options.JSON_OPTION,
    ) -> None:
        """Runs across the inventory: state, step, loss, acc, streak, dds8, tok/s, ETA.

        --follow exits 0 when the run finishes or is stopped, 1 when it fails, and 130 on
        Ctrl-C, which only detaches: the run goes on."""
        opts = context.begin(ctx, json_out)
        session = opts.session()
        if opts.dry_run:
            survey(session, archive=all_)
            opts.dry_run_done(run=run)
            return
        if follow:
            view = resolve(session, run, records="recent", host=host)
            other = find(session, vs, records="all", host=host, strict=False) if vs else None
            emit = opts.emit if opts.json else None
            code = follow_run(
                session, view, other, interval=_options.check_interval(interval), emit=emit
            )
            raise typer.Exit(code)
        if vs:
            view = resolve(session, run, records="all", host=host)
            other = find(session, vs, records="all", host=host, strict=False)
            show_vs(view, other, opts.json, opts)
            return
        if run:
            try:
                view = find(session, run, host=host, records="recent", checkpoints=True,
                            console=8192)  # fmt: skip
            except (NotFoundError, UnreachableError):  # no such run, or on a target not read
                if not show_sweep(session, run, opts, host=host):
                    raise
                return
            show_one(view, opts.json, opts, latest_eval(opts.session(), view))
            return
        if host is not None:
            opts.inventory().target(host)  # a name that is no target: one line, exit 4
        found = survey(session, archive=all_, records="recent")
        show_all(found, all_, opts.json, opts, host=host)
        raise typer.Exit(found.exit_code())


# ---------------------------------------------------------------- one-shot views


def show_sweep(session: Any, name: str, opts: context.Context, host: str | None) -> bool:
    """`status NAME` of a sweep: its runs, as `status --all` lists them; False when the name
    is no sweep's either."""
    found, names = expand(session, [name], archive=True, records="recent")
    if names == [name]:
        return False
    show_all(found, True, opts.json, opts, host=host)
    return True


def show_all(
    found: Survey, all_: bool, as_json: bool, opts: context.Context, host: str | None = None
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
            out.print("no runs" + (" running" if hidden else "") + read_where(found, opts))
        if hidden:
            out.print(f"({hidden} finished or archived run(s) not shown: --all shows them)")
    found.warn_errors()


def read_where(found: Survey, opts: context.Context, shown: int = 4) -> str:
    """' in local:/path/ws (not there yet), ct200:/workspace': the workspaces read."""
    targets = opts.inventory().targets
    places = []
    for name in list(found.probes)[:shown]:
        ws = targets[name].workspace
        missing = targets[name].kind == "local" and not os.path.isdir(ws)
        places.append(f"{name}:{ws}" + (" (not there yet)" if missing else ""))
    more = " ..." if len(found.probes) > shown else ""
    return f" in {', '.join(places)}{more}" if places else ""


def show_one(
    view: RunView, as_json: bool, opts: context.Context, evaluated: dict[str, Any] | None = None
) -> None:
    warn_logs([view])
    if as_json:
        doc = view.summary()
        if evaluated is not None:
            doc["eval"] = evaluated
        doc["checkpoints"] = [
            {"step": c.step, "complete": c.complete, "bytes": c.bytes} for c in view.checkpoints
        ]
        doc["records"] = view.records
        opts.emit(doc)
        return
    out = console()
    out.print(runs_table([view]))
    out.print()
    for label, value in details(view) + eval_rows(view, evaluated):
        out.print(f"{label + ':':<13}{value}")
    if view.records:
        out.print()
        out.print(history_table(view.records[-8:]))


def details(view: RunView) -> list[tuple[str, str]]:
    st = view.status
    rows = [("dir", f"{view.target}:{view.dir}")]
    if view.raw.get("tmux"):
        rows.append(("tmux", f"{tmux_session(view.name)} (on {view.target}, our tmux "
                             "server: tmux -L dflashops)"))  # fmt: skip
    if st.get("pid"):
        rows.append(("pid", str(st["pid"])))
    rows += node_rows(view)
    if len(view.status.get("history") or []) > 1:  # it moved, or changed its processes
        rows.append(("lived", lived_text(view)))
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
    return rows + kinds.by_where(view.where).details(view)  # a run's: wandb, checkpoints


def eval_rows(view: RunView, evaluated: dict[str, Any] | None) -> list[tuple[str, str]]:
    """Its newest evaluated step's tau, and the continuous evals that follow it."""
    if not evaluated:
        return []
    rows = []
    if evaluated.get("step") is not None:
        rows.append(("tau", f"{metric(evaluated.get('tau'), 'streak')} at step "
                            f"{evaluated['step']} (on {evaluated['target']}; "
                            f"{evaluated['results']} result(s): dflashops evals {view.name})"))  # fmt: skip
    rows += [("evaluating", f"continuous eval {f}") for f in evaluated["following"]]
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
            for line in trainer_lines(node)[-3:]:
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


# ---------------------------------------------------------------- --vs: two runs at the same steps


def show_vs(a: RunView, b: RunView, as_json: bool, opts: context.Context) -> None:
    warn_logs([a, b])
    if as_json:
        opts.emit(
            {
                "runs": [a.summary(), b.summary()],
                "rule": VALUE_RULE,
                "rows": vs_rows(a, b),
            }
        )
        return
    out = console()
    out.print(vs_table(a, b))
    out.print("(values at each step are from the last record at or before it; @N marks step N)")
