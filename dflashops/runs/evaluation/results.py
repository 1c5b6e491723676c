"""The stored evaluations on every target: <ws>/evals/RUN/step_N.json (written by `eval`), the
eval jobs (<ws>/evals/RUN/jobs/ID/) and the continuous evals (<ws>/evals/RUN/follow/ID/), read by
`evals`, `eval` and `compare`, and the values of a result (tau, DDTree tau per budget, the
reference's, the gap).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from dflashops.errors import OpsError
from dflashops.remote import argv as helper_argv
from dflashops.render import metric
from dflashops.runs.evaluation.continuous_kind import FOLLOW
from dflashops.runs.reading.survey import Unread
from dflashops.runs.reading.view import RunView
from dflashops.runs.training.kind import TRAINING
from dflashops.ssh.session import Session
from dflashops.targets.base import Machine

SPEEDUP = "speedup@"  # a serving result's metric: speedup@16


@dataclass
class Stored(Unread):
    """What every target holds: results (newest file of a run and step per target), jobs,
    continuous evals (`follows`: each as `follower_row` makes it)."""

    results: list[dict[str, Any]] = field(default_factory=list)
    jobs: list[dict[str, Any]] = field(default_factory=list)
    follows: list[dict[str, Any]] = field(default_factory=list)
    serves: list[dict[str, Any]] = field(default_factory=list)  # eval --serve's results
    errors: dict[str, OpsError] = field(default_factory=dict)

    def budgets(self) -> list[str]:
        found = {b for r in self.results for b in (r.get("ddtree") or {})}
        return sorted(found, key=int)

    def concurrencies(self) -> list[str]:
        found = {c for r in self.serves for c in (r.get("serve") or {})}
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
        serves = answer.get("serves") or []
        for item in answer["results"] + answer["jobs"] + serves:
            item["target"] = target.name
        out.results += answer["results"]
        out.serves += serves
        out.jobs += answer["jobs"]
        out.follows += [follower_row(j, target.name) for j in answer.get("follows") or []]
    out.results.sort(key=lambda r: (r["run"], r["step"], r["target"]))
    out.follows.sort(key=lambda f: (f["run"], f.get("launched") or 0))
    return out


def follower_row(job: dict[str, Any], target: str) -> dict[str, Any]:
    """A continuous eval as `evals` shows it: its state (running, ended: its run ended and
    every checkpoint is scored, stopped, failed), the newest step it scored and, while it runs,
    the step it evaluates or waits for."""
    status, done = job.get("status"), sorted(job.get("done") or [])
    if job.get("alive"):
        state = "running"
    else:
        state = {"finished": "ended", "stopped": "stopped"}.get(status or "", "failed")
    nxt = job.get("next") if state == "running" else None
    return {
        "name": f"follow-{job['run']}-{job['job']}", "run": job["run"], "target": target,
        "every": job.get("every"), "state": state, "last_scored": done[-1] if done else None,
        "next": nxt if isinstance(nxt, int) else None, "done": done, "from": job.get("from"),
        "dir": job.get("dir"), "launched": job.get("launched"),
    }  # fmt: skip


def tau_value(result: dict[str, Any], key: str) -> float | None:
    """A result's "tau" (chain), "ddtreeB" (DDTree budget B), "ref_tau" (the reference's) or,
    of a serving result, "speedup@C" (at concurrency C)."""
    if key.startswith(SPEEDUP):
        entry = (result.get("serve") or {}).get(key.removeprefix(SPEEDUP)) or {}
        return entry.get("speedup")
    if key == "tau":
        return result.get("tau")
    if key == "ref_tau":
        return (result.get("reference") or {}).get("tau")
    return (result.get("ddtree") or {}).get(key.removeprefix("ddtree"))


def speedups(result: dict[str, Any]) -> str:
    """'1.08/1.73/0.56x @1,4,16': a serving result's speedup per concurrency."""
    serve = result.get("serve") or {}
    levels = sorted(serve, key=int)
    if not levels:
        return "-"
    values = [serve[c].get("speedup") for c in levels]
    text = "/".join("-" if v is None else f"{v:.2f}" for v in values)
    return f"{text}x @{','.join(levels)}"


def gap(ours: float | None, ref: float | None) -> str:
    """'12.4 (-9.4)': the reference's tau, and ours minus it."""
    if ref is None:
        return "-"
    return metric(ref, "streak") + ("" if ours is None else f" ({ours - ref:+.2f})")


def engine_name(result: dict[str, Any]) -> str:
    """'sim', 'vllm 0.32.0', or '-' for a result that does not say (before engines)."""
    engine = result.get("engine") if isinstance(result.get("engine"), dict) else {}
    name = engine.get("name")
    if name is None:
        return "-"
    return f"{name} {engine['version']}" if engine.get("version") and name != "sim" else name


def engine_note(result: dict[str, Any]) -> str | None:
    """What the serving engine said beside its tau (eval --engine vllm); None for sim."""
    if (result.get("engine") or {}).get("name") != "vllm":
        return None
    rates, sim = result.get("tokens_per_s") or {}, result.get("simulation") or {}
    greedy, speedup = result.get("greedy") or {}, result.get("speedup")
    first = sim.get("first_difference")
    where = "" if not first else f" (first difference: prompt {first.get('where')}, round "
    where += f"{first.get('round')})" if first else ""
    return (
        f"{engine_name(result)}: tau from its per-step accepted counts; its own pooled mean "
        f"acceptance length {metric(result.get('engine_mean_acceptance_length'), 'streak')}; "
        f"simulated tau {metric(sim.get('tau'), 'streak')}, rounds as simulated on "
        f"{sim.get('prompts_identical', '?')}/{sim.get('prompts', '?')} prompts{where}; output "
        f"equals greedy on {greedy.get('equal', '?')}/{greedy.get('prompts', '?')}; tokens/s "
        f"{metric(rates.get('spec'), 'tok_s')} against {metric(rates.get('plain'), 'tok_s')} "
        f"plain ({'-' if speedup is None else f'{speedup:.2f}x'})"
    )


def real_rounds(check: dict[str, Any] | None) -> str:
    """'38/40': of the rounds the real loop ran (--check-real), those as simulated."""
    if not check:
        return "-"
    return f"{check.get('rounds_equal', '?')}/{check.get('rounds_checked', '?')}"


def latest_eval(session: Session, view: RunView) -> dict[str, Any] | None:
    """For `status RUN`: its newest evaluated step's tau (on any target) and its continuous
    evals still going; None for a job that is not a training run, or nothing evaluated."""
    if view.where not in (TRAINING.home, TRAINING.archive):
        return None
    machines = list(session.inventory.targets.values())
    answers = session.each(lambda t: evals_doc(session.machine(t), view.name), machines)
    docs = [a for a in answers if isinstance(a, dict)]
    found = [(r, t) for d, t in zip(answers, machines, strict=True) if isinstance(d, dict)
             for r in d["results"]]  # fmt: skip
    going = [f"{FOLLOW.template.format(view.name, j['job'])} on {t.name}"
             for d, t in zip(answers, machines, strict=True) if isinstance(d, dict)
             for j in d.get("follows") or [] if j.get("alive")]  # fmt: skip
    if not docs or not (found or going):
        return None
    out: dict[str, Any] = {"results": len(found), "following": going}
    if found:
        newest, where = max(found, key=lambda rt: (rt[0]["step"], rt[0].get("mtime") or 0))
        out.update(step=newest["step"], tau=newest.get("tau"), target=where.name)
    return out


def evals_doc(machine: Machine, run: str) -> dict[str, Any] | None:
    """The stored results and eval jobs of `run` in `machine` (remote/evals_probe.py); None
    when it could not be read."""
    request = json.dumps({"ws": machine.target.workspace, "runs": [run]}).encode()
    result = machine.run(helper_argv("evals_probe.py"), stdin=request)
    if machine.dry_run or not result.ok:
        return None
    return json.loads(result.stdout)
