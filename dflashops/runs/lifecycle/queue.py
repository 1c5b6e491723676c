"""Queued launches (`launch RUN --host any[:ROLE]|TARGET --queue`): where none of the targets is
free, the run is claimed and prepared on one busy target (the plan checked there) and waits
there, at status "queued", in its tmux session on our server: remote/queuewait.py starts its
launcher once no other run of ours holds the target, no launch queued there before it still
waits, and nvidia-smi shows no process. A queued launch waits on one target (the targets do
not reach each other): of those of the role, the one with the fewest launches queued, then the
soonest to be done by its runs' pace, then the inventory's order. `stop RUN` cancels it,
leaving nothing behind (runctl's dequeue, under the run's lock: a run that its waiter started
meanwhile is stopped instead)."""

from __future__ import annotations

import math
import time

from dflashops import context
from dflashops.errors import OpsError
from dflashops.inventory import Target
from dflashops.remote import source as helper_source
from dflashops.runs.lifecycle.choose import Choice, holders
from dflashops.runs.lifecycle.control import control
from dflashops.runs.reading.probe import Probe
from dflashops.runs.reading.view import RunView
from dflashops.ssh.session import Session

WAITER = "queuewait.py"  # RUN_DIR/queuewait.py: the queued run's program until it starts
DEQUEUE_TRIES = 5  # runctl's lock is never waited for: the waiter holds it for a moment


def waiter_files() -> dict[str, str]:
    return {WAITER: helper_source(WAITER)}


def queue_order(choice: Choice, targets: list[Target], probes: dict[str, Probe]) -> list[Target]:
    """The busy targets of the role a launch can wait for, the one to wait for first."""
    order = {t.name: i for i, t in enumerate(targets)}

    def key(target: Target) -> tuple[int, float, int]:
        held = holders(probes[target.name])
        waiting = sum(1 for v in held if v.state == "queued")
        etas = [v.eta for v in held if v.running and v.eta is not None]
        unknown = any(v.running and v.eta is None for v in held) or not held
        return waiting, math.inf if unknown else max(etas, default=0.0), order[target.name]

    candidates = [t for t in targets if t.name in probes and t.name in choice.busy]
    return sorted(candidates, key=key)


def said(view: RunView) -> str:
    where = ", ".join(view.node_targets)
    return (f"{view.name}: queued on {where} ({view.note or 'waits for it to free'}); it "
            f"starts there when the target frees: `dflashops status` lists it, `dflashops stop "
            f"{view.name}` cancels it")  # fmt: skip


def dequeue(writer: Session, view: RunView) -> dict[str, object]:
    """Cancel a queued launch: its waiter, secrets and directory gone. {"removed": False,
    "status": ...} when its waiter started it meanwhile (the caller stops it then)."""
    machine = writer.machine(writer.inventory.target(view.target))
    for _ in range(DEQUEUE_TRIES - 1):
        try:
            return control(machine, "dequeue", view.dir, run_id=view.run_id)
        except OpsError as exc:
            if "is busy" not in exc.message:
                raise
        time.sleep(0.3)
    return control(machine, "dequeue", view.dir, run_id=view.run_id)


def cancelled_line(view: RunView) -> str:
    context.note(f"{view.name}: its waiter, secrets and directory are removed from {view.target}")
    return f"{view.name}: queued launch cancelled; nothing of it is left on {view.target}"
