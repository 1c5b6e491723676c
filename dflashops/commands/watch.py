"""`watch RUN [--vs BASELINE --margin X] [--stall K] [--metric tau|speedup@C|acc|streak|...]
[--on-alert CMD] [--interval S] [--once]`: alarms on a run, left running.

Every --interval seconds (default 60) the run is read again (and, for tau, the stored
evaluations of both runs; for speedup@C, their serving results' speedup at concurrency C,
`eval --serve`), and each rule of runs/watching/alarms.py is checked at the newest milestone:
--margin X raises an alert when the run is not ahead of BASELINE by more than X there (tau:
only at steps both were evaluated with equal settings); --stall K when the run has not risen over
its last K values. Each alert (rule, metric, step) is raised once: a line on stdout, and
--on-alert CMD run: CMD is split once with shlex from the user's text and run without a shell,
with the facts in DFLASHOPS_ALERT_* (RUN, TARGET, RULE, METRIC, STEP, VALUE, MESSAGE, BASELINE,
BASELINE_VALUE, MARGIN, STALL, WANDB_URL) and a deadline of 60 s; a failing command is said in
one line and watching goes on. It ends (exit 0) after the check that follows the run's end;
--once checks once. Ctrl-C ends it (exit 130). --json: one document with every alert at the end.
A run that logs to W&B gets each alert as a W&B alert too, sent by its trainer (runs/
wandb_alert.py); an ended run's cannot be: said in one line.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from typing import Any

import typer

from dflashops import context
from dflashops.commands import _options
from dflashops.errors import ExitCode, UsageError
from dflashops.remote import layout
from dflashops.render import console
from dflashops.runs.evaluation.results import SPEEDUP, stored
from dflashops.runs.reading.survey import find
from dflashops.runs.reading.view import TERMINAL, RunView, check_name
from dflashops.runs.watching.alarms import Alert, Rule, check, facts_env
from dflashops.runs.watching.wandb_alert import logs_to_wandb, request

ALERT_CMD_TIMEOUT_S = 60.0


def register(app: typer.Typer) -> None:
    @app.command("watch")
    @context.command
    def watch(
        ctx: typer.Context,
        run: str = typer.Argument(..., metavar="RUN", help="The run to watch."),
        vs: str = typer.Option(None, "--vs", metavar="BASELINE", help="The run to track."),
        margin: float = typer.Option(
            None,
            "--margin",
            metavar="X",
            help="Alert when RUN is not ahead of BASELINE by more than X at a milestone.",
        ),  # fmt: skip
        stall: int = typer.Option(
            None, "--stall", metavar="K", help="Alert when RUN has not risen over its last K."
        ),
        metric: str = typer.Option(
            "tau",
            "--metric",
            metavar="KEY",
            help="tau (stored evaluations; ddtreeB too), speedup@C (serving results, eval "
            "--serve, at concurrency C) or a train_log key (acc, streak, ...).",
        ),  # fmt: skip
        on_alert: str = typer.Option(
            None,
            "--on-alert",
            metavar="CMD",
            help="A command run on each alert (no shell), the facts in DFLASHOPS_ALERT_*.",
        ),  # fmt: skip
        interval: float = typer.Option(60.0, "--interval", metavar="SECONDS"),
        once: bool = typer.Option(False, "--once", help="Check once and exit."),
        host: str = _options.HOST_OPTION,
        json_out: bool = _options.JSON_OPTION,
    ) -> None:
        """Alarms on a run: tau (or acc, streak) too close to a baseline's, or not rising."""
        opts = context.begin(ctx, json_out)
        check_name(run)
        interval = _options.check_interval(interval)
        rule = make_rule(metric, vs, margin, stall)
        argv = alert_argv(on_alert)
        if vs is not None:
            check_name(vs)
        session = opts.session()
        if opts.dry_run:
            opts.dry_run_done(run=run)
            return
        raised: dict[tuple[str, str, int], Alert] = {}
        wandb_said: dict[tuple[str, str, int], str] = {}
        try:
            while True:
                view, ended = poll(session, run, vs, rule, host, (raised, wandb_said), argv,
                                   opts.json)  # fmt: skip
                if once or ended:
                    break
                time.sleep(interval)
        except KeyboardInterrupt:
            context.note(f"stopped watching {run}")
            raise typer.Exit(int(ExitCode.INTERRUPTED)) from None
        if opts.json:
            opts.emit({"run": run, "baseline": vs, "state": view.state,
                       "alerts": [{**vars(a), "wandb": wandb_said.get(k)}
                                  for k, a in raised.items()]})  # fmt: skip


def make_rule(metric: str, vs: str | None, margin: float | None, stall: int | None) -> Rule:
    if margin is None and stall is None:
        raise UsageError("give a rule: --vs BASELINE --margin X, or --stall K (or both)")
    if margin is not None and vs is None:
        raise UsageError("--margin needs --vs BASELINE: the run to keep ahead of")
    if stall is not None and stall < 1:
        raise UsageError(f"--stall {stall}: a number of values, >= 1")
    if not metric.strip():
        raise UsageError("--metric: name one, e.g. tau, acc or streak")
    return Rule(metric.strip(), margin, stall)


def alert_argv(text: str | None) -> list[str] | None:
    """The user's command, split once (shlex) from their own text; its program must exist."""
    if text is None:
        return None
    try:
        argv = shlex.split(text)
    except ValueError as exc:
        raise UsageError(f"--on-alert {text!r}: {exc}") from None
    if not argv:
        raise UsageError("--on-alert: empty command")
    if shutil.which(argv[0]) is None:
        raise UsageError(f"--on-alert: {argv[0]}: no such program (give a path or a command "
                         "on PATH)")  # fmt: skip
    return argv


def poll(
    session: Any,
    run: str,
    vs: str | None,
    rule: Rule,
    host: str | None,
    seen: tuple[dict[tuple[str, str, int], Alert], dict[tuple[str, str, int], str]],
    argv: list[str] | None,
    quiet: bool,
) -> tuple[RunView, bool]:
    """One check: the run (and baseline) read again, each new alert raised (and what came of
    its W&B alert); whether it ended."""
    raised, wandb_said = seen
    view = find(session, run, records="all", host=host, files=[layout.RUN_CONFIG])
    other = find(session, vs, records="all", strict=False) if vs else None
    evals = stored(session, [n for n in (run, vs) if n]) if rule.is_tau() else None
    if evals is not None:
        evals.warn_errors()
    results = (evals.serves if rule.metric.startswith(SPEEDUP) else evals.results) if evals else []
    for alert in check(rule, view, other, results):
        if alert.key in raised:
            continue
        raised[alert.key] = alert
        if not quiet:
            console().print(f"alert: {run}: {alert.message}")
        if logs_to_wandb(view):
            wandb_said[alert.key] = request(session, view, alert)
            if not quiet:
                console().print(f"  {wandb_said[alert.key]}")
        if argv is not None:
            run_command(argv, facts_env(alert, view, rule, vs))
    return view, view.state in TERMINAL


def run_command(argv: list[str], facts: dict[str, str]) -> None:
    """The user's command with the facts in its environment; a failure is one line."""
    try:
        done = subprocess.run(
            argv,
            env={**os.environ, **facts},
            stdin=subprocess.DEVNULL,
            stdout=sys.stderr.fileno(),
            timeout=ALERT_CMD_TIMEOUT_S,
            check=False,
        )  # fmt: skip (its output beside our notes)
    except subprocess.TimeoutExpired:
        context.note(f"--on-alert: {argv[0]} did not end within {ALERT_CMD_TIMEOUT_S:g} s; killed")
        return
    except OSError as exc:
        context.note(f"--on-alert: {argv[0]}: {exc.strerror or exc}")
        return
    if done.returncode != 0:
        context.note(f"--on-alert: {argv[0]} exited {done.returncode}")
