"""Finding runs across the inventory: every target probed in parallel (one call each), the
run of a name wherever it lives (runs/ or archive/ of any target), the newest running run,
and one run read again from its nodes."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from dflashops import context
from dflashops.errors import ExitCode, NotFoundError, OpsError, UnreachableError, UsageError
from dflashops.inventory import Target
from dflashops.runs.lifecycle import kinds, sweep
from dflashops.runs.reading.probe import Probe, probe
from dflashops.runs.reading.view import RunView, check_name, combine, group
from dflashops.ssh.session import Session
from dflashops.targets.base import Machine
from dflashops.yamlfile import did_you_mean


class Unread:
    """What came back from several targets, with `errors` of those that could not be read."""

    errors: dict[str, OpsError]

    def warn_errors(self) -> None:
        for target, err in self.errors.items():
            context.note(f"{target}: not read: {err.message}")

    def exit_code(self) -> int:
        """As `status`'s: 3 when a target could not be reached, 1 for another failure."""
        if any(e.code == ExitCode.UNREACHABLE for e in self.errors.values()):
            return int(ExitCode.UNREACHABLE)
        return int(ExitCode.FAILED) if self.errors else 0


@dataclass
class Survey(Unread):
    probes: dict[str, Probe]
    errors: dict[str, OpsError]

    def runs(self) -> list[RunView]:
        return group([r for p in self.probes.values() for r in p.runs])

    def all_names(self) -> list[str]:
        """The names of the jobs of the kinds `status` lists (runs, archived runs, ...)."""
        return sorted({n for p in self.probes.values() for n in kinds.listed_names(p.names)})

    def where(self, run: str) -> list[tuple[str, str]]:
        """(target, its kind's home or 'archive') for every place a job of that name lives."""
        found = [(t, p.has(run)) for t, p in self.probes.items()]
        return [(t, w) for t, w in found if w]

    def places(self, run: str) -> str:
        """'ct200:runs/a, ct201:archive/a': where a job of that name lives."""
        return ", ".join(f"{t}:{kinds.by_where(w).rel(w, run)}" for t, w in self.where(run))


def survey(session: Session, targets: Iterable[Target] | None = None, **request: Any) -> Survey:
    """Probe every target (default: the whole inventory) in parallel."""
    chosen = list(targets if targets is not None else session.inventory.targets.values())
    answers = session.each(lambda t: probe(session.machine(t), **request), chosen)
    probes, errors = {}, {}
    for target, answer in zip(chosen, answers, strict=True):
        if isinstance(answer, OpsError):
            errors[target.name] = answer
        else:
            probes[target.name] = answer
    return Survey(probes, errors)


def find(
    session: Session, name: str, *, host: str | None = None, strict: bool = True, **request: Any
) -> RunView:
    """The run called `name`, wherever it lives (runs/ or archive/ of any target); `host`
    picks one where the name exists on several targets (see `choose`)."""
    check_name(name)
    found = survey(session, names=[name], archive=True, **request)
    return choose(session, found, name, host, strict=strict)


def choose(
    session: Session, found: Survey, name: str, host: str | None, *, strict: bool = True
) -> RunView:
    """The one run called `name` in a survey. `host` picks the run on that target where the
    name exists on several; `strict`, it must be there even where the name exists once (else
    a run named once is taken wherever it is: `compare a b --host X` where only `a` is
    twice)."""
    matches = [r for r in found.runs() if r.name == name]
    if host is not None:
        session.inventory.target(host)  # a name that is no target: one line, exit 4
        if strict or len(matches) > 1:
            matches = [r for r in matches if host in r.node_targets]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        places = ", ".join(f"{r.target}:{place(r)}" for r in matches)
        raise UsageError(
            f"run {name!r} exists in more than one place ({places}); pick one with --host TARGET"
        )
    if host is not None and found.where(name):
        raise NotFoundError(f"no run {name!r} on {host} (it is at {found.places(name)})")
    raise not_found(found, [name])


def pick(
    session: Session, found: Survey, names: list[str], *, host: str | None = None
) -> list[RunView]:
    """The named runs from a survey, in the order given (a name given twice once); `host`
    picks among the places of a name that exists on several targets."""
    known = {view.name for view in found.runs()}
    missing = [n for n in dict.fromkeys(names) if n not in known]
    if missing:
        raise not_found(found, missing)
    return [choose(session, found, n, host, strict=False) for n in dict.fromkeys(names)]


LISTED_RUNS = 12


def not_found(found: Survey, missing: list[str]) -> OpsError:
    """The one error for runs that are not there, naming the runs that are: exit 4, or exit 3
    when a target could not be read (the run may live there). The same words for every verb,
    those that take a sweep's name too."""
    known = found.all_names()
    quoted = ", ".join(repr(n) for n in missing)
    hint = did_you_mean(missing[0], known) if len(missing) == 1 else ""
    shown = ", ".join(known[:LISTED_RUNS]) + (" ..." if len(known) > LISTED_RUNS else "")
    listed = f" (runs: {shown})" if known else " (no runs there)"
    message = f"no run {quoted} on the targets read{hint}{listed}"
    if found.errors:
        unread = ", ".join(f"{t} ({e.message})" for t, e in found.errors.items())
        return UnreachableError(f"{message}; not read: {unread}")
    return NotFoundError(message)


def place(view: RunView) -> str:
    """A job's directory under its target's workspace: 'runs/a', 'evals/a/jobs/ID'."""
    return kinds.by_where(view.where).rel(view.where, view.name)


def newest_running(session: Session, *, host: str | None = None, **request: Any) -> RunView:
    """The newest running run (of those on `host`, when given)."""
    if host is not None:
        session.inventory.target(host)
    found = survey(session, **request)
    running = [r for r in found.runs() if r.running and host in (None, *r.node_targets)]
    if not running:
        found.warn_errors()
        where = f" on {host}" if host is not None else ""
        raise NotFoundError(
            f"no run is running{where}; name one (`dflashops status --all` lists them)"
        )
    newest = max(running, key=lambda r: r.started or 0)
    context.note(f"(run {newest.name} on {newest.target}: the newest running run)")
    return newest


def resolve(
    session: Session, name: str | None, *, host: str | None = None, **request: Any
) -> RunView:
    """A named run, or the newest running one when no name is given (on `host`, if given)."""
    if name:
        return find(session, name, host=host, **request)
    return newest_running(session, host=host, **request)


def sweep_runs(found: Survey, name: str) -> list[str]:
    """The runs of sweep `name` (their state.json's "sweep"), by name."""
    return sorted({v.name for v in found.runs() if sweep.record(v.status).get("name") == name})


def expand(session: Session, names: list[str], **request: Any) -> tuple[Survey, list[str]]:
    """The survey of `names` (as `survey(names=...)`), where a name that is no run but a
    sweep's stands for the sweep's runs; (the survey, the names with sweeps expanded)."""
    found = survey(session, names=list(names), **request)
    missing = [n for n in names if not found.where(n)]
    if not missing:
        return found, list(names)
    every = survey(session, archive=request.get("archive", False), records="none")
    out: list[str] = []
    for name in names:
        out += (sweep_runs(every, name) if name in missing else []) or [name]
    out = list(dict.fromkeys(out))
    if out == list(names):
        return found, out
    return survey(session, names=out, **request), out


def reread(machine: Machine, run: str, **request: Any) -> RunView:
    """Run `run` read (again) from the machine it lives on, in runs/ or archive/."""
    answer = probe(machine, names=[run], archive=True, **request)
    fresh = next((r for r in answer.runs if r.name == run), None)
    if fresh is None:
        raise NotFoundError(f"{machine.name}: run {run} is gone")
    return fresh


def refresh(session: Session, view: RunView, **request: Any) -> RunView:
    """`view` read again: from its target, or from every node of a run over several (in
    parallel; a node that cannot be read is noted, node 0's error is raised)."""
    if not view.multi:
        return reread(session.machine(view.target), view.name, **request)
    targets = [session.inventory.target(t) for t in view.node_targets]
    answers = session.each(lambda t: reread(session.machine(t), view.name, **request), targets)
    if isinstance(answers[0], BaseException):
        raise answers[0]
    nodes = [a for a in answers if isinstance(a, RunView) and a.run_id == view.run_id]
    return combine(nodes)
