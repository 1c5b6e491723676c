"""A run's life on its targets, shared by `launch`, `resume` and `eval`: where it runs (its
nodes and ranks), claiming its name, its code snapshot, its run directory, starting it under
torchrun in a tmux session of our own, waiting for its first sign of life, and taking back a
launch that failed; also what their command lines share (options, --set, --secret).

A run is one torchrun per node. One node: `torchrun --nproc-per-node N` with a c10d rendezvous of
its own on 127.0.0.1 (what --standalone does, without resolving "localhost"). Several:
the same on each node with a c10d rendezvous hosted by node 0 (`--rdzv-conf is_host=...`, so no
node needs to resolve another's hostname) and each node's own `--local-addr`. Every node has
the run directory at the same path; node 0 holds train_log.jsonl, state.json and checkpoints.

Nothing a user sets reaches a shell: the launcher (remote/launcher.py) reads argv and
environment from launch.json, a data file, and runs them as given.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import secrets as random_tokens
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer
import yaml

from dflashops import bundle, context, runs, transfer
from dflashops.errors import OpsError, UnreachableError, UsageError
from dflashops.inventory import Target
from dflashops.remote import source as helper_source
from dflashops.render import Stopwatch, duration
from dflashops.runs import RunView
from dflashops.ssh.session import Session
from dflashops.targets.base import Machine
from dflashops.watch import follow_run

TMUX = ["tmux", "-L", "dflashops", "-f", "/dev/null"]  # our own server, never the user's
LAUNCHER = "launcher.py"
CODE_HOME = "code"  # <ws>/dflashops/code/<digest>/: immutable workload snapshots
SECRETS_HOME = "secrets"  # <ws>/dflashops/secrets/: read and deleted by the launcher
CLAIM_WAIT_S = 30.0
RDZV_JOIN_S = 600  # how long node 0 waits for the others to join (rendezvous)
LOOPBACK = "127.0.0.1"  # a one-node run's address: its ranks talk over lo
SECRET_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
KEY_PART = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# options that `launch` and `resume` share
SECRETS_OPTION = typer.Option(
    None,
    "--secret",
    metavar="NAME",
    help="Pass NAME from your environment (e.g. WANDB_API_KEY) to the trainer through a 0600 "
    "file outside the run directory, read and deleted as the trainer starts; never on a "
    "command line. resume asks for it again.",
)
FOLLOW_OPTION = typer.Option(
    False, "--follow", "-f", help="Then watch it, as status --follow does."
)
WAIT_OPTION = typer.Option(
    900, "--wait", metavar="SECONDS", help="How long to wait for the first sign of life."
)
JSON_OPTION = typer.Option(False, "--json", help="Print one JSON document.")


# ---------------------------------------------------------------- where a run runs


@dataclass(frozen=True)
class Node:
    index: int
    target: Target
    nproc: int


@dataclass
class Placement:
    """A run's nodes: one torchrun each, node 0 first (it hosts the rendezvous)."""

    run: str
    run_id: str
    nodes: list[Node]
    port: int | None = None  # the rendezvous port on node 0 (several nodes only)

    @property
    def world(self) -> int:
        return sum(n.nproc for n in self.nodes)

    @property
    def multi(self) -> bool:
        return len(self.nodes) > 1

    def dir(self, node: Node) -> str:
        return runs.run_dir(node.target, self.run)

    def describe(self) -> str:
        per = ", ".join(f"{n.target.name} x{n.nproc}" for n in self.nodes)
        return f"{self.world} rank(s): {per}"

    def record(self) -> list[dict[str, Any]]:
        """The nodes as run records list them (state.json's "nodes")."""
        return [
            {"target": n.target.name, "address": n.target.node_address, "nproc": n.nproc}
            for n in self.nodes
        ]


def new_run_id() -> str:
    return random_tokens.token_hex(8)


def parse_hosts(spec: str) -> list[str]:
    names = [part.strip() for part in spec.split(",")]
    if not all(names):
        raise UsageError(f"--host {spec}: give target names separated by commas (ct200,ct201)")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UsageError(f"--host {spec}: {', '.join(twice)} named twice; a target is one node")
    return names


def nproc_of(target: Target, override: int | None, reported: int | None) -> int:
    """--nproc, else the inventory's gpus, else what nvidia-smi reports there, else 1."""
    for value in (override, target.gpus, reported):
        if value:
            return value
    return 1


def place(
    run: str,
    targets: list[Target],
    *,
    nproc: int | None,
    reported: dict[str, int | None],
    run_id: str | None = None,
) -> Placement:
    """The run's nodes; several need an address each and the same number of processes."""
    nodes = [Node(i, t, nproc_of(t, nproc, reported.get(t.name))) for i, t in enumerate(targets)]
    if len(nodes) > 1:
        for node in nodes:
            if node.target.kind == "local":
                raise UsageError(
                    f"--host: {node.target.name} is the local target; a run over several "
                    "targets needs targets that reach each other (pct or ssh targets)"
                )
            if not node.target.node_address:
                raise UsageError(
                    f"--host: target {node.target.name} has no 'address' in the inventory; a run "
                    "over several targets needs one per target (its IP on the bridge, where the "
                    f"others reach it), e.g. targets.{node.target.name}.address: 10.1.2.200"
                )
        counts = {n.target.name: n.nproc for n in nodes}
        if len(set(counts.values())) > 1:
            shown = ", ".join(f"{k} {v}" for k, v in counts.items())
            raise UsageError(
                f"--host: the targets would run different numbers of processes ({shown}); "
                "pass --nproc N for all of them"
            )
    return Placement(run, run_id or new_run_id(), nodes)


# ---------------------------------------------------------------- the code a run executes


@dataclass
class Code:
    """The workload (and templates) as shipped: its entries and their digest."""

    digest: str
    entries: list[transfer.Entry]

    def path(self, target: Target) -> str:
        return posixpath.join(target.workspace, bundle.REMOTE_HOME, CODE_HOME, self.digest)


def local_code() -> Code:
    entries: list[transfer.Entry] = []
    for name, local in (("workload", bundle.workload_dir()), ("templates", bundle.templates_dir())):
        if not local.is_dir():
            continue
        entries.append(transfer.Entry(name, local, "d", mode=0o755))
        for entry in transfer.scan(local):
            if bundle.shipped(entry.rel):
                entry.rel = f"{name}/{entry.rel}"
                entries.append(entry)
    digest = hashlib.sha256()
    for entry in entries:
        digest.update(f"{entry.rel}\0{entry.kind}\0{entry.mode & 0o111}\0".encode())
        if entry.kind == "f":
            digest.update(hashlib.sha256(entry.path.read_bytes()).digest())
        elif entry.kind == "l":
            digest.update(entry.link.encode())
    return Code(digest.hexdigest()[:16], entries)


def ensure_code(machine: Machine, code: Code, have: bool) -> str:
    """The snapshot directory of `code` in the target, sent there first unless `have`.
    Written once under a temporary name and renamed into place: never changed afterwards, so
    a later launch never rewrites the code under a run that is still training."""
    final = code.path(machine.target)
    if have:
        return final
    tmp = f"{final}.tmp-{random_tokens.token_hex(4)}"
    context.note(f"{machine.name}: sending the workload (snapshot {code.digest})")
    try:
        transfer.put(machine, Path(tempfile.gettempdir()), tmp, entries=code.entries)
    except OpsError:
        runs.control(machine, "discard", tmp)
        raise
    runs.control(machine, "publish", final, **{"from": tmp})
    return final


# ---------------------------------------------------------------- claiming the name


def claim_key(view: runs.RunView) -> tuple[float, str] | None:
    claim = view.status.get("claim") or {}
    if not isinstance(claim.get("t"), (int, float)):
        return None
    return float(claim["t"]), str(claim.get("nonce", ""))


def taken_error(run: str, views: Iterable[runs.RunView]) -> UsageError:
    shown = ", ".join(f"{v.target}:{v.where}/{run} ({v.state})" for v in views)
    return UsageError(
        f"run name {run!r} is taken ({shown}); choose another name, or resume it with "
        f"`dflashops resume {run}`"
    )


def claim(reader: Session, writer: Session, placement: Placement) -> None:
    """Make the run directory on every node, atomically per target (mkdir), then settle with
    any launch of the same name elsewhere: two launches of one name cannot both win.

    A rival that has committed wins; of two rivals still claiming, the earlier claim (time,
    then a random nonce: both sides order the pair the same way) waits for the later to back
    off, and the later backs off at once. A failed claim takes back what it made."""
    mine = {"t": time.time(), "nonce": random_tokens.token_hex(4)}
    made: list[Node] = []
    try:
        for node in placement.nodes:
            state = initial_state(placement, node, status="claiming", claim=mine)
            answer = runs.control(
                writer.machine(node.target), "claim", placement.dir(node), **state
            )
            if answer.get("taken") is not None:
                raise UsageError(
                    f"run name {placement.run!r} is taken: {node.target.name}:"
                    f"{placement.dir(node)} exists; choose another name"
                )
            made.append(node)
        if not writer.dry_run:
            settle(reader, placement, (mine["t"], mine["nonce"]))
        for node in placement.nodes:
            runs.control(
                writer.machine(node.target),
                "commit",
                placement.dir(node),
                run_id=placement.run_id,
            )
    except BaseException:
        take_back(writer, placement, made)
        raise


def refuse_unread(run: str, unread: dict[str, OpsError]) -> None:
    """A run's own targets must be read: its name is checked there, and it runs there."""
    if unread:
        shown = ", ".join(f"{t} ({e.message})" for t, e in unread.items())
        raise UnreachableError(f"run {run!r}: its own target could not be read: {shown}")


def warn_unread(run: str, unread: dict[str, OpsError]) -> None:
    """Targets outside the run that could not be read (a stopped container, a host down): the
    name needs to be free only where it could be checked (CONTRACTS §2), so one line says so."""
    if unread:
        shown = ", ".join(f"{t} ({e.message})" for t, e in unread.items())
        context.note(f"warning: {run}: not read, so the name was not checked there: {shown}")


def settle(reader: Session, placement: Placement, mine: tuple[float, str]) -> None:
    run = placement.run
    waited = time.monotonic()
    while True:
        found = runs.survey(reader, names=[run], archive=True, records="none")
        own = {n.target.name for n in placement.nodes}
        refuse_unread(run, {t: e for t, e in found.errors.items() if t in own})
        rivals = [v for v in found.runs() if v.name == run and v.run_id != placement.run_id]
        if not rivals:
            return
        settled = [v for v in rivals if v.status.get("status") != "claiming" and v.status]
        if settled:
            raise taken_error(run, settled)
        keys = [claim_key(v) for v in rivals]
        if any(k is not None and k < mine for k in keys):
            raise taken_error(run, rivals)
        if time.monotonic() - waited > CLAIM_WAIT_S:
            raise taken_error(run, rivals)
        time.sleep(0.5)


def initial_state(placement: Placement, node: Node, **extra: Any) -> dict[str, Any]:
    return {
        "run_id": placement.run_id,
        "node": node.index,
        "nodes": placement.record(),
        "world_size": placement.world,
        "tmux": runs.tmux_session(placement.run),
        "launched": time.time(),
        "target": node.target.name,
        **extra,
    }


def take_back(
    writer: Session, placement: Placement, nodes: Iterable[Node], files: Iterable[str] = ()
) -> None:
    """Undo a launch: stop what it started and delete what it made (only its own run dirs,
    recognised by the run id), on a best-effort basis (a node may be the reason it failed)."""
    extra = list(files)
    for node in nodes:
        machine = writer.machine(node.target)
        try:
            runs.control(machine, "kill", placement.dir(node))
            runs.control(machine, "remove", placement.dir(node), run_id=placement.run_id,
                         files=extra)  # fmt: skip
        except OpsError as exc:
            context.note(f"{node.target.name}: could not take back {placement.dir(node)}: "
                         f"{exc.message}")  # fmt: skip


# ---------------------------------------------------------------- the run directory


def torchrun_argv(placement: Placement, node: Node, rundir: str, *, resume: bool) -> list[str]:
    target = node.target
    head = [target.python, "-m", "torch.distributed.run", "--nproc-per-node", str(node.nproc)]
    head += ["--max-restarts", "0", "--monitor-interval", "1"]
    if placement.multi:
        first = placement.nodes[0].target.node_address
        is_host = "true" if node.index == 0 else "false"
        head += [
            "--nnodes", str(len(placement.nodes)),
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{first}:{placement.port}",
            "--rdzv-id", f"{placement.run}-{placement.run_id}",
            "--rdzv-conf", f"is_host={is_host},join_timeout={RDZV_JOIN_S}",
            "--local-addr", str(target.node_address),
        ]  # fmt: skip
    else:  # what --standalone does, on 127.0.0.1 instead of "localhost": a container need not
        # resolve any name (a minimal one may have no /etc/hosts at all)
        head += [
            "--nnodes", "1",
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{LOOPBACK}:0",
            "--rdzv-id", f"{placement.run}-{placement.run_id}",
            "--local-addr", LOOPBACK,
        ]  # fmt: skip
    train = ["-m", "workload.train", "--config", "run.yaml", "--run-dir", rundir]
    return head + train + (["--resume"] if resume else [])


def launch_env(target: Target, code_dir: str, node_address: str | None) -> dict[str, str]:
    """The trainer's environment: this, the target's `env`, and only HOME, USER and LOGNAME
    from the launcher's own (never the tmux server's: no stale CUDA_VISIBLE_DEVICES)."""
    path = os.environ.get("PATH", target.path) if target.kind == "local" else target.path
    env = {
        "PATH": path,
        "LANG": "C.UTF-8",
        "PYTHONPATH": code_dir,
        "PYTHONUNBUFFERED": "1",
    }
    if node_address:
        env["DFLASHOPS_NODE_ADDR"] = node_address
    env.update(target.env)
    return env


def launch_doc(
    placement: Placement,
    node: Node,
    *,
    code_dir: str,
    secrets_path: str | None,
    resume: bool,
) -> dict[str, Any]:
    rundir = placement.dir(node)
    address = node.target.node_address if placement.multi else LOOPBACK
    return {
        "run": placement.run,
        "run_id": placement.run_id,
        "node": node.index,
        "target": node.target.name,
        "nodes": placement.record(),
        "code": code_dir,
        "argv": torchrun_argv(placement, node, rundir, resume=resume),
        "env": launch_env(node.target, code_dir, address),
        "secrets": secrets_path,
    }


def secrets_path(placement: Placement, node: Node) -> str:
    name = f"{placement.run}-{placement.run_id}-{node.index}.json"
    return posixpath.join(node.target.workspace, bundle.REMOTE_HOME, SECRETS_HOME, name)


def write_run_files(
    machine: Machine,
    rundir: str,
    files: dict[str, str],
) -> None:
    """Copy text files into the run directory, verified (run.yaml, launch.json, launcher.py)."""
    with tempfile.TemporaryDirectory(prefix="dflashops-run-") as tmp:
        local = Path(tmp)
        for name, text in files.items():
            (local / name).write_text(text)
        transfer.put(machine, local, rundir)


def write_secrets(machine: Machine, path: str, values: dict[str, str]) -> None:
    """The secrets of one node, a new 0600 file from our stdin: never on a command line."""
    runs.control(machine, "secrets", path, values=values)


def node_files(doc: dict[str, Any], config_text: str | None) -> dict[str, str]:
    files = {
        "launch.json": json.dumps(doc, indent=2) + "\n",
        LAUNCHER: helper_source(LAUNCHER),
    }
    if config_text is not None:
        files["run.yaml"] = config_text
    return files


# ---------------------------------------------------------------- making and starting


def start(machine: Machine, run: str, rundir: str) -> None:
    """The launcher in a new detached session of our tmux server (it survives the SSH
    connection and never sees the user's tmux server or its environment)."""
    session = runs.tmux_session(run)
    launcher = posixpath.join(rundir, LAUNCHER)
    argv = [*TMUX, "new-session", "-d", "-s", session, "-c", rundir, "python3", launcher, rundir]
    result = machine.run(argv)
    if machine.dry_run:
        return
    if result.returncode == 127:
        raise OpsError(f"{machine.name}: tmux is not installed there (apt install tmux)")
    if not result.ok:
        raise OpsError(f"{machine.name}: tmux new-session -s {session}: {result.error_text}")


@dataclass
class Started:
    """What `launch`/`resume` made so far: enough to take it back if what follows fails (its
    secrets files, besides the run directories)."""

    placement: Placement
    secrets: list[str] = field(default_factory=list)


def each_node(writer: Session, placement: Placement, work: Callable[[Node], Any]) -> list[Any]:
    """`work` on every node in parallel; the first error raised after all are done."""
    answers = writer.each(work, placement.nodes)
    for answer in answers:
        if isinstance(answer, BaseException):
            raise answer
    return answers


def prepare(
    writer: Session,
    placement: Placement,
    code: Code,
    have_code: Callable[[Target, Code], bool],
    config_text: str,
    values: dict[str, str],
    made: Started,
    *,
    resume: bool = False,
    code_dirs: dict[str, str] | None = None,
) -> None:
    """On every node in parallel: the code snapshot, secrets, and the run files."""

    def one(node: Node) -> None:
        machine = writer.machine(node.target)
        if code_dirs and node.target.name in code_dirs:
            code_dir = code_dirs[node.target.name]
        else:
            code_dir = ensure_code(machine, code, have_code(node.target, code))
        secret = None
        if values:
            secret = secrets_path(placement, node)
            made.secrets.append(secret)
            write_secrets(machine, secret, values)
        doc = launch_doc(placement, node, code_dir=code_dir, secrets_path=secret,
                         resume=resume)  # fmt: skip
        files = node_files(doc, None if resume else config_text)
        write_run_files(machine, placement.dir(node), files)

    each_node(writer, placement, one)


def start_all(writer: Session, placement: Placement) -> None:
    """Node 0 first (it hosts the rendezvous), then the others."""
    for node in placement.nodes:
        start(writer.machine(node.target), placement.run, placement.dir(node))


# ---------------------------------------------------------------- waiting


def wait_for_life(reader: Session, placement: Placement, *, timeout: float) -> RunView:
    """Until the trainer runs (state.json says so), ends, or `timeout` passes."""
    clock = Stopwatch()
    next_note = 5.0
    run = placement.run
    head = placement.nodes[0].target
    where = ", ".join(n.target.name for n in placement.nodes)
    context.note(f"{run}: starting on {where} (the trainer loads the target model first)")
    view = runs.reread(reader.machine(head), run, records="recent", console=8192)
    while True:
        view = runs.refresh(reader, view, records="recent", console=8192)
        if view.state == "running" and view.status.get("status") == "running":
            return view
        if view.state in ("finished", "stopped"):
            return view
        if view.state in ("failed", "unknown"):
            error = trainer_failure(view, failed_target(reader, view))
            for line in last_lines(view)[-12:]:
                context.note(f"  {line}")
            raise error
        if clock.seconds > timeout:
            context.note(
                f"{run}: still starting after {duration(clock.seconds)}; it goes on: "
                f"`dflashops logs {run} --follow` shows what it prints"
            )
            return view
        if clock.seconds >= next_note:
            said = last_lines(view)[-1:] or ["(no output yet)"]
            context.note(f"{run}: starting ({duration(clock.seconds)}): {said[0]}")
            next_note += 10
        time.sleep(1.0 if clock.seconds < 30 else 3.0)


def failed_target(reader: Session, view: RunView) -> Target:
    nodes = [v for v in view.nodes if v.state == "failed"] or [view]
    return reader.inventory.target(min(nodes, key=runs.end_time).target)


def last_lines(view: RunView) -> list[str]:
    return runs.trainer_lines(view)


def trainer_failure(view: RunView, target: Target) -> OpsError:
    """The trainer's early exit as our error: its config refusal (exit 2) becomes our exit 2."""
    failed = [v for v in view.nodes if v.state == "failed"]
    if failed:
        view = min(failed, key=runs.end_time)
    cause = runs.root_cause(view)
    code = cause[1] if cause else view.exit_code
    lines = last_lines(view)
    if code == 2:
        refusals = [line for line in lines if line.startswith("error: ")]
        message = (refusals or lines or ["(no message)"])[-1].removeprefix("error: ")
        return UsageError(f"{view.name}: the trainer refused to start: {message}")
    if code == 127:
        return OpsError(
            f"{view.name}: {target.python} not found on {target.name}; "
            f"run `dflashops setup {target.name}` first"
        )
    why = view.note or f"exit code {code}"
    last = lines[-1] if lines else "no output"
    return OpsError(f"{view.name}: the trainer failed ({why}): {last}")


def then_follow(opts: context.Context, reader: Any, view: RunView, follow: bool) -> None:
    """Report the started run; with --follow, go on as `status --follow` (one JSON document
    at the end under --json)."""
    if not (follow and opts.json):
        report(opts, view)
    if follow:
        emit = opts.emit if opts.json else None
        raise typer.Exit(follow_run(reader, view, None, interval=5.0, emit=emit))


def report(opts: context.Context, view: RunView) -> None:
    if opts.json:
        opts.emit(view.summary())
        return
    step = f", step {view.step}/{view.total_steps}" if view.step is not None else ""
    where = ", ".join(view.node_targets)
    context.say(
        f"{view.name}: {view.state} on {where} (tmux {runs.tmux_session(view.name)}"
        f"{step}); watch it with: dflashops status {view.name} --follow"
    )


# ---------------------------------------------------------------- the config


def apply_set(data: dict[str, Any], item: str) -> None:
    key, sep, raw = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(KEY_PART.match(p) for p in parts):
        raise UsageError(f"--set {item}: expected KEY=VALUE with a dotted key, e.g. loss.gamma=7")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        raise UsageError(f"--set {item}: the value is not valid YAML") from None
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise UsageError(f"--set {item}: {where} is a value, not a section")
        node = child
    node[parts[-1]] = value


# ---------------------------------------------------------------- secrets


def secret_values(names: list[str]) -> dict[str, str]:
    """--secret NAME...: the values from our environment (they travel on stdin only)."""
    values = {}
    for name in names:
        if not SECRET_NAME.match(name):
            raise UsageError(
                f"--secret {name}: give an environment variable's name (its value is read from "
                "your environment), e.g. --secret WANDB_API_KEY"
            )
        value = os.environ.get(name)
        if value is None:
            raise UsageError(f"--secret {name}: not set in your environment")
        values[name] = value
    return values
