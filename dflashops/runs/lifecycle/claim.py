"""Claiming a run's name: its directory made on every node, atomically per target (mkdir), then
settled with any launch of the same name elsewhere, so that two launches of one name cannot
both win; and taking back what a launch made when it fails."""

from __future__ import annotations

import contextlib
import posixpath
import secrets as random_tokens
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from dflashops import bundle, context
from dflashops.errors import OpsError, UnreachableError, UsageError
from dflashops.inventory import Target
from dflashops.runs.lifecycle import hold
from dflashops.runs.lifecycle.choose import PassedOver, holders
from dflashops.runs.lifecycle.control import control
from dflashops.runs.lifecycle.placement import Node, Placement
from dflashops.runs.reading.survey import place, survey
from dflashops.runs.reading.view import RunView, tmux_session
from dflashops.ssh.session import Session

CLAIM_WAIT_S = 30.0
SECRETS_HOME = "secrets"  # <ws>/dflashops/secrets/: read and deleted by the launcher


def secrets_home(target: Target) -> str:
    return posixpath.join(target.workspace, bundle.REMOTE_HOME, SECRETS_HOME)


def claim_key(view: RunView) -> tuple[float, str] | None:
    claim = view.status.get("claim") or {}
    if not isinstance(claim.get("t"), (int, float)):
        return None
    return float(claim["t"]), str(claim.get("nonce", ""))


def taken_error(run: str, views: Iterable[RunView]) -> UsageError:
    shown = ", ".join(f"{v.target}:{place(v)} ({v.state})" for v in views)
    return UsageError(
        f"run name {run!r} is taken ({shown}); choose another name, or resume it with "
        f"`dflashops resume {run}`"
    )


def claim(reader: Session, writer: Session, placement: Placement) -> dict[str, Any]:
    """Make the run directory on every node, atomically per target (mkdir), then settle with
    any launch of the same name elsewhere: two launches of one name cannot both win.

    A rival that has committed wins; of two rivals still claiming, the earlier claim (time,
    then a random nonce: both sides order the pair the same way) waits for the later to back
    off, and the later backs off at once. A claim carries its holder (runs/lifecycle/hold.py): a launch
    cut short before its launcher started is swept by the next one. A failed claim, or one
    interrupted (Ctrl-C, SIGTERM, SIGHUP), takes back what it made."""
    mine = {"t": time.time(), "nonce": random_tokens.token_hex(4)}
    made: list[Node] = []
    holder = hold.mine("launch")
    try:
        for node in placement.nodes:
            state = initial_state(placement, node, status="claiming", claim=mine, hold=holder)
            made.append(node)  # before its answer: cut short, the take-back checks the run id
            answer = claim_node(writer, placement, node, state)
            if answer.get("taken") is not None:
                made.pop()  # another's: never taken back
                raise UsageError(
                    f"{placement.kind.noun} name {placement.run!r} is taken: {node.target.name}:"
                    f"{placement.dir(node)} exists; choose another name"
                )
        if not writer.dry_run and placement.kind.global_names:
            settle(reader, placement, (mine["t"], mine["nonce"]))
        if not writer.dry_run and placement.exclusive:
            settle_targets(reader, placement, (mine["t"], mine["nonce"]))
        for node in placement.nodes:
            control(
                writer.machine(node.target),
                "commit",
                placement.dir(node),
                run_id=placement.run_id,
            )
    except BaseException:
        take_back(writer, placement, made)
        raise
    return holder


@contextlib.contextmanager
def lease_kept(writer: Session, placement: Placement, holder: dict[str, Any]) -> Iterator[None]:
    """The claim's lease renewed on every node (a third of it at a time) while the body works:
    a long start (a large input pushed, then checked) is never taken for one cut short."""
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(float(holder["lease_s"]) / 3):
            for node in placement.nodes:
                with contextlib.suppress(OpsError):  # a blip: the next renewal may pass
                    control(writer.machine(node.target), "renew", placement.dir(node),
                            token=holder["token"])  # fmt: skip

    thread = threading.Thread(target=renew, name=f"lease-{placement.run}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=60)


def claim_node(
    writer: Session, placement: Placement, node: Node, state: dict[str, Any]
) -> dict[str, Any]:
    """runctl's claim on one node; a launch cut short found there is swept, and claimed again."""
    machine = writer.machine(node.target)
    answer = control(machine, "claim", placement.dir(node), **state)
    taken = answer.get("taken")
    raw = {"state": taken, "node": answer.get("started")}
    if taken is None or not hold.abandoned(raw, float(answer.get("now", 0))):
        return answer
    sweep(writer, node.target, placement.dir(node), taken)
    return control(machine, "claim", placement.dir(node), **state)


def sweep(writer: Session, target: Target, path: str, state: dict[str, Any]) -> None:
    """Delete a launch cut short (its run directory and secrets files), if still that one."""
    token = (state.get("hold") or {}).get("token")
    done = control(writer.machine(target), "sweep", path, run_id=state.get("run_id"),
                   token=token, secrets_dir=secrets_home(target))  # fmt: skip
    if done.get("swept"):
        context.note(f"{target.name}: removed {path}, a launch cut short")


def sweep_abandoned(writer: Session, views: Iterable[RunView]) -> None:
    """The launches cut short found by a read (every node of each)."""
    for view in views:
        for node in view.nodes or [view]:
            sweep(writer, writer.inventory.target(node.target), node.dir, node.status)


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
        found = survey(reader, names=[run], archive=True, records="none")
        own = {n.target.name for n in placement.nodes}
        refuse_unread(run, {t: e for t, e in found.errors.items() if t in own})
        rivals = [v for v in found.runs() if v.name == run and v.run_id != placement.run_id
                  and v.state != "abandoned"]  # fmt: skip
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


def settle_targets(reader: Session, placement: Placement, mine: tuple[float, str]) -> None:
    """The same rules as `settle`, for the run's targets instead of its name: any other run
    claiming, starting or running on one of them holds its GPUs (its CPU, without GPUs), so
    of two launches onto one target at once only one goes on; the other is passed over there."""
    run = placement.run
    own = [n.target for n in placement.nodes]
    waited = time.monotonic()
    while True:
        found = survey(reader, own, records="none")
        refuse_unread(run, found.errors)
        rivals = [v for p in found.probes.values() for v in holders(p)
                  if (v.name, v.run_id) != (run, placement.run_id)]  # fmt: skip
        if not rivals:
            return
        settled = [v for v in rivals if v.status.get("status") != "claiming"]
        keys = [claim_key(v) for v in rivals]
        if (
            settled
            or any(k is None or k < mine for k in keys)
            or (time.monotonic() - waited > CLAIM_WAIT_S)
        ):
            v = (settled or rivals)[0]
            why = f"taken by run {v.name} ({v.state}), launched at the same time"
            if v.state == "queued":
                why = f"run {v.name} is queued for it"
            raise PassedOver(f"{v.target} is busy: {why}", why, busy=True)
        time.sleep(0.5)


def initial_state(placement: Placement, node: Node, **extra: Any) -> dict[str, Any]:
    return {
        "run_id": placement.run_id,
        "node": node.index,
        "nodes": placement.record(),
        "world_size": placement.world,
        "history": [placement.lived(0)],
        "tmux": tmux_session(placement.run),
        "launched": time.time(),
        "target": node.target.name,
        **placement.state,
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
            control(machine, "kill", placement.dir(node))
            control(machine, "remove", placement.dir(node), run_id=placement.run_id,
                    files=extra)  # fmt: skip
        except OpsError as exc:
            context.note(f"{node.target.name}: could not take back {placement.dir(node)}: "
                         f"{exc.message}")  # fmt: skip
