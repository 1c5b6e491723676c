"""Where a run lives in a target, and one job (a training run, or another kind's job) as read
from there (`RunView`): its state from state.json, its exit code, tmux and its processes, its
nodes and ranks, its log records, its progress as its kind reads it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from dflashops.errors import UsageError
from dflashops.inventory import NAME_RE, Target
from dflashops.remote import layout
from dflashops.runs.lifecycle.hold import abandoned, is_mine

TERMINAL = ("finished", "failed", "stopped", "archived")


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


def run_dir(target: Target, run: str, where: str = layout.RUNS) -> str:
    return layout.run_path(target.workspace, run, where)


def ckpt_copy_dir(target: Target, run: str, step: int) -> str:
    """Where `pull-ckpt` puts a checkpoint on an eval target."""
    return layout.ckpt_copy_path(target.workspace, run, step)


def eval_result_path(target: Target, run: str, step: int) -> str:
    return layout.eval_result_path(target.workspace, run, step)


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


@dataclass(frozen=True)
class Progress:
    """How far a job is: `done` of `total` units (steps, conversations, ...), and when it will
    be done at its recent rate (seconds from now)."""

    done: int | None
    total: int | None
    unit: str = "step"
    eta: float | None = None
    rate: float | None = None  # units per second

    def text(self) -> str:
        """'step 40' (a run's), '3/5 steps', '1200/80000 conversations'."""
        if self.unit == "step":
            return f"step {self.done}"
        return f"{self.done}/{self.total} {self.unit}"

    def doc(self) -> dict[str, Any]:
        return {"done": self.done, "total": self.total, "unit": self.unit,
                "eta_s": _round(self.eta), "rate": self.rate}  # fmt: skip


class Kind(Protocol):
    """What a view and a placement ask of their job's kind (runs/lifecycle/job_kind.py's JobKind)."""

    name: str
    program: str

    def dir(self, target: Target, name: str) -> str: ...
    def progress(self, view: RunView) -> Progress: ...
    def summary(self, view: RunView) -> dict[str, Any]: ...


@dataclass
class RunView:
    """One job as read from its target."""

    name: str
    target: str
    where: str  # its kind's home ("runs", "evals", ...) or "archive"
    dir: str
    state: str  # queued | starting | running | finished | stopped | failed | archived | abandoned | unknown
    now: float  # the target's clock when it was read
    raw: dict[str, Any] = field(default_factory=dict)
    note: str | None = None
    nodes: list[RunView] = field(default_factory=list)  # every node's view (node 0 first)
    kind: Kind | None = None  # None: a view made by hand, read as a training run's

    @property
    def progress(self) -> Progress:
        return self.kind.progress(self) if self.kind is not None else self.step_progress()

    def step_progress(self) -> Progress:
        """A training run's progress: its step of its total steps, from its log."""
        return Progress(self.step, self.total_steps, "step", self.eta)

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
    def queued(self) -> bool:
        """A launch queued for its target (`launch --queue`), waiting or with its waiter gone."""
        return self.status.get("status") == "queued"

    @property
    def started(self) -> float | None:
        if self.queued:
            return None  # claimed, never started
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
            "history": self.status.get("history") or [],
            "ranks": [rank_summary(r) for r in self.ranks],
            **(self.kind.summary(self) if self.kind is not None else {}),
        }


def lived_text(view: RunView) -> str:
    """'ct200 x8 from step 0; ct201 x4 from step 3000': where the run has lived (state.json's
    history: targets, processes each, from which step)."""
    parts = []
    for entry in view.status.get("history") or []:
        pairs = zip(entry.get("targets") or [], entry.get("nproc") or [], strict=False)
        where = ", ".join(f"{t} x{n}" for t, n in pairs)
        parts.append(f"{where} from step {entry.get('from_step', 0)}")
    return "; ".join(parts)


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


def derive_state(raw: dict[str, Any], now: float) -> tuple[str, str | None]:
    """(state, note) from what the probe saw: state.json, exit code, tmux and the trainer's pid;
    a launch cut short before its launcher started is "abandoned" (its name is free again), a
    resume cut short "failed" (`now`: the target's clock when it was read)."""
    if raw.get("where") == "archive":
        return "archived", None
    st = raw.get("state") or {}
    status = st.get("status")
    code = st.get("exit_code")
    if code is None:
        code = raw.get("exit_file")
    alive = node_alive(raw)
    if status == "queued":
        return queued_state(st, alive)
    cut = None if alive else abandoned(raw, now)
    if cut:
        return ("failed" if (st.get("hold") or {}).get("verb") == "resume" else "abandoned"), cut
    hold = st.get("hold")
    held = status == "launching" and isinstance(hold, dict) and not raw.get("node")
    if status == "claiming" or (held and not alive and not is_mine(hold)):
        return "starting", "being resumed" if st.get("resumed") else "being launched"
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


def queued_state(st: dict[str, Any], alive: bool) -> tuple[str, str | None]:
    """A launch queued for its target (`launch --queue`): waiting while its waiter lives."""
    if not alive:
        return (
            "failed",
            "queued, but its waiter is gone (the container restarted?): `stop` removes it",
        )
    waits = (st.get("queue") or {}).get("waits_for")
    return "queued", f"waits: {waits}" if waits else "waits for its target to free"


def group(views: list[RunView]) -> list[RunView]:
    """One view per run: the nodes of a run over several targets (same name, same run id)
    become one view, node 0's, with every node's view in `nodes`."""
    out: list[RunView] = []
    parts: dict[tuple[str, str], list[RunView]] = {}
    for view in views:
        if view.multi and view.run_id and view.state != "archived":
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
                   head.note, nodes, head.kind)  # fmt: skip
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
