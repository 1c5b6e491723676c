"""Resuming a stopped or failed job of any kind (a run: from its newest complete checkpoint),
on all its nodes with the same number of processes each (or another: `--nproc`), through the same
launcher as its start (its kind's argv with resume, e.g. the trainer's --resume). It keeps the
code it ran unless told to take the workload as it is now; secrets are given again. What may
resume, and what is said, is its kind's (JobKind.check_resumable, resume_note)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from dflashops import context
from dflashops.errors import OpsError
from dflashops.inventory import Target
from dflashops.remote import layout
from dflashops.runs.evaluation.continuous import revive_server
from dflashops.runs.evaluation.continuous_kind import FOLLOW
from dflashops.runs.lifecycle import hold, kinds
from dflashops.runs.lifecycle.choose import refuse_held
from dflashops.runs.lifecycle.claim import secrets_home
from dflashops.runs.lifecycle.control import control
from dflashops.runs.lifecycle.placement import Node, Placement, new_run_id
from dflashops.runs.lifecycle.snapshot import local_code
from dflashops.runs.lifecycle.start import Started, prepare, start_all, wait_for_life
from dflashops.runs.reading.probe import probe
from dflashops.runs.reading.view import RunView
from dflashops.ssh.session import Session

# What must be so before a kind's program starts again, where the kind's module cannot do it
# (it would import what imports the kinds): a continuous eval's checkpoint server.
BEFORE: dict[str, Callable[[Session, Session, RunView], None]] = {FOLLOW.name: revive_server}


def resume(
    reader: Session,
    writer: Session,
    view: RunView,
    values: dict[str, str],
    *,
    update_code: bool,
    wait: float,
    nproc: int | None = None,
    force: bool = False,
) -> RunView | None:
    """Start `view` (read with its checkpoints and launch.json) again, with `nproc` processes
    on each node where given (the trainer reshards: workload/train/regrid.py); None under
    --dry-run."""
    kind = kinds.by_where(view.where)
    kind.check_resumable(view)
    if kind.name in BEFORE:
        BEFORE[kind.name](reader, writer, view)
    placement = placement_of(reader, view, nproc)
    if kind.name == "run" and not writer.dry_run:
        refuse_held(reader, view.name, [n.target for n in placement.nodes], force=force)
    code = local_code()
    code_dirs = {} if update_code else recorded_code(view)
    have = {n.target.name: n.target.name in code_dirs for n in placement.nodes}
    made = Started(placement)
    holder = hold.mine("resume")
    before: dict[str, dict[str, str]] = {}
    try:
        relaunch(writer, view, placement, holder, before)
        prepare(
            writer, placement, code, lambda t, c: have.get(t.name, False), {}, values, made,
            resume=True, code_dirs=code_dirs,
        )  # fmt: skip
        start_all(writer, placement)
    except BaseException:
        if not writer.dry_run:
            put_back(writer, placement, holder, before, made.secrets)
        raise
    if writer.dry_run:
        context.note("dry run: nothing was changed")
        return None
    context.note(kind.resume_note(view))
    return wait_for_life(reader, placement, timeout=wait)


def relaunch(
    writer: Session,
    view: RunView,
    placement: Placement,
    holder: dict[str, Any],
    before: dict[str, dict[str, str]],
) -> None:
    """Every node's state.json made ready for the launcher, only if it is still as it was read
    (another command that changed it meanwhile wins); what each had is kept in `before`."""
    read = {v.target: v.status for v in view.nodes or [view]}
    lived = lived_next(view, placement)
    for node in placement.nodes:
        reset = {"status": "launching", "exit_code": None, "finished": None,
                 "resumed": time.time(), "nodes": placement.record(),
                 "world_size": placement.world, "history": lived}  # fmt: skip
        answer = control(writer.machine(node.target), "relaunch", placement.dir(node),
                         state=reset, hold=holder, expect=read.get(node.target.name, {}),
                         secrets_dir=secrets_home(node.target))  # fmt: skip
        before[node.target.name] = answer.get("before") or {}


def put_back(
    writer: Session,
    placement: Placement,
    holder: dict[str, Any],
    before: dict[str, dict[str, str]],
    secrets: list[str],
) -> None:
    """A resume that failed: what it started stopped, its secrets files deleted, and each
    node's state.json (node.json, ranks) as before, where this resume still holds it."""
    for node in placement.nodes:
        machine = writer.machine(node.target)
        mine = [p for p in secrets if p.startswith(secrets_home(node.target) + "/")]
        try:
            if node.target.name in before:
                control(machine, "kill", placement.dir(node))
            control(machine, "restore", placement.dir(node), token=holder["token"], files=mine,
                    before=before.get(node.target.name, {}))  # fmt: skip
        except OpsError as exc:
            context.note(f"{node.target.name}: could not put back {placement.dir(node)}: "
                         f"{exc.message}")  # fmt: skip


def lived_next(view: RunView, placement: Placement) -> list[dict[str, Any]]:
    """The run's history with `placement` from its newest complete checkpoint on, where it
    moves or changes its number of processes."""
    steps = view.complete_steps()
    lived = history(view)
    now = placement.lived(max(steps) if steps else 0)
    if [lived[-1][k] for k in ("targets", "nproc")] != [now[k] for k in ("targets", "nproc")]:
        lived = [*lived, now]
    return lived


def history(view: RunView) -> list[dict[str, Any]]:
    """Where the run has lived (state.json's "history"; a run from before it kept one: where
    it was launched, as it recorded it)."""
    kept = view.status.get("history")
    if isinstance(kept, list):
        return kept
    recorded = view.status.get("nodes") or [{"target": view.target, "nproc": None}]
    world = view.status.get("world_size") or 1
    return [{"targets": [n["target"] for n in recorded],
             "nproc": [n.get("nproc") or world for n in recorded], "world_size": world,
             "from_step": 0, "time": view.status.get("launched")}]  # fmt: skip


def placement_of(
    reader: Session, view: RunView, nproc: int | None = None, targets: list[Target] | None = None
) -> Placement:
    """The run's nodes as it recorded them (same targets, the same processes each unless
    `nproc` says how many), or on `targets` (a move: node 0's processes each, unless `nproc`),
    with a new rendezvous port on node 0."""
    recorded = view.status.get("nodes") or [{"target": view.target, "nproc": None}]
    if targets is not None:
        recorded = [{**recorded[0], "target": t.name} for t in targets]
    nodes = []
    for index, item in enumerate(recorded):
        target = reader.inventory.target(item["target"])
        count = nproc or item.get("nproc") or view.status.get("world_size") or 1
        nodes.append(Node(index, target, int(count)))
    kind = kinds.by_where(view.where)
    placement = Placement(kind, view.name, view.run_id or new_run_id(), nodes)
    if placement.multi:
        first = nodes[0].target
        answer = probe(reader.machine(first), names=[], free_port=first.node_address)
        placement.port = answer.free_port
    return placement


def recorded_code(view: RunView) -> dict[str, str]:
    """Each node's code snapshot, as its launch.json names it (runs from before snapshots
    have none: they take the workload as it is now)."""
    out = {}
    for node in view.nodes or [view]:
        text = (node.raw.get("files") or {}).get(layout.LAUNCH_FILE)
        try:
            code = json.loads(text).get("code") if text else None
        except ValueError:
            code = None
        if code:
            out[node.target] = code
    return out
