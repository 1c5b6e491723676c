"""Alarm rules on a run, checked by `watch` (commands/watch.py) on each poll.

- margin: at the run's newest milestone that the baseline also has (a step both logged, for a
  train_log metric; a step both evaluated with equal settings, for tau), the run's value minus
  the baseline's, in the metric's better direction, is at most MARGIN: it is not ahead of the
  baseline by more than MARGIN (a negative MARGIN: it is behind by more than -MARGIN).
- stall: the run's best over its last K values (evaluations for tau, log records otherwise) is
  not above its best before them: it has not risen over the last K.

An alert names its rule, metric and step; `watch` raises each one once. Its facts go to the
user's command as DFLASHOPS_ALERT_* environment variables (`facts_env`), never into a shell.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflashops.metrics import higher_is_better
from dflashops.runs.evaluation.fingerprints import differs
from dflashops.runs.evaluation.results import SPEEDUP, tau_value
from dflashops.runs.reading.view import RunView

TAU_KEYS = ("tau",)  # read from stored evaluations; ddtreeB too


@dataclass(frozen=True)
class Rule:
    metric: str
    margin: float | None = None  # needs a baseline
    stall: int | None = None  # K

    def is_tau(self) -> bool:
        return self.metric in TAU_KEYS or self.metric.startswith(("ddtree", SPEEDUP))

    def sign(self) -> float:
        return -1.0 if higher_is_better(self.metric) is False else 1.0


@dataclass(frozen=True)
class Alert:
    rule: str  # "margin" or "stall"
    metric: str
    step: int
    value: float
    message: str
    baseline_value: float | None = None

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.rule, self.metric, self.step)


Series = list[tuple[int, float, dict[str, Any] | None]]  # (step, value, the eval result)


def series(view: RunView, evals: list[dict[str, Any]], rule: Rule) -> Series:
    """The run's values of the rule's metric by step: stored evaluations (the newest of a
    step) for tau, its log records otherwise."""
    if not rule.is_tau():
        return [(r["step"], float(r[rule.metric]), None) for r in view.records
                if isinstance(r.get(rule.metric), (int, float))]  # fmt: skip
    by_step: dict[int, dict[str, Any]] = {}
    for r in sorted((r for r in evals if r["run"] == view.name), key=lambda r: r.get("mtime", 0)):
        by_step[r["step"]] = r
    out = []
    for step in sorted(by_step):
        value = tau_value(by_step[step], rule.metric)
        if isinstance(value, (int, float)):
            out.append((step, float(value), by_step[step]))
    return out


def check_margin(rule: Rule, run: Series, base: Series, baseline: str) -> Alert | None:
    """The margin rule at the newest milestone both have (tau: with equal settings)."""
    theirs = {s: (v, r) for s, v, r in base}
    for step, value, result in reversed(run):
        if step not in theirs:
            continue
        other, other_result = theirs[step]
        if rule.is_tau() and differs(result, other_result) != []:
            continue  # measured differently: not a milestone to compare
        lead = (value - other) * rule.sign()
        if lead > float(rule.margin or 0.0):
            return None
        return Alert("margin", rule.metric, step, value,
                     f"{rule.metric} {value:.4g} at step {step} is within {rule.margin:g} of "
                     f"{baseline}'s {other:.4g} (lead {lead:+.4g})", other)  # fmt: skip
    return None


def check_stall(rule: Rule, run: Series) -> Alert | None:
    """The stall rule: no new best over the last K values (tau: of equal settings)."""
    k = int(rule.stall or 0)
    if rule.is_tau() and run:
        run = [x for x in run if differs(x[2], run[-1][2]) == []]
    if k < 1 or len(run) < k + 1:
        return None
    values = [v * rule.sign() for _, v, _ in run]
    before, last = max(values[:-k]), max(values[-k:])
    if last > before:
        return None
    step, value, _ = run[-1]
    return Alert("stall", rule.metric, step, value,
                 f"{rule.metric} has not risen over the last {k} values (best before "
                 f"{before * rule.sign():.4g}, since {last * rule.sign():.4g}; step {step})")  # fmt: skip


def check(
    rule: Rule,
    view: RunView,
    other: RunView | None,
    evals: list[dict[str, Any]],
) -> list[Alert]:
    """Every rule's alert as of now."""
    mine = series(view, evals, rule)
    found = []
    if rule.margin is not None and other is not None:
        found.append(check_margin(rule, mine, series(other, evals, rule), other.name))
    if rule.stall is not None:
        found.append(check_stall(rule, mine))
    return [a for a in found if a is not None]


def facts_env(alert: Alert, view: RunView, rule: Rule, baseline: str | None) -> dict[str, str]:
    """The alert's facts as environment variables for the user's command."""
    facts = {
        "RUN": view.name,
        "TARGET": view.target,
        "RULE": alert.rule,
        "METRIC": alert.metric,
        "STEP": str(alert.step),
        "VALUE": repr(alert.value),
        "MESSAGE": alert.message,
        "BASELINE": baseline or "",
        "BASELINE_VALUE": "" if alert.baseline_value is None else repr(alert.baseline_value),
        "MARGIN": "" if rule.margin is None else repr(rule.margin),
        "STALL": "" if rule.stall is None else str(rule.stall),
        "WANDB_URL": str(view.status.get("wandb_url") or ""),
    }
    # a NUL (from a hostile state.json) cannot be in an environment variable: shown as \0
    return {f"DFLASHOPS_ALERT_{k}": v.replace("\0", "\\0") for k, v in facts.items()}
