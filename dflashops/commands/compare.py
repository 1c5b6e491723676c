"""`compare RUN RUN... [--steps 100,500,1000] [--metrics acc,dds8,loss,streak] [--tau] [--plot FILE.png]`

The runs' metrics at the same steps, wherever they live (any target, runs/ or archive/): one
table per metric, runs down, steps across, the best value of each column marked. The value at
step S is the record with the largest step <= S ("@N" marks a record from an earlier step N);
"-" means the run never got to S.

--tau adds the stored evaluations (`eval`, listed by `evals`): tau chain and tau per DDTree
budget at each evaluated step (exactly that checkpoint's; "-": not evaluated), and the speedup
per concurrency of each stored serving benchmark (`eval --serve`: speedup@C); a value measured
with other settings than the first run's at that step is marked with the differing keys
(≠prompts; ?: no fingerprint), and no gap to the first run is computed for it. --plot draws tau
(and the speedup per concurrency) against step below the training metrics whenever the runs
have stored evaluations.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from dflashops import context
from dflashops import plot as plotting
from dflashops.commands import _options
from dflashops.errors import UsageError
from dflashops.metrics import higher_is_better
from dflashops.render import console, metric, styled, table
from dflashops.runs.evaluation.fingerprints import differs, mark
from dflashops.runs.evaluation.results import SPEEDUP, Stored, stored, tau_value
from dflashops.runs.reading.survey import expand, pick
from dflashops.runs.reading.view import VALUE_RULE, RunView, check_name, value_at
from dflashops.runs.watching.status_tables import warn_logs
from dflashops.tables import Col, Grid

DEFAULT_STEP_COUNT = 6
DEFAULT_METRICS = "acc,dds8,loss,streak"


def register(app: typer.Typer) -> None:
    @app.command("compare")
    @context.command
    def compare(
        ctx: typer.Context,
        names: list[str] = typer.Argument(..., metavar="RUN RUN...", help="Runs to compare."),
        steps: str = typer.Option(
            None, "--steps", help="Comma-separated steps (default: a few spread over the runs)."
        ),
        metrics: str = typer.Option(
            None,
            "--metrics",
            help=f"Comma-separated train_log.jsonl keys [default: {DEFAULT_METRICS}].",
        ),
        plot: Path = typer.Option(None, "--plot", metavar="FILE.png", help="Also draw the curves."),
        tau: bool = typer.Option(False, "--tau", help="Add tau rows from stored evaluations."),
        host: str = _options.HOST_OPTION,
        json_out: bool = _options.JSON_OPTION,
    ) -> None:
        """Compare runs' metrics at the same steps, across targets and archives."""
        opts = context.begin(ctx, json_out)
        if plot is not None:
            plotting.check(plot)
        wanted = _options.parse_steps(steps)
        keys = [k.strip() for k in (metrics or DEFAULT_METRICS).split(",") if k.strip()]
        if not keys:
            raise UsageError("--metrics: name at least one key, e.g. acc,dds8,loss,streak")
        for name in names:
            check_name(name)
        session = opts.session()
        found, names = expand(session, list(names), archive=True, records="all")
        if opts.dry_run:
            opts.dry_run_done(runs=names)
            return
        views = pick(session, found, names, host=host)
        warn_logs(views)
        if metrics is not None:
            check_logged(views, keys)
        chosen = wanted or default_steps(views)
        table_doc = values(views, chosen, keys)
        evals = stored(session, list(names)) if tau or plot is not None else Stored()
        evals.warn_errors()
        taus = tau_doc(views, evals) if tau else None
        if opts.json:
            doc = {"rule": VALUE_RULE, "steps": chosen, "metrics": keys, "runs": table_doc}
            opts.emit(doc | ({"tau": taus} if taus is not None else {}))
        else:
            show(views, chosen, keys, table_doc)
            if taus is not None:
                show_tau(taus)
        if plot is not None:
            plotting.draw(views, keys, chosen, plot, evals=evals.results, serves=evals.serves)
            context.note(f"wrote {plot}")


def check_logged(views: list[RunView], keys: list[str]) -> None:
    """A --metrics key that none of the runs logged is refused, naming the keys they have."""
    have = sorted({k for v in views for r in v.records for k in r if k not in ("step", "time")})
    unknown = [k for k in keys if k not in have]
    if unknown:
        runs = ", ".join(v.name for v in views)
        raise UsageError(f"--metrics {','.join(unknown)}: not in the logs of {runs}; they have: "
                         f"{', '.join(have) or 'no metrics'}")  # fmt: skip


def tau_doc(views: list[RunView], evals: Stored) -> dict[str, Any]:
    """The runs' stored taus in compare's shape: {"steps", "metrics", "runs": [{"run",
    "values": {key: {step: {"value", "step", "target", "settings"} or None}}}]}; keys "tau"
    (chain), "ddtreeB" per budget, "ref_tau" (the reference drafter's, where one was evaluated)
    and "speedup@C" per concurrency of the serving results. "settings": the fingerprint keys
    where the result differs from the first run's at that step (the first run's: from its
    first result of the same kind); null when unknown (runs/evaluation/fingerprints.py)."""
    steps = sorted({r["step"] for r in evals.results + evals.serves})
    taus = ["tau", *(f"ddtree{b}" for b in evals.budgets()), "ref_tau"]
    speeds = [f"{SPEEDUP}{c}" for c in evals.concurrencies()]
    rows = [{"run": v.name, "values": {}} for v in views]
    for keys, results in ((taus, evals.results), (speeds, evals.serves)):
        chosen = [newest_by_step([r for r in results if r["run"] == v.name]) for v in views]
        first = next((by[s] for by in chosen[:1] for s in sorted(by)), None)
        for i, by_step in enumerate(chosen):
            for k in keys:
                rows[i]["values"][k] = {
                    str(s): cell(by_step.get(s), k, (chosen[0].get(s) if i else None) or first)
                    for s in steps
                }
    return {"steps": steps, "metrics": taus + speeds, "runs": rows}


def cell(found: dict[str, Any] | None, key: str, base: dict[str, Any] | None) -> dict | None:
    """One stored value as compare --tau shows it; None where the step has none."""
    if found is None or (value := tau_value(found, key)) is None:
        return None
    return {"value": value, "step": found["step"], "target": found["target"],
            "settings": differs(found, base)}  # fmt: skip


def newest_by_step(results: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in sorted(results, key=lambda r: r["mtime"])}


def show_tau(doc: dict[str, Any]) -> None:
    out = console()
    out.print()
    if not doc["steps"]:
        out.print("tau: no stored evaluations of these runs (dflashops eval RUN --steps ...)")
        return
    bold = out.color_system is not None
    for k in doc["metrics"]:
        if any(c is not None for row in doc["runs"] for c in row["values"][k].values()):
            out.print(metric_table(doc["runs"], k, doc["steps"], bold))
            out.print()
    out.print("tau: from stored evaluations of each step's checkpoint (dflashops evals), "
              "speedup@C: of its serving benchmark at concurrency C (eval --serve); "
              "-: not evaluated; ≠KEY: measured with settings that differ from the first run's "
              "(its first result's for the first run) in KEY, ?: settings unknown (no "
              "fingerprint); (+N%) only between equal settings")  # fmt: skip


def default_steps(views: list[RunView]) -> list[int]:
    """A few steps spread over the logged ones, always with the largest."""
    logged = sorted({r["step"] for v in views for r in v.records})
    if len(logged) <= DEFAULT_STEP_COUNT:
        return logged
    k = DEFAULT_STEP_COUNT
    return sorted({logged[round(i * (len(logged) - 1) / (k - 1))] for i in range(k)})


def values(views: list[RunView], steps: list[int], keys: list[str]) -> list[dict[str, Any]]:
    out = []
    for v in views:
        table_of: dict[str, dict[str, Any]] = {k: {} for k in keys}
        for s in steps:
            rec = value_at(v.records, s)
            for k in keys:
                table_of[k][str(s)] = (
                    None
                    if rec is None or rec.get(k) is None
                    else {"value": rec[k], "step": rec["step"]}
                )
        out.append(
            {
                "run": v.name,
                "target": v.target,
                "where": v.where,
                "state": v.state,
                "last_step": v.records[-1]["step"] if v.records else None,
                "values": table_of,
            }
        )
    return out


def show(views: list[RunView], steps: list[int], keys: list[str], doc: list[dict]) -> None:
    out = console()
    bold = out.color_system is not None  # else styles are not shown: the best gets a *
    for v in views:
        where = "archive" if v.where == "archive" else v.state
        last = v.records[-1]["step"] if v.records else "-"
        out.print(f"{v.name}: {v.target} ({where}), last logged step {last}")
    for k in keys:
        out.print()
        out.print(metric_table(doc, k, steps, bold))
    out.print()
    best = "bold: the best" if bold else "*: the best"
    out.print("values at step S are from the last record at or before S (@N: from step N); "
              f"-: the run never reached S; (+N%): against {views[0].name}; {best}")  # fmt: skip


def metric_table(doc: list[dict], key: str, steps: list[int], bold: bool) -> Grid:
    """One metric: runs down, steps across; the last steps stay longest on a narrow terminal."""
    columns = [Col(f"step {s}", priority=i) for i, s in enumerate(steps)]
    if columns:
        columns[-1].keep = True
    grid = table(Col(key, keep=True), *columns, label=key)
    best = best_per_step(doc, key, steps)
    base = doc[0]["values"][key]
    for i, row in enumerate(doc):
        cells = [row["run"]]
        for s in steps:
            cell = row["values"][key][str(s)]
            text = format_cell(cell, key, s, best.get(s), bold)
            cells.append(text + (relative(cell, base[str(s)]) if i else ""))
        grid.add_row(*cells)
    return grid


def best_per_step(doc: list[dict], key: str, steps: list[int]) -> dict[int, float]:
    higher = higher_is_better(key)
    if higher is None or len(doc) < 2:
        return {}
    best = {}
    for s in steps:
        found = [row["values"][key][str(s)] for row in doc]
        nums = [c["value"] for c in found if c is not None and c.get("settings", []) == []]
        if len(nums) >= 2:
            best[s] = max(nums) if higher else min(nums)
    return best


def relative(cell: dict | None, base: dict | None) -> str:
    """' (+12%)': how far a value is from the first run's at the same step; a tau measured
    with other settings than the first run's has none."""
    if cell is None or base is None:
        return ""
    if "settings" in cell and cell["settings"] != []:
        return ""  # measured differently: its mark (format_cell) says how; no gap
    if not base["value"]:
        return ""
    return f" ({100 * (cell['value'] - base['value']) / abs(base['value']):+.0f}%)"


def format_cell(cell: dict | None, key: str, step: int, best: float | None, bold: bool = True):  # noqa: ANN201
    """The cell as rich Text, shown literally; the best in bold, or marked * where bold is not
    shown."""
    if cell is None:
        return styled("-")
    is_best = best is not None and cell["value"] == best
    text = metric(cell["value"], key) + ("*" if is_best and not bold else "")
    if cell["step"] != step:
        text += f" @{cell['step']}"
    if "settings" in cell and cell["settings"] != []:
        text += " " + mark(cell["settings"])
    return styled(text, "bold" if is_best and bold else None)
