"""Resuming a stopped or failed job of any kind (a run: from its newest complete checkpoint),
on all its nodes with the same number of processes each (the same world size), through the same
launcher as its start (its kind's argv with resume, e.g. the trainer's --resume). It keeps the
code it ran unless told to take the workload as it is now; secrets are given again. What may
resume, and what is said, is its kind's (JobKind.check_resumable, resume_note)."""

from __future__ import annotations

import json
import time

from dflashops import context
from dflashops.runs import kinds
from dflashops.runs.control import control
from dflashops.runs.placement import Node, Placement, new_run_id
from dflashops.runs.probe import probe
from dflashops.runs.snapshot import local_code
from dflashops.runs.start import Started, prepare, start_all, wait_for_life
from dflashops.runs.view import RunView
from dflashops.ssh.session import Session


def resume(
    reader: Session,
    writer: Session,
    view: RunView,
    values: dict[str, str],
    *,
    update_code: bool,
    wait: float,
) -> RunView | None:
    """Start `view` (read with its checkpoints and launch.json) again; None under --dry-run."""
    kind = kinds.by_where(view.where)
    kind.check_resumable(view)
    placement = placement_of(reader, view)
    code = local_code()
    code_dirs = {} if update_code else recorded_code(view)
    have = {n.target.name: n.target.name in code_dirs for n in placement.nodes}
    made = Started(placement)
    for node in placement.nodes:
        reset = {"status": "launching", "exit_code": None, "finished": None,
                 "resumed": time.time()}  # fmt: skip
        control(writer.machine(node.target), "relaunch", placement.dir(node), **reset)
    prepare(
        writer, placement, code, lambda t, c: have.get(t.name, False), {}, values, made,
        resume=True, code_dirs=code_dirs,
    )  # fmt: skip
    start_all(writer, placement)
    if writer.dry_run:
        context.note("dry run: nothing was changed")
        return None
    context.note(kind.resume_note(view))
    return wait_for_life(reader, placement, timeout=wait)


def placement_of(reader: Session, view: RunView) -> Placement:
    """The run's nodes as it recorded them (same targets, same processes each), with a new
    rendezvous port on node 0."""
    recorded = view.status.get("nodes") or [{"target": view.target, "nproc": None}]
    nodes = []
    for index, item in enumerate(recorded):
        target = reader.inventory.target(item["target"])
        nproc = item.get("nproc") or view.status.get("world_size") or 1
        nodes.append(Node(index, target, int(nproc)))
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
        text = (node.raw.get("files") or {}).get("launch.json")
        try:
            code = json.loads(text).get("code") if text else None
        except ValueError:
            code = None
        if code:
            out[node.target] = code
    return out
