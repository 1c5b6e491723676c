"""Stopping a job of any kind: SIGTERM to its program's pid (state.json's; a run's rank 0, which
tells every rank at the end of the step to save a checkpoint and stop), then the wait until
every node has exited; or kill it (SIGKILL to every node's recorded processes: torchrun's agent,
the ranks, an eval job's engine process groups), for a program that does not stop. Processes
are recognised by pid and start time, never by a name. What a stop asks and where the job
stopped is its kind's (JobKind)."""

from __future__ import annotations

import time
from typing import Any

from dflashops import context
from dflashops.errors import OpsError
from dflashops.render import Stopwatch, duration
from dflashops.runs.lifecycle import kinds
from dflashops.runs.lifecycle.control import control
from dflashops.runs.reading.survey import refresh
from dflashops.runs.reading.view import RunView, node_alive
from dflashops.ssh.session import Session
from dflashops.targets.base import Machine


def running(view: RunView) -> bool:
    """Something of the run still runs (on any of its nodes)."""
    return view.running or any(v.running for v in view.nodes)


def stop(
    reader: Session, writer: Session, view: RunView, *, kill: bool, timeout: float
) -> RunView | None:
    """Stop (or kill) a running job and wait until it has; None under --dry-run."""
    kind = kinds.by_where(view.where)
    if kill:
        kill_nodes(writer, view)
    else:
        nodes = [v for v in view.nodes if v.running] if kind.stop_every_node else []
        pid = [signal_program(writer.machine(v.target), reader, v) for v in nodes or [view]][0]
    if writer.dry_run:
        return None
    if kill:
        context.note(f"{view.name}: killed on {', '.join(view.node_targets)}")
    else:
        context.note(f"{view.name}: asked the {kind.program} (pid {pid}) to {kind.stop_request}")
    return wait_stopped(reader, view, 60 if kill else timeout, killed=kill)


def stopped(view: RunView) -> tuple[str, dict[str, Any]]:
    """Where a stopped job stopped, as its kind says it: the words after its state in the line
    (" at step 6; newest checkpoint step_6"), and the keys added to the JSON document."""
    return kinds.by_where(view.where).stopped(view)


def kill_nodes(writer: Session, view: RunView) -> None:
    targets = [writer.inventory.target(t) for t in view.node_targets]
    dirs = {v.target: v.dir for v in view.nodes or [view]}
    answers = writer.each(
        lambda t: control(writer.machine(t), "kill", dirs.get(t.name, view.dir)), targets
    )
    for target, answer in zip(targets, answers, strict=True):
        if isinstance(answer, OpsError):
            context.note(f"{target.name}: not killed: {answer.message}")
        elif answer.get("engines_left"):
            groups = ", ".join(map(str, answer["engines_left"]))
            context.note(f"{target.name}: engine process group {groups} still there after "
                         "SIGKILL; the next evaluation waits until it is gone")  # fmt: skip


def signal_program(machine: Machine, reader: Session, view: RunView, wait_s: float = 120) -> int:
    """SIGTERM to the program's pid (a run's rank 0: node 0's state.json); waits for the pid
    while it starts."""
    program = kinds.by_where(view.where).program
    clock = Stopwatch()
    while True:
        sent = control(machine, "signal", view.dir, signal="TERM")
        if machine.dry_run:
            return 0
        if sent.get("pid"):
            return int(sent["pid"])
        fresh = refresh(reader, view, records="none")
        if not fresh.running:
            raise OpsError(f"{view.name}: ended ({fresh.state}) before it could be stopped")
        if clock.seconds > wait_s:
            raise OpsError(f"{view.name}: no {program} process to signal after {wait_s:.0f}s")
        time.sleep(1.0)


def wait_stopped(reader: Session, view: RunView, timeout: float, *, killed: bool) -> RunView:
    """Until no node runs anything of the run (its launcher too: it records the exit code)."""
    clock = Stopwatch()
    next_note = 10.0
    run = view.name
    while True:
        view = refresh(reader, view, records="none", checkpoints=True)
        if not any(node_alive(v.raw) for v in view.nodes or [view]):
            if view.state == "failed" and not killed:
                program = kinds.by_where(view.where).program
                raise OpsError(f"{run}: the {program} failed while stopping ({view.note or ''})")
            return view
        if clock.seconds > timeout:
            raise OpsError(
                f"{run}: still running after {duration(clock.seconds)}; it may still be saving "
                f"(`dflashops logs {run}` shows what it does)"
            )
        if clock.seconds >= next_note:
            context.note(f"{run}: saving and stopping ({duration(clock.seconds)})")
            next_note += 10
        time.sleep(1.0)
