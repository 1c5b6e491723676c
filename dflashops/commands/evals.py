"""`evals [RUN] [--json]`: the stored evaluation results, wherever they are.

Every target's <ws>/evals/RUN/step_N.json (written by `eval`), one row each: run, step, target,
prompts, tau (chain), tau per DDTree budget, the reference drafter's tau (and the gap) when the
job had one, the real loop's rounds as simulated / checked (eval --check-real) when any result
has them, and the date; eval jobs still running are listed below.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field
from typing import Any

import typer

from dflashops import context, runs
from dflashops.errors import ExitCode, OpsError
from dflashops.remote import argv as helper_argv
from dflashops.render import console, metric, table
from dflashops.session import Session
from dflashops.tables import Col


@dataclass
class Stored:
    """What every target holds: results (newest file of a run and step per target), jobs."""

    results: list[dict[str, Any]] = field(default_factory=list)
    jobs: list[dict[str, Any]] = field(default_factory=list)
    errors: dict[str, OpsError] = field(default_factory=dict)

    def warn_errors(self) -> None:
        for target, err in self.errors.items():
            context.note(f"{target}: not read: {err.message}")

    def exit_code(self) -> int:
        """As `status`'s: 3 when a target could not be reached, 1 for another failure."""
        if any(e.code == ExitCode.UNREACHABLE for e in self.errors.values()):
            return int(ExitCode.UNREACHABLE)
        return int(ExitCode.FAILED) if self.errors else 0

    def budgets(self) -> list[str]:
        found = {b for r in self.results for b in (r.get("ddtree") or {})}
        return sorted(found, key=int)

    def of(self, run: str) -> list[dict[str, Any]]:
        return [r for r in self.results if r["run"] == run]


def stored(session: Session, names: list[str] | None = None) -> Stored:
    """The eval results and jobs of `names` (None: every run) on every target, in parallel."""
    targets = list(session.inventory.targets.values())

    def read(target: Any) -> dict[str, Any]:
        machine = session.machine(target)
        request = json.dumps({"ws": target.workspace, "runs": names}).encode()
        result = machine.run(helper_argv("evals_probe.py"), stdin=request)
        if machine.dry_run:
            return {"results": [], "jobs": []}
        if not result.ok:
            raise OpsError(f"{target.name}: could not read its evals: {result.error_text}")
        return json.loads(result.stdout)

    out = Stored()
    for target, answer in zip(targets, session.each(read, targets), strict=True):
        if isinstance(answer, OpsError):
            out.errors[target.name] = answer
            continue
        for item in answer["results"] + answer["jobs"]:
            item["target"] = target.name
        out.results += answer["results"]
        out.jobs += answer["jobs"]
    out.results.sort(key=lambda r: (r["run"], r["step"], r["target"]))
    return out


def tau_value(result: dict[str, Any], key: str) -> float | None:
    """A result's "tau" (chain), "ddtreeB" (DDTree budget B) or "ref_tau" (the reference's)."""
    if key == "tau":
        return result.get("tau")
    if key == "ref_tau":
        return (result.get("reference") or {}).get("tau")
    return (result.get("ddtree") or {}).get(key.removeprefix("ddtree"))


def register(app: typer.Typer) -> None:
    @app.command("evals")
    @context.command
    def evals(
        ctx: typer.Context,
        run: str = typer.Argument(None, metavar="[RUN]", help="Only this run's results."),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON document."),
    ) -> None:
        """List stored eval results: tau, DDTree tau per budget, the reference's, the date."""
        opts = context.get(ctx)
        as_json = opts.want_json(json_out)
        if run is not None:
            runs.check_name(run)
        found = stored(opts.session(), [run] if run else None)
        if run is not None and not opts.dry_run and not found.results + found.jobs:
            there = runs.survey(opts.session(), names=[run], archive=True, records="none")
            if not there.where(run):  # no such run: the one wording (a run with none: below)
                raise runs.not_found(there, [run])
        found.warn_errors()
        if opts.dry_run:
            runs.dry_run_done(opts, run=run)
            return
        if as_json:
            opts.emit({"evals": found.results, "jobs": found.jobs})
        else:
            show(found, run)
        raise typer.Exit(found.exit_code())


def date(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    moment = datetime.datetime.fromtimestamp(seconds, tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M")


def gap(ours: float | None, ref: float | None) -> str:
    """'12.4 (-9.4)': the reference's tau, and ours minus it."""
    if ref is None:
        return "-"
    return metric(ref, "streak") + ("" if ours is None else f" ({ours - ref:+.2f})")


def real_rounds(check: dict[str, Any] | None) -> str:
    """'38/40': of the rounds the real loop ran (--check-real), those as simulated."""
    if not check:
        return "-"
    return f"{check.get('rounds_equal', '?')}/{check.get('rounds_checked', '?')}"


def show(found: Stored, run: str | None) -> None:
    out = console()
    if not found.results:
        out.print(f"no stored eval results{f' of {run}' if run else ''}")
    else:
        budgets = found.budgets()
        checked = any("check_real" in r for r in found.results)
        grid = table(
            Col("RUN", keep=True), Col("STEP", keep=True), Col("TARGET", keep=True), "PROMPTS",
            Col("TAU", keep=True), *(Col(f"DDTREE {b}", priority=1) for b in budgets),
            Col("REF TAU", priority=2), *([Col("REAL ROUNDS", priority=1)] if checked else []),
            Col("DATE", priority=0),
        )  # fmt: skip
        for r in found.results:
            ref = r.get("reference") or {}
            cells = [r["run"], str(r["step"]), r["target"], metric(r.get("n_prompts")),
                     metric(r.get("tau"), "streak")]  # fmt: skip
            cells += [metric((r.get("ddtree") or {}).get(b), "streak") for b in budgets]
            cells += [gap(r.get("tau"), ref.get("tau"))]
            cells += [real_rounds(r.get("check_real"))] if checked else []
            grid.add_row(*cells, date(r.get("mtime")))
        out.print(grid)
        out.print("tau = mean accepted + 1 per round; REF TAU: the reference drafter's, "
                  "(ours - reference)" + ("; REAL ROUNDS: the real loop's rounds as simulated / "
                  "rounds run (eval --check-real)" if checked else ""))  # fmt: skip
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


def newest_jobs(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The newest job of each run on each target."""
    newest: dict[tuple[str, str], dict[str, Any]] = {}
    for job in sorted(jobs, key=lambda j: j.get("launched") or 0):
        newest[(job["run"], job["target"])] = job
    return list(newest.values())
