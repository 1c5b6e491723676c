"""Where runs live in a target, what state they are in, and finding them across the inventory.

Every read is one call per target (`remote/runs_probe.py` run with the target's python3,
returning JSON), and targets are probed in parallel.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from dflashops import context
from dflashops.errors import ExitCode, NotFoundError, OpsError, UnreachableError, UsageError
from dflashops.inventory import NAME_RE, Target
from dflashops.remote import argv as helper_argv
from dflashops.session import Session
from dflashops.targets.base import Machine
from dflashops.yamlfile import did_you_mean

TERMINAL = ("finished", "failed", "stopped", "archived")
METRICS = ("loss", "acc", "streak", "dds8")


def check_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise UsageError(
            f"run name {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )
    return name


def tmux_session(run: str) -> str:
    """dflash-RUN; tmux itself turns a '.' of a session name into '_'."""
    return "dflash-" + run.replace(".", "_")


def run_dir(target: Target, run: str, where: str = "runs") -> str:
    return posixpath.join(target.workspace, where, run)


def ckpt_copy_dir(target: Target, run: str, step: int) -> str:
    """Where `pull-ckpt` puts a checkpoint on an eval target."""
    return posixpath.join(target.workspace, "ckpts", run, f"step_{step}")


def eval_result_path(target: Target, run: str, step: int) -> str:
    return posixpath.join(target.workspace, "evals", run, f"step_{step}.json")


@dataclass
class Checkpoint:
    step: int
    name: str
    complete: bool
    temporary: bool
    bytes: int
    files: int
    mtime: float
    manifest: str | None = None
    entries: dict[str, str] | None = None  # the manifest parsed; None when it is malformed
    verified: bool | None = None
    problem: str | None = None


@dataclass
class RunView:
    """One run as read from its target."""

    name: str
    target: str
    where: str  # "runs" or "archive"
    dir: str
    state: str  # starting | running | finished | stopped | failed | archived | unknown
    now: float  # the target's clock when it was read
    raw: dict[str, Any] = field(default_factory=dict)
    note: str | None = None

    @property
    def status(self) -> dict[str, Any]:
        return self.raw.get("state") or {}

    @property
    def log(self) -> dict[str, Any]:
        return self.raw.get("log") or {}

    @property
    def last(self) -> dict[str, Any] | None:
        return self.log.get("last")

    @property
    def records(self) -> list[dict[str, Any]]:
        return self.log.get("records") or []

    @property
    def warnings(self) -> list[str]:
        return self.log.get("warnings") or []

    @property
    def step(self) -> int | None:
        return self.last["step"] if self.last else self.status.get("last_step")

    @property
    def total_steps(self) -> int | None:
        total = self.status.get("total_steps")
        return total if total is not None else (self.raw.get("console") or {}).get("total_steps")

    @property
    def running(self) -> bool:
        return self.state in ("starting", "running")

    @property
    def started(self) -> float | None:
        return self.status.get("started") or self.status.get("launched")

    @property
    def exit_code(self) -> int | None:
        code = self.status.get("exit_code")
        return code if code is not None else self.raw.get("exit_file")

    @property
    def checkpoints(self) -> list[Checkpoint]:
        return [Checkpoint(**c) for c in self.raw.get("checkpoints") or []]

    def complete_steps(self) -> list[int]:
        return [c.step for c in self.checkpoints if c.complete]

    @property
    def age(self) -> float | None:
        """Seconds since the last log line (or console output) on the target's clock."""
        if self.last and isinstance(self.last.get("time"), (int, float)):
            return max(0.0, self.now - self.last["time"])
        console = self.raw.get("console")
        return max(0.0, self.now - console["mtime"]) if console else None

    def seconds_per_step(self) -> float | None:
        since = self.status.get("started") or 0  # a resumed run's older lines paused
        recs = [r for r in self.records if isinstance(r.get("time"), (int, float))]
        recs = [r for r in recs if r["time"] >= since]
        if len(recs) < 2:
            return None
        a, b = recs[max(0, len(recs) - 11)], recs[-1]
        if b["step"] <= a["step"] or b["time"] <= a["time"]:
            return None
        return (b["time"] - a["time"]) / (b["step"] - a["step"])

    @property
    def eta(self) -> float | None:
        sps, total, step = self.seconds_per_step(), self.total_steps, self.step
        if not self.running or sps is None or total is None or step is None:
            return None
        return max(0.0, (total - step) * sps)

    def summary(self) -> dict[str, Any]:
        """The JSON form of a status row."""
        last = self.last or {}
        return {
            "run": self.name,
            "target": self.target,
            "dir": self.dir,
            "state": self.state,
            "note": self.note,
            "step": self.step,
            "total_steps": self.total_steps,
            "metrics": {k: v for k, v in last.items() if k not in ("step", "time")},
            "eta_s": _round(self.eta),
            "last_log_age_s": _round(self.age),
            "started": self.started,
            "finished": self.status.get("finished"),
            "exit_code": self.exit_code,
            "pid": self.status.get("pid"),
            "tmux": tmux_session(self.name) if self.raw.get("tmux") else None,
            "wandb_url": self.status.get("wandb_url"),
            "warnings": self.warnings,
        }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def derive_state(raw: dict[str, Any]) -> tuple[str, str | None]:
    """(state, note) from what the probe saw: state.json, exit code, tmux and the trainer's pid."""
    if raw.get("where") == "archive":
        return "archived", None
    st = raw.get("state") or {}
    status = st.get("status")
    code = st.get("exit_code")
    if code is None:
        code = raw.get("exit_file")
    alive = bool(raw.get("tmux")) or bool(raw.get("pid_alive"))
    if alive:
        if status in ("finished", "stopped"):
            return status, None
        return ("running" if status == "running" else "starting"), None
    if status in ("finished", "stopped") and code in (0, None):
        return status, None
    if code not in (None, 0):
        return "failed", f"exit code {code}"
    if status == "failed":
        return "failed", None
    if status in ("running", "starting", "launching"):
        if code == 0:
            return "failed", "exit code 0, but the trainer never said it finished"
        return "failed", "the trainer is gone without recording an exit code"
    return "unknown", "no state.json"


@dataclass
class Probe:
    """One target's answer."""

    names: dict[str, list[str]]
    runs: list[RunView]
    dirs: dict[str, dict[str, Any]]
    paths: dict[str, str]

    def has(self, run: str) -> str | None:
        """'runs' or 'archive' when a run of that name lives here."""
        return next((w for w in ("runs", "archive") if run in self.names.get(w, [])), None)


def probe(machine: Machine, **request: Any) -> Probe:
    """Run the probe once in `machine` (see remote/runs_probe.py for the request's keys)."""
    target = machine.target
    request = {"ws": target.workspace, **request}
    argv = helper_argv("runs_probe.py")
    result = machine.run(argv, stdin=json.dumps(request).encode())
    if machine.dry_run:
        return Probe({"runs": [], "archive": []}, [], {}, {})
    if result.returncode == 127:
        raise OpsError(f"{target.name}: python3 not found; install it in the target")
    if not result.ok:
        raise OpsError(f"{target.name}: could not read its runs: {result.error_text}")
    try:
        doc = json.loads(result.stdout)
    except ValueError:
        raise OpsError(f"{target.name}: the run probe printed something that is not JSON") from None
    views = []
    for raw in doc["runs"]:
        if "error" in raw:
            context.note(f"{target.name}: {raw['where']}/{raw['name']}: {raw['error']}")
            continue
        state, note = derive_state(raw)
        views.append(
            RunView(
                raw["name"], target.name, raw["where"], raw["dir"], state, doc["now"], raw, note
            )
        )
    return Probe(doc["names"], views, doc["dirs"], doc["paths"])


@dataclass
class Survey:
    probes: dict[str, Probe]
    errors: dict[str, OpsError]

    def runs(self) -> list[RunView]:
        return [r for p in self.probes.values() for r in p.runs]

    def all_names(self) -> list[str]:
        return sorted({n for p in self.probes.values() for w in p.names.values() for n in w})

    def where(self, run: str) -> list[tuple[str, str]]:
        """(target, 'runs'|'archive') for every place a run of that name lives."""
        found = [(t, p.has(run)) for t, p in self.probes.items()]
        return [(t, w) for t, w in found if w]

    def warn_errors(self) -> None:
        for target, err in self.errors.items():
            context.note(f"{target}: not read: {err.message}")

    def exit_code(self) -> int:
        if any(e.code == ExitCode.UNREACHABLE for e in self.errors.values()):
            return int(ExitCode.UNREACHABLE)
        return int(ExitCode.FAILED) if self.errors else 0


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


def find(session: Session, name: str, **request: Any) -> RunView:
    """The run called `name`, wherever it lives (runs/ or archive/ of any target)."""
    check_name(name)
    found = survey(session, names=[name], archive=True, **request)
    matches = [r for r in found.runs() if r.name == name]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        places = ", ".join(f"{r.target}:{r.where}/{name}" for r in matches)
        raise UsageError(
            f"run {name!r} exists in more than one place ({places}); names must be unique"
        )
    if found.errors:
        unread = ", ".join(f"{t} ({e.message})" for t, e in found.errors.items())
        raise UnreachableError(f"run {name!r} not found on the targets read; not read: {unread}")
    known = found.all_names()
    hint = did_you_mean(name, known)
    listed = f" (runs: {', '.join(known[:12])}{' ...' if len(known) > 12 else ''})" if known else ""
    raise NotFoundError(f"no run {name!r} on any target{hint}{listed}")


def newest_running(session: Session, **request: Any) -> RunView:
    found = survey(session, **request)
    running = [r for r in found.runs() if r.running]
    if not running:
        found.warn_errors()
        raise NotFoundError("no run is running; name one (`dflashops status --all` lists them)")
    newest = max(running, key=lambda r: r.started or 0)
    context.note(f"(run {newest.name} on {newest.target}: the newest running run)")
    return newest


def resolve(session: Session, name: str | None, **request: Any) -> RunView:
    """A named run, or the newest running one when no name is given."""
    if name:
        return find(session, name, **request)
    return newest_running(session, **request)


def reread(machine: Machine, run: str, **request: Any) -> RunView:
    """Run `run` read (again) from the machine it lives on, in runs/ or archive/."""
    answer = probe(machine, names=[run], archive=True, **request)
    fresh = next((r for r in answer.runs if r.name == run), None)
    if fresh is None:
        raise NotFoundError(f"{machine.name}: run {run} is gone")
    return fresh


VALUE_RULE = (
    "value at step S = the record with the largest step <= S; null when the run never reached S"
)


def value_at(records: list[dict[str, Any]], step: int) -> dict[str, Any] | None:
    """The record with the largest step <= `step` (the later one of equal steps); None when
    there is none that early, or when the run's log never got to `step`."""
    best = None
    reached = False
    for r in records:
        reached = reached or r["step"] >= step
        if r["step"] <= step and (best is None or r["step"] >= best["step"]):
            best = r
    return best if reached else None


def dry_run_done(opts: context.Context, **doc: Any) -> None:
    """The end of a --dry-run, whose argv went to stdout (to stderr under --json): under --json,
    its one document, {"dry_run": true, ...what it would have done}."""
    if opts.json:
        opts.emit({"dry_run": True, **doc})


@contextmanager
def sessions(opts: context.Context) -> Iterator[tuple[Session, Session]]:
    """(reader, writer). Under --dry-run reads still happen (they change nothing), so the plan
    shown is the real one, while every write is only printed."""
    writer = opts.session()
    if not opts.dry_run:
        yield writer, writer
        return
    reader = Session(opts.inventory(), dry_run=False, announce=context.note)
    try:
        yield reader, writer
    finally:
        reader.close()


def control(machine: Machine, action: str, run_path: str, **request: Any) -> dict[str, Any]:
    """One change to a run directory through remote/runctl.py (printed only under --dry-run)."""
    argv = helper_argv("runctl.py", action, run_path)
    result = machine.run(argv, stdin=json.dumps(request).encode())
    if machine.dry_run:
        return {}
    if not result.ok:
        raise OpsError(f"{machine.name}: {action} {run_path} failed: {result.error_text}")
    return json.loads(result.stdout)
