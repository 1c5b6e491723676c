"""Where runs live in a target, what state they are in, and finding them across the inventory.

Every read is one call per target (`remote/runs_probe.py` run with the target's python3,
returning JSON), and targets are probed in parallel.
"""

from __future__ import annotations

import json
import posixpath
import re
import signal
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from dflashops import context
from dflashops.errors import ExitCode, NotFoundError, OpsError, UnreachableError, UsageError
from dflashops.inventory import NAME_RE, Target
from dflashops.remote import argv as helper_argv
from dflashops.ssh.session import Session
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
    """dflash-RUN, one-to-one: tmux refuses a '.' in a session name, so '.' becomes '=', a
    character no run name has (tmux's own '.' -> '_' made v5.1 and v5_1 one session)."""
    return "dflash-" + run.replace(".", "=")


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
    nodes: list[RunView] = field(default_factory=list)  # every node's view (node 0 first)

    @property
    def status(self) -> dict[str, Any]:
        return self.raw.get("state") or {}

    @property
    def run_id(self) -> str | None:
        return self.status.get("run_id")

    @property
    def node_index(self) -> int:
        index = self.status.get("node")
        return index if isinstance(index, int) else 0

    @property
    def node_targets(self) -> list[str]:
        """The targets of every node, node 0 first (just this one for a one-node run)."""
        listed = self.status.get("nodes") or []
        names = [n.get("target") for n in listed if isinstance(n, dict) and n.get("target")]
        return names or [self.target]

    @property
    def multi(self) -> bool:
        return len(self.node_targets) > 1

    @property
    def ranks(self) -> list[dict[str, Any]]:
        """Rank heartbeats of every node, each with its node's target."""
        views = self.nodes or [self]
        return sorted(
            ({**r, "target": v.target} for v in views for r in v.raw.get("ranks") or []),
            key=lambda r: r.get("rank", 0),
        )

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
            "nodes": [node_summary(v) for v in (self.nodes or [self])],
            "ranks": [rank_summary(r) for r in self.ranks],
        }


def node_summary(view: RunView) -> dict[str, Any]:
    node = view.raw.get("node") or {}
    return {
        "node": view.node_index,
        "target": view.target,
        "dir": view.dir,
        "state": view.state,
        "exit_code": view.exit_code,
        "alive": node_alive(view.raw),
        "note": view.note,
        "finished": node.get("finished"),
    }


def rank_summary(beat: dict[str, Any]) -> dict[str, Any]:
    keys = ("rank", "target", "pid", "status", "step", "time", "alive", "exit_code")
    return {k: beat.get(k) for k in keys}


def node_alive(raw: dict[str, Any]) -> bool:
    """Something of this node still runs: its tmux session, launcher, agent or trainer."""
    node = raw.get("node") or {}
    procs = [node.get("launcher") or {}, node.get("agent") or {}]
    return bool(raw.get("tmux")) or bool(raw.get("pid_alive")) or any(p.get("alive") for p in procs)


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
    alive = node_alive(raw)
    if status == "claiming":
        return "starting", "being launched"
    if alive:
        agent = (raw.get("node") or {}).get("agent") or {}
        if st.get("node", 0) != 0 and status == "launching" and agent.get("alive"):
            return "running", None  # a node other than 0: its trainer ranks run
        if status in ("finished", "stopped"):
            return status, None
        return ("running" if status == "running" else "starting"), None
    if status in ("finished", "stopped") and code in (0, None):
        return status, None
    if code == 0 and st.get("node", 0) != 0:
        return "finished", None  # a node other than 0: node 0 says how the run ended
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
    gpus: dict[str, Any] | None = None  # what nvidia-smi says (None: no nvidia-smi there)
    free_port: int | None = None

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
        view = RunView(raw["name"], target.name, raw["where"], raw["dir"], state, doc["now"],
                       raw, note)  # fmt: skip
        if state == "failed" and root_cause(view):
            view.note = cause_note(*root_cause(view))
        views.append(view)
    return Probe(doc["names"], views, doc["dirs"], doc["paths"], doc.get("gpus"),
                 doc.get("free_port"))  # fmt: skip


def cause_note(rank: int, code: int) -> str:
    if code < 0:
        try:
            return f"rank {rank} killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"rank {rank} killed by signal {-code}"
    return f"rank {rank} exit code {code}"


def group(views: list[RunView]) -> list[RunView]:
    """One view per run: the nodes of a run over several targets (same name, same run id)
    become one view, node 0's, with every node's view in `nodes`."""
    out: list[RunView] = []
    parts: dict[tuple[str, str], list[RunView]] = {}
    for view in views:
        if view.multi and view.run_id and view.where == "runs":
            parts.setdefault((view.name, view.run_id), []).append(view)
        else:
            out.append(view)
    out += [combine(nodes) for nodes in parts.values()]
    return out


def combine(nodes: list[RunView]) -> RunView:
    """A run over several nodes as one view: node 0's, failed when any node failed (the note
    names the first node that failed, by its end time), running while any node still runs
    (so it is finished or stopped only once every node has ended), with the nodes not read
    noted."""
    nodes = sorted(nodes, key=lambda v: v.node_index)
    head = nodes[0]
    view = RunView(head.name, head.target, head.where, head.dir, head.state, head.now, head.raw,
                   head.note, nodes)  # fmt: skip
    missing = [t for t in head.node_targets if t not in {v.target for v in nodes}]
    if head.node_index != 0:
        missing.insert(0, head.node_targets[0])
    failed = [v for v in nodes if v.state == "failed"]
    if failed:
        first = min(failed, key=end_time)
        view.state = "failed"
        view.note = f"failed on {first.target}: {first.note or 'see its logs'}"
    elif view.running and any(not v.running for v in nodes):
        gone = ", ".join(v.target for v in nodes if not v.running)
        view.note = f"node(s) {gone} not running"
    elif any(v.running for v in nodes):  # node 0 ended, another node is still ending
        ending = ", ".join(v.target for v in nodes if v.running)
        view.state, view.note = "running", f"{head.state} on {head.target}; ending on {ending}"
    if missing:
        extra = f"not read: {', '.join(missing)}"
        view.note = f"{view.note}; {extra}" if view.note else extra
    return view


def end_time(view: RunView) -> float:
    node = view.raw.get("node") or {}
    for value in (node.get("finished"), view.status.get("finished")):
        if isinstance(value, (int, float)):
            return float(value)
    return float("inf")


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
        return sorted({n for p in self.probes.values() for w in p.names.values() for n in w})

    def where(self, run: str) -> list[tuple[str, str]]:
        """(target, 'runs'|'archive') for every place a run of that name lives."""
        found = [(t, p.has(run)) for t, p in self.probes.items()]
        return [(t, w) for t, w in found if w]


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
        places = ", ".join(f"{r.target}:{r.where}/{name}" for r in matches)
        raise UsageError(
            f"run {name!r} exists in more than one place ({places}); pick one with --host TARGET"
        )
    if host is not None and found.where(name):
        places = ", ".join(f"{t}:{w}/{name}" for t, w in found.where(name))
        raise NotFoundError(f"no run {name!r} on {host} (it is at {places})")
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
    when a target could not be read (the run may live there)."""
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


AGENT_NOISE = ("*****", "Setting OMP_NUM_THREADS", "[dflashops]")
ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def console_text(view: RunView) -> str:
    return (view.raw.get("console") or {}).get("tail") or ""


def trainer_lines(view: RunView) -> list[str]:
    """The console's last lines as the trainer wrote them: without torchrun's own report of
    a failure (its traceback and summary follow the trainer's output) and our own lines."""
    text = console_text(view)
    agent = text.rfind("Traceback (most recent call last):")
    if agent >= 0 and "ChildFailedError" in text[agent:]:
        text = text[:agent]
    lines = [line.rstrip() for line in text.splitlines()]
    return [ln for ln in lines if ln.strip() and not any(ln.lstrip().startswith(n) or n in ln
                                                         for n in AGENT_NOISE)]  # fmt: skip


def root_cause(view: RunView) -> tuple[int, int] | None:
    """(rank, exit code) of the first rank that failed, from torchrun's report in the
    console; None when there is none. A rank killed by signal N shows as -N."""
    found = ROOT_CAUSE.findall(console_text(view))
    if not found:
        return None
    rank, code = found[-1]
    return int(rank), int(code)


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
    reader = Session(
        opts.inventory(), dry_run=False, announce=context.note, timeout=opts.deadline()
    )
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
