"""`evals [RUN|SWEEP] [--json]`: the stored evaluation results, wherever they are.

A sweep's name (`launch NAME --sweep ...`) stands for its runs: their results, with a SWEPT
column (each run's swept KEY=VALUE, as its state.json records them) and, in --json, "sweep":
{"name", "keys", "runs": [{"run", "values"}]}.

Every target's <ws>/evals/RUN/step_N.json (written by `eval`), one row each, grouped by prompt
set (the prompts' sha256 in the result's fingerprint, and their name): run, step, target,
prompts, engine, tau (chain), tau per DDTree budget, the reference drafter's tau (and the gap)
when the job had one, the real loop's rounds as simulated / checked (eval --check-real) when any
result has them, SERVE SPEEDUP (the serving benchmark's speedup per concurrency, `eval --serve`, of the
same run, step and target; a serving result without an eval result is a row of its own, ENGINE
"... serve"), SETTINGS (the fingerprint's keys that differ from the first row's: runs/
settings.py; "?": a result without one) and the date; eval jobs still running are listed below,
and the continuous evals (`eval RUN --every N`): run, job, target, every N, state (running,
ended, stopped, failed), the newest step scored and the step it evaluates or waits for next.
"""

from __future__ import annotations

import datetime
from typing import Any

import typer

from dflashops import context
from dflashops.commands import _options
from dflashops.render import console, metric, table
from dflashops.runs.evaluation.fingerprints import differs, mark, prompt_group
from dflashops.runs.evaluation.results import (
    Stored,
    engine_name,
    gap,
    real_rounds,
    speedups,
    stored,
)
from dflashops.runs.lifecycle import sweep
from dflashops.runs.reading.survey import expand, not_found
from dflashops.runs.reading.view import check_name
from dflashops.ssh.session import Session
from dflashops.tables import Col


def register(app: typer.Typer) -> None:
    @app.command("evals")
    @context.command
    def evals(
        ctx: typer.Context,
        run: str = typer.Argument(
            None, metavar="[RUN|SWEEP]", help="Only this run's results, or a sweep's runs'."
        ),
        json_out: bool = _options.JSON_OPTION,
    ) -> None:
        """List stored eval results: tau, DDTree tau per budget, the reference's, the date."""
        opts = context.begin(ctx, json_out)
        if run is not None:
            check_name(run)
        found = stored(opts.session(), [run] if run else None)
        swept = None
        if run is not None and not opts.dry_run and not found.results + found.jobs + found.follows:
            swept = sweep_members(opts.session(), run)  # a run with none: below
            if swept is not None:
                found = stored(opts.session(), list(swept))
        found.warn_errors()
        if opts.dry_run:
            opts.dry_run_done(run=run)
            return
        found.results = grouped(with_serves(found.results, found.serves))
        doc = {"evals": found.results, "jobs": found.jobs, "follows": found.follows}
        if swept is not None:
            doc["sweep"] = sweep_doc(run, swept)
        opts.answer(doc, lambda: show(found, run, swept))
        raise typer.Exit(found.exit_code())


def sweep_members(session: Session, name: str) -> dict[str, dict[str, Any]] | None:
    """Where `name` is no run but a sweep's: its runs, each with its state.json; None where it is a run; neither: the one not-found error (exit 4; 3 when a target was not
    read)."""
    there, names = expand(session, [name], archive=True, records="none")
    if names != [name]:
        return {v.name: v.status for v in there.runs() if v.name in names}
    if not there.where(name):
        raise not_found(there, [name])
    return None


def sweep_doc(name: str, swept: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """--json's "sweep": its name, its keys (in the sweep's order) and each run's values."""
    return {
        "name": name,
        "keys": sweep.swept_keys(list(swept.values())),
        "runs": [{"run": r, "values": values(s)} for r, s in sorted(swept.items())],
    }


def date(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    moment = datetime.datetime.fromtimestamp(seconds, tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M")


def with_serves(results: list[dict[str, Any]], serves: list[dict[str, Any]]
                ) -> list[dict[str, Any]]:  # fmt: skip
    """Each eval result with the serving result of its run, step and target (`serve`: speedup
    and tokens/s per concurrency); a serving result without an eval result is a row of its own
    (`kind`: "serve", its tau the server's pooled 1 + accepted/drafts)."""
    by = {(s["run"], s["step"], s["target"]): s for s in serves}
    out = []
    for r in results:
        s = by.pop((r["run"], r["step"], r["target"]), None)
        out.append({**r, "serve": s["serve"]} if s else r)
    out += [{**s, "kind": "serve"} for s in by.values()]
    return sorted(out, key=lambda r: (r["run"], r["step"], r["target"]))


def grouped(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The results by prompt set (in order of first appearance), each with "prompt_group" and
    "settings": {"vs": the first row, "differs": keys, or null when unknown}."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        key, label = prompt_group(r)
        groups.setdefault(key, []).append({**r, "prompt_group": {"prompts_sha256": key or None,
                                                                 "label": label}})  # fmt: skip
    out = [r for rows in groups.values() for r in rows]
    if out:
        first = out[0]
        vs = {k: first[k] for k in ("run", "step", "target")}
        for r in out:
            r["settings"] = {"vs": vs, "differs": differs(r, first)}
    return out


def show(found: Stored, run: str | None, swept: dict[str, dict[str, Any]] | None = None) -> None:
    out = console()
    if swept is not None:
        out.print(sweep_line(run or "", swept, found))
    if not found.results:
        whose = f" of sweep {run}'s runs" if swept is not None else f" of {run}" if run else ""
        out.print(f"no stored eval results{whose}")
    else:
        show_grid(found, swept)
    for job in newest_jobs(found.jobs):
        steps = ",".join(str(s) for s in job.get("steps") or [])
        what = f"eval job {job['job']} of {job['run']} (steps {steps}) on {job['target']}"
        if job.get("alive"):
            out.print(f"running: {what}; follow it: dflashops eval {job['run']} --follow "
                      f"--on {job['target']}")  # fmt: skip
        elif job.get("exit_code") != 0:
            code = job.get("exit_code")
            ended = "ended without an exit code" if code is None else f"failed (exit {code})"
            out.print(f"{ended}: {what}; see {job['dir']}/console.log there")
    if found.follows:
        show_follows(found.follows)


def show_follows(follows: list[dict[str, Any]]) -> None:
    """The continuous evals, one row each."""
    grid = table(Col("RUN", keep=True), Col("CONTINUOUS EVAL", keep=True), Col("TARGET", keep=True),
                 "EVERY", Col("STATE", keep=True), "LAST SCORED", "NEXT",
                 title="continuous evals")  # fmt: skip
    for f in follows:
        nxt = "-" if f["next"] is None else str(f["next"])
        last = "-" if f["last_scored"] is None else str(f["last_scored"])
        grid.add_row(f["run"], f["name"], f["target"], str(f["every"]), f["state"], last, nxt)
    console().print(grid)


def sweep_line(name: str, swept: dict[str, dict[str, Any]], found: Stored) -> str:
    """'sweep lrs (optim.lr): 2 runs; not evaluated: lrs-lr1e-3'."""
    keys = ", ".join(sweep.swept_keys(list(swept.values())))
    done = {r["run"] for r in found.results}
    left = [r for r in sorted(swept) if r not in done]
    return (f"sweep {name} ({keys}): {len(swept)} run(s)"
            + (f"; not evaluated: {', '.join(left)}" if left else ""))  # fmt: skip


def values(state: dict[str, Any] | None) -> dict[str, Any]:
    """A run's swept values, from its state.json ({}: a run of no sweep)."""
    return sweep.record(state or {}).get("values") or {}


def swept_cell(state: dict[str, Any] | None) -> str:
    """A run's swept values, 'optim.lr=3e-4 seed=1' ("-": a run of no sweep)."""
    return " ".join(f"{k}={v}" for k, v in values(state).items()) or "-"


def show_grid(found: Stored, swept: dict[str, dict[str, Any]] | None = None) -> None:
    """A table per prompt set, each headed by the set's name, sha256 and size; a SWEPT column
    (each run's swept values) for a sweep's runs."""
    out = console()
    budgets = found.budgets()
    checked = any("check_real" in r for r in found.results)
    served = any("serve" in r for r in found.results)
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in found.results:
        groups.setdefault(r["prompt_group"]["label"], []).append(r)
    for label, rows in groups.items():
        grid = table(
            Col("RUN", keep=True), *([Col("SWEPT", priority=1)] if swept is not None else []),
            Col("STEP", keep=True), Col("TARGET", keep=True), "PROMPTS",
            Col("TAU", keep=True), *(Col(f"DDTREE {b}", priority=1) for b in budgets),
            Col("REF TAU", priority=2), *([Col("REAL ROUNDS", priority=1)] if checked else []),
            *([Col("SERVE SPEEDUP", keep=True)] if served else []),
            Col("ENGINE", priority=2), Col("SETTINGS", keep=True), Col("DATE", priority=0),
            title=f"prompts: {label}",
        )  # fmt: skip
        for r in rows:
            ref = r.get("reference") or {}
            cells = [r["run"], *([swept_cell(swept.get(r["run"]))] if swept is not None else []),
                     str(r["step"]), r["target"], metric(r.get("n_prompts")),
                     metric(r.get("tau"), "streak")]  # fmt: skip
            cells += [metric((r.get("ddtree") or {}).get(b), "streak") for b in budgets]
            cells += [gap(r.get("tau"), ref.get("tau"))]
            cells += [real_rounds(r.get("check_real"))] if checked else []
            cells += [speedups(r)] if served else []
            engine = engine_name(r) + (" serve" if r.get("kind") == "serve" else "")
            cells += [engine, mark(r["settings"]["differs"]) or "="]
            grid.add_row(*cells, date(r.get("mtime")))
        out.print(grid)
    first = found.results[0]
    out.print("tau = mean accepted + 1 per round; REF TAU: the reference drafter's, "
              "(ours - reference)" + ("; SERVE SPEEDUP: tokens/s with the drafter over without, "
              "per concurrency, in the engine's server (eval --serve)" if served else "")
              + ("; REAL ROUNDS: the real loop's rounds as simulated / "
              "rounds run (eval --check-real)" if checked else "") + f"; SETTINGS: against "
              f"{first['run']} step {first['step']} on {first['target']} (=: the same; "
              "≠KEY: measured differently; ?: no fingerprint)")  # fmt: skip


def newest_jobs(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The newest job of each run on each target."""
    newest: dict[tuple[str, str], dict[str, Any]] = {}
    for job in sorted(jobs, key=lambda j: j.get("launched") or 0):
        newest[(job["run"], job["target"])] = job
    return list(newest.values())
