"""Archiving a run: runs/RUN moved to archive/RUN on its target (every node's), pruning
checkpoints: keep the newest N complete ones and every multiple of K (the newest complete one
always stays); incomplete ones are removed. No rule: keep every complete one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflashops.runs.lifecycle.control import control
from dflashops.runs.reading.view import Checkpoint, RunView, run_dir
from dflashops.ssh.session import Session


@dataclass
class Plan:
    keep: list[Checkpoint]
    remove: list[Checkpoint]

    @property
    def freed(self) -> int:
        return sum(c.bytes for c in self.remove)


def make_plan(points: list[Checkpoint], keep_last: int | None, keep_every: int | None) -> Plan:
    complete = sorted(c.step for c in points if c.complete)
    newest = complete[-1] if complete else None
    if keep_last is None and keep_every is None:
        kept = set(complete)
    else:
        kept = set(complete[-keep_last:]) if keep_last else set()
        if keep_every:
            kept |= {s for s in complete if s % keep_every == 0}
        if newest is not None:
            kept.add(newest)
    keep = [c for c in points if c.complete and c.step in kept]
    remove = [c for c in points if not (c.complete and c.step in kept)]
    return Plan(keep, remove)


def archive_dir(writer: Session, view: RunView) -> str:
    """Where the run goes on its target."""
    return run_dir(writer.machine(view.target).target, view.name, "archive")


def archive(writer: Session, view: RunView, plan: Plan) -> dict[str, Any]:
    """Move the run on node 0, then prune there (runctl: under the run's lock, only if its
    state.json is still as it was read), then move the other nodes' directories; node 0's
    answer ({"removed", "freed", "dir"}; empty under --dry-run)."""
    done = control(
        writer.machine(view.target), "archive", view.dir, expect=view.status,
        delete=[c.name for c in plan.remove], to=archive_dir(writer, view),
    )  # fmt: skip
    for node in view.nodes[1:]:  # the other nodes of a run over several targets
        other = writer.machine(node.target)
        control(other, "archive", node.dir, expect=node.status,
                to=run_dir(other.target, view.name, "archive"))  # fmt: skip
    return done
