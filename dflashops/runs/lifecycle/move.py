"""Moving a stopped or failed training run to other targets (`resume RUN --host T[,T...]`),
to continue there from its newest complete checkpoint.

In order: the run's name claimed on the new targets (claim.py: mkdir, then settled with any
launch of the name elsewhere; the run keeps its id, so its own old copy is no rival); the
checkpoint copied into node 0's <ws>/runs/RUN/checkpoints/step_N by the verified copy path of
pull-ckpt (pulls.send: through pull-ckpt's partial directory <ws>/ckpts/RUN/.partial-step_N,
every file checked against MANIFEST.sha256, renamed into place once whole; a move cut short
leaves the files that verified there, as a pull does, and the next try sends only the rest), and the run's own files (run.yaml, train_log.jsonl, ...) beside it; the
code snapshot the run ran copied too (unless --update-code), and each new node's state.json
made the run's (held as a resume). Then the old copy is set aside, a rename under the run's
lock, only if its state.json is still as it was read: of two commands racing to move or resume
the run, only the first to set it aside goes on. It lands in <ws>/runs/.moved-RUN-TIME (hidden:
no probe lists it, so the name stays unique among targets; delete it once the run is safe
elsewhere). Then the launcher starts on the new targets.

A failure anywhere takes back what was made on the new targets (their run directories) and
renames the old copy back: the run is left where it was, whole. Older checkpoints and the compile cache stay behind (the
new target compiles at its first step, then caches in its own workspace).
"""

from __future__ import annotations

import contextlib
import json
import posixpath
import secrets as random_tokens
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dflashops import bundle, context
from dflashops import remote as helpers
from dflashops.errors import NotFoundError, OpsError, TransferError, UsageError
from dflashops.inventory import Target
from dflashops.relay import relay
from dflashops.remote import layout
from dflashops.render import Stopwatch, human_bytes, progress
from dflashops.runs.evaluation.pulls import check_placed, find_checkpoint, partial_dir, send
from dflashops.runs.lifecycle import kinds
from dflashops.runs.lifecycle.choose import refuse_held
from dflashops.runs.lifecycle.claim import claim, lease_kept, secrets_home, take_back
from dflashops.runs.lifecycle.control import control
from dflashops.runs.lifecycle.placement import Placement
from dflashops.runs.lifecycle.resume import lived_next, placement_of, recorded_code
from dflashops.runs.lifecycle.snapshot import CODE_HOME, local_code
from dflashops.runs.lifecycle.start import Started, prepare, start_all, wait_for_life
from dflashops.runs.reading.probe import probe
from dflashops.runs.reading.survey import choose, survey
from dflashops.runs.reading.view import RunView, check_name, ckpt_copy_dir
from dflashops.ssh.session import Session
from dflashops.targets.base import Machine

MOVED = ".moved-"  # <ws>/runs/.moved-RUN-TIME: a moved run's old copy, hidden from the probes
# what a run directory holds that the trainer and the readers need after a move (state.json is
# written anew; launch.json, node.json and the ranks' records at every start)
CARRIED = (layout.RUN_CONFIG, layout.RESOLVED_CONFIG, layout.AUDIT_FILE, layout.PLAN_FILE,
           layout.TRAIN_LOG, layout.CONSOLE_LOG)  # fmt: skip
FRESH = ("hold", "claim", "target", "node")  # state.json's keys that are each node's own


@dataclass
class Moving:
    """What a move made so far, to take it back, and what it measured."""

    placement: Placement
    step: int
    aside: dict[str, str] = field(default_factory=dict)  # old target -> where its copy went
    bytes: int = 0  # sent
    kept: int = 0  # of the checkpoint, verified in its partial copy by an earlier try
    clock: Stopwatch = field(default_factory=Stopwatch)


def locate(reader: Session, run: str, hosts: list[str], **request: Any) -> RunView:
    """The run called `run`: on the first of `hosts` where the name exists there (it resumes
    there), else wherever it is (it moves to `hosts`)."""
    check_name(run)
    found = survey(reader, names=[run], archive=True, **request)
    if hosts:
        with contextlib.suppress(NotFoundError):
            return choose(reader, found, run, hosts[0])
    return choose(reader, found, run, None)


def moves(view: RunView, targets: list[Target]) -> bool:
    """`--host` names a target the run does not live on (one it lives on only picks it)."""
    return not {t.name for t in targets} <= set(view.node_targets)


def move(
    reader: Session,
    writer: Session,
    view: RunView,
    targets: list[Target],
    values: dict[str, str],
    *,
    nproc: int | None,
    update_code: bool,
    wait: float,
    force: bool = False,
) -> RunView | None:
    """Continue `view` (read with its checkpoints, launch.json and run.yaml) on `targets` from
    its newest complete checkpoint; None under --dry-run."""
    kind = kinds.by_where(view.where)
    if kind.name != "run":
        raise UsageError(f"{view.name} is a {kind.noun}; only a training run moves to another "
                         "target (resume it where it is: drop --host)")  # fmt: skip
    kind.check_resumable(view)
    shared = sorted(set(view.node_targets) & {t.name for t in targets})
    if shared:
        raise UsageError(f"--host: {', '.join(shared)} holds {view.name} already; a move goes to "
                         f"targets that do not (to change only its number of processes: "
                         f"`dflashops resume {view.name} --nproc N`)")  # fmt: skip
    steps = view.complete_steps()
    if not steps:
        raise UsageError(f"{view.name} has no complete checkpoint to move; launch it again")
    ckpt = find_checkpoint(view, max(steps))
    placement = placement_of(reader, view, nproc, targets)
    if not writer.dry_run:
        refuse_held(reader, view.name, targets, force=force)
    said = f"{view.name}: moving from {', '.join(view.node_targets)} to {placement.describe()}"
    context.note(f"{said}, from step_{ckpt.step} ({human_bytes(ckpt.bytes)})")
    if writer.dry_run:
        context.note("dry run: nothing was changed")
        return None
    done = Moving(placement, ckpt.step)
    holder = claim(reader, writer, placement)
    made = Started(placement)
    try:
        with lease_kept(writer, placement, holder):
            carry(writer, view, done)
            code_dirs = {} if update_code else carry_code(reader, writer, view, placement)
        ready(writer, view, placement, {**holder, "verb": "resume"})
        set_aside(writer, view, done)
        have = {name: True for name in code_dirs}
        prepare(writer, placement, local_code(), lambda t, c: have.get(t.name, False), {},
                values, made, resume=True, code_dirs=code_dirs)  # fmt: skip
        start_all(writer, placement)
    except BaseException:
        take_back(writer, placement, placement.nodes, made.secrets)
        put_back(writer, view, done)
        raise
    earlier = f", {human_bytes(done.kept)} kept from an earlier try" if done.kept else ""
    context.note(f"{view.name}: moved to {', '.join(t.name for t in targets)} in "
                 f"{done.clock.seconds:.1f} s ({human_bytes(done.bytes)} copied{earlier}); the "
                 f"old copy is kept at {', '.join(f'{t}:{p}' for t, p in done.aside.items())}")  # fmt: skip
    context.note(kind.resume_note(view))
    return wait_for_life(reader, placement, timeout=wait)


def carry(writer: Session, view: RunView, done: Moving) -> None:
    """The run's files to every new node, and its newest complete checkpoint to node 0."""
    src = writer.machine(writer.inventory.target(view.target))
    carry_files(writer, src, view, done)
    carry_checkpoint(writer, src, view, done)


def carry_files(writer: Session, src: Machine, view: RunView, done: Moving) -> None:
    for node in done.placement.nodes:
        dst = writer.machine(node.target)
        tar = ["tar", "-C", view.dir, "--ignore-failed-read", "--format=pax", "-cf", "-", "--",
               *CARRIED]  # fmt: skip
        counted = relay(src, tar, dst, helpers.argv("receive.py", done.placement.dir(node),
                                                    "--unsealed"), progress=counter(done))  # fmt: skip
        failed(counted, src, dst, "the run's files")


def carry_checkpoint(writer: Session, src: Machine, view: RunView, done: Moving) -> None:
    """Through pull-ckpt's partial directory, where an earlier try's verified files are kept."""
    head = done.placement.nodes[0]
    dst = writer.machine(head.target)
    ckpt = find_checkpoint(view, done.step)
    final = posixpath.join(done.placement.dir(head), layout.CHECKPOINTS, ckpt.name)
    partial = partial_dir(ckpt_copy_dir(head.target, view.name, ckpt.step))  # pull-ckpt's
    line = json.dumps({"manifest": ckpt.manifest or ""}).encode() + b"\n"
    earlier = helpers.run(dst, "receive.py", partial, "--plan", final, stdin=line,
                          what=f"reading {partial}")  # fmt: skip
    kept = json.loads(earlier.stdout) if earlier.stdout else {"verified": [], "bytes": 0}
    done.kept = kept["bytes"]
    names = [n for n in sorted(ckpt.entries or {}) if n not in kept["verified"]]
    made = dst.run(["mkdir", "-p", "--", posixpath.dirname(final)])
    if not made.ok and not dst.dry_run:
        raise OpsError(f"{dst.name}: mkdir {posixpath.dirname(final)}: {made.error_text}")
    src_dir = posixpath.join(view.dir, layout.CHECKPOINTS, ckpt.name)
    label = f"{view.name} step_{ckpt.step} -> {head.target.name}"
    with progress(label, ckpt.bytes - done.kept) as advance:

        def count(n: int) -> None:
            done.bytes += n
            advance(n)

        report = send(src, src_dir, names, dst, partial, final, line, count)
    check_placed(report, ckpt.entries or {}, head.target.name, final, partial)


def counter(done: Moving) -> Callable[[int], None]:
    def count(n: int) -> None:
        done.bytes += n

    return count


def failed(relayed: Any, src: Machine, dst: Machine, what: str) -> None:
    """One line for a relay that did not arrive whole."""
    if dst.dry_run:
        return
    if relayed.error is not None:
        raise relayed.error
    if relayed.sent is not None and not relayed.sent.ok:
        raise TransferError(f"{src.name}: tar of {what} failed: {relayed.sent.error_text}")
    if not relayed.received.ok:
        text = relayed.received.error_text.removeprefix("receive: ")
        raise TransferError(f"{dst.name}: receiving {what} failed: {text}")


def carry_code(
    reader: Session, writer: Session, view: RunView, placement: Placement
) -> dict[str, str]:
    """The code snapshot the run ran, on every new node (sent once: snapshots never change);
    a run from before snapshots has none (it takes the workload as it is now)."""
    old = recorded_code(view).get(view.target)
    if not old:
        return {}
    src = writer.machine(writer.inventory.target(view.target))
    out = {}
    for node in placement.nodes:
        final = posixpath.join(node.target.workspace, bundle.REMOTE_HOME, CODE_HOME,
                               posixpath.basename(old))  # fmt: skip
        dst = writer.machine(node.target)
        if not probe(reader.machine(node.target), dirs=[final]).dirs.get(final, {}).get("exists"):
            tmp = f"{final}.tmp-{random_tokens.token_hex(4)}"
            tar = ["tar", "-C", old, "--format=pax", "-cf", "-", "."]
            try:
                sent = relay(src, tar, dst, helpers.argv("receive.py", tmp, "--unsealed"))
                failed(sent, src, dst, f"the code snapshot {posixpath.basename(old)}")
            except BaseException:
                control(dst, "discard", tmp)
                raise
            control(dst, "publish", final, **{"from": tmp})
        out[node.target.name] = final
    return out


def aside_dir(view: RunView, node_dir: str) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return posixpath.join(posixpath.dirname(node_dir), f"{MOVED}{view.name}-{stamp}")


def set_aside(writer: Session, view: RunView, done: Moving) -> None:
    """Every old node's copy renamed out of the name's way, only if still as it was read."""
    for node in view.nodes or [view]:
        to = aside_dir(view, node.dir)
        control(writer.machine(writer.inventory.target(node.target)), "archive", node.dir,
                expect=node.status, to=to)  # fmt: skip
        done.aside[node.target] = to


def put_back(writer: Session, view: RunView, done: Moving) -> None:
    """A move that failed: each old copy set aside renamed back where it was."""
    for node in view.nodes or [view]:
        if node.target not in done.aside:
            continue
        machine = writer.machine(writer.inventory.target(node.target))
        try:
            control(machine, "archive", done.aside[node.target], expect=node.status,
                    to=node.dir)  # fmt: skip
        except OpsError as exc:
            context.note(f"{node.target}: could not put {done.aside[node.target]} back at "
                         f"{node.dir}: {exc.message}; rename it by hand")  # fmt: skip


def ready(writer: Session, view: RunView, placement: Placement, holder: dict[str, Any]) -> None:
    """Each new node's state.json: the run's as it was (its id, times, last step), with where
    it lives now and its history; held as a resume from now on (one cut short is a failed
    run there, resumed again, never an abandoned launch whose directory a later one sweeps)."""
    lived = lived_next(view, placement)
    kept = {k: v for k, v in view.status.items() if k not in FRESH}
    for node in placement.nodes:
        state = {**kept, "status": "launching", "exit_code": None, "finished": None,
                 "resumed": time.time(), "nodes": placement.record(), "node": node.index,
                 "target": node.target.name, "world_size": placement.world,
                 "history": lived}  # fmt: skip
        control(writer.machine(node.target), "relaunch", placement.dir(node), state=state,
                hold=holder, secrets_dir=secrets_home(node.target))  # fmt: skip
