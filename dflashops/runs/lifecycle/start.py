"""Starting a job of any kind and waiting for it: its name claimed, its code snapshot, secrets
and files (launch.json, launcher.py, its kind's) on every node, the launcher started in a
detached session of our own tmux server, and the wait for its program's first sign of life.

Nothing a user sets reaches a shell: the launcher (remote/launcher.py) reads argv and
environment from launch.json, a data file, and runs them as given.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import secrets as random_tokens
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflashops import context, transfer
from dflashops.errors import NotFoundError, OpsError, UnreachableError
from dflashops.inventory import Target
from dflashops.remote import layout
from dflashops.remote import source as helper_source
from dflashops.render import Stopwatch, duration
from dflashops.runs.lifecycle.claim import claim, lease_kept, secrets_home, take_back
from dflashops.runs.lifecycle.control import control
from dflashops.runs.lifecycle.placement import LOOPBACK, Node, Placement
from dflashops.runs.lifecycle.queue import WAITER, waiter_files
from dflashops.runs.lifecycle.snapshot import Code, ensure_code
from dflashops.runs.reading.failure import trainer_failure, trainer_lines
from dflashops.runs.reading.survey import refresh, reread
from dflashops.runs.reading.view import RunView, end_time, tmux_session
from dflashops.ssh.session import Session
from dflashops.targets.base import Machine

TMUX = ["tmux", "-L", "dflashops", "-f", "/dev/null"]  # our own server, never the user's
LAUNCHER = "launcher.py"


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
    env.update(compile_caches(target))
    env.update(target.env)
    return env


def compile_caches(target: Target) -> dict[str, str]:
    """torch.compile's caches (inductor's FX graph and autotuning results, triton's kernels) in
    the workspace, shared by every run and resume of the same shapes on the target: a restart
    reuses the first start's compiles instead of paying them again (the trainer says which)."""
    base = posixpath.join(target.workspace, layout.COMPILE_CACHE)
    return {"TORCHINDUCTOR_CACHE_DIR": posixpath.join(base, "inductor"),
            "TRITON_CACHE_DIR": posixpath.join(base, "triton")}  # fmt: skip


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
        "argv": placement.kind.argv(placement, node, rundir, resume=resume),
        "env": launch_env(node.target, code_dir, address),
        "secrets": secrets_path,
    }


def secrets_path(placement: Placement, node: Node) -> str:
    """A new name at every start (a file left by a start cut short never blocks the next);
    the run's name and id come first, so that a later start can sweep it."""
    name = f"{placement.run}-{placement.run_id}-{node.index}-{random_tokens.token_hex(4)}.json"
    return posixpath.join(secrets_home(node.target), name)


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
    control(machine, "secrets", path, values=values)


def node_files(placement: Placement, doc: dict[str, Any], files: dict[str, str]) -> dict[str, str]:
    """launch.json, the launcher and its kind's helpers (written at every start), and `files`
    (the job's own, e.g. run.yaml: only at its first start)."""
    return {
        layout.LAUNCH_FILE: json.dumps(doc, indent=2) + "\n",
        LAUNCHER: helper_source(LAUNCHER),
        **placement.kind.helpers(),
        **files,
    }


def start(machine: Machine, run: str, rundir: str, program: str = LAUNCHER) -> None:
    """The launcher (or a queued run's waiter) in a new detached session of our tmux server
    (it survives the SSH connection and never sees the user's tmux server or its
    environment)."""
    session = tmux_session(run)
    launcher = posixpath.join(rundir, program)
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
    files: dict[str, str],
    values: dict[str, str],
    made: Started,
    *,
    resume: bool = False,
    code_dirs: dict[str, str] | None = None,
) -> None:
    """On every node in parallel: the code snapshot, secrets, and the job's files."""

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
        write_run_files(machine, placement.dir(node), node_files(placement, doc, files))

    each_node(writer, placement, one)


def start_job(
    reader: Session,
    writer: Session,
    placement: Placement,
    code: Code,
    have_code: Callable[[Target, Code], bool],
    files: dict[str, str],
    values: dict[str, str],
    *,
    check: Callable[[], None] | None = None,
    queued: str | None = None,
) -> Started:
    """A new job: its name claimed on every node, then there its code, secrets and `files`,
    then `check` (e.g. the memory plan), then the launcher on every node, or, `queued` (why
    its one target is busy), its waiter (runs/lifecycle/queue.py). A failure on the way
    takes back what was made. Under --dry-run nothing is claimed, the rest only printed."""
    holder = None if writer.dry_run else claim(reader, writer, placement)
    made = Started(placement)
    files = {**files, **waiter_files()} if queued else files
    try:
        with lease_kept(writer, placement, holder) if holder else contextlib.nullcontext():
            prepare(writer, placement, code, have_code, files, values, made)
            if check is not None and not writer.dry_run:
                check()
        if queued:
            wait_there(writer, placement, queued)
        else:
            start_all(writer, placement)
    except BaseException:
        if not writer.dry_run:
            take_back(writer, placement, placement.nodes, made.secrets)
        raise
    return made


def wait_there(writer: Session, placement: Placement, why: str) -> None:
    """The claimed, prepared run at status queued, its waiter started in its session."""
    node = placement.nodes[0]
    machine = writer.machine(node.target)
    control(machine, "queue", placement.dir(node), run_id=placement.run_id, waits_for=why)
    start(machine, placement.run, placement.dir(node), program=WAITER)


def start_all(writer: Session, placement: Placement) -> None:
    """Node 0 first (it hosts the rendezvous), then the others."""
    for node in placement.nodes:
        start(writer.machine(node.target), placement.run, placement.dir(node))


class NotRead(UnreachableError):
    """A started job could not be read within the wait: it may well run (nothing is taken
    back for it)."""


def wait_for_life(reader: Session, placement: Placement, *, timeout: float) -> RunView:
    """Until its program runs (state.json says so), ends, or `timeout` passes. Only the
    program's own failure is an error: a read that is lost on the way (no answer within the
    deadline, a dropped connection) is tried again within the wait."""
    clock = Stopwatch()
    next_note = 5.0
    run = placement.run
    head = placement.nodes[0].target
    where = ", ".join(n.target.name for n in placement.nodes)
    program = placement.kind.program
    context.note(f"{run}: starting on {where} (the {program} loads the target model first)")
    view: RunView | None = None
    while True:
        try:
            if view is None:
                view = reread(reader.machine(head), run, records="recent", console=8192)
            view = refresh(reader, view, records="recent", console=8192)
        except NotFoundError:
            raise
        except OpsError as exc:  # the read was lost, not the run
            if clock.seconds > timeout:
                raise NotRead(f"{run}: not read within {duration(clock.seconds)} ("
                              f"{exc.message}); it may be running: `dflashops status {run}` "
                              "shows it") from None  # fmt: skip
            context.note(f"{run}: not read ({exc.message}); trying again")
            time.sleep(1.0)
            continue
        if view.state == "running" and view.status.get("status") == "running":
            return view
        if view.state in ("finished", "stopped"):
            return view
        if view.state in ("failed", "unknown"):
            error = trainer_failure(view, failed_target(reader, view))
            for line in trainer_lines(view)[-12:]:
                context.note(f"  {line}")
            raise error
        if clock.seconds > timeout:
            context.note(
                f"{run}: still starting after {duration(clock.seconds)}; it goes on: "
                f"`dflashops logs {run} --follow` shows what it prints"
            )
            return view
        if clock.seconds >= next_note:
            said = trainer_lines(view)[-1:] or ["(no output yet)"]
            context.note(f"{run}: starting ({duration(clock.seconds)}): {said[0]}")
            next_note += 10
        time.sleep(1.0 if clock.seconds < 30 else 3.0)


def failed_target(reader: Session, view: RunView) -> Target:
    nodes = [v for v in view.nodes if v.state == "failed"] or [view]
    return reader.inventory.target(min(nodes, key=end_time).target)
