"""Copying a complete checkpoint to another target (`pull-ckpt`, and `eval` before it evaluates).

The source's `tar -c` stdout feeds the destination's receiver (remote/receive.py) through this
process, with no temporary copy on any disk. It lands in the destination's one partial
directory for that checkpoint (<ws>/ckpts/RUN/.partial-step_STEP), where every file is checked
against the checkpoint's own MANIFEST.sha256 (hashed from the destination's disk) as it lands;
only once all of them verify is it renamed to <ws>/ckpts/RUN/step_STEP (never into it), with
the run's run.yaml beside it. A copy cut short (a lost link, Ctrl-C) resumes: the files that
verified are not sent again. Pulling again is free when the copy there still verifies.
"""

from __future__ import annotations

import json
import posixpath
import tempfile
from pathlib import Path
from typing import Any

from dflashops import context, transfer
from dflashops import remote as helpers
from dflashops.errors import NotFoundError, OpsError, TransferError, UsageError
from dflashops.inventory import Target
from dflashops.relay import Relayed, relay
from dflashops.remote.layout import CHECKPOINTS, MANIFEST, RUN_CONFIG
from dflashops.render import Stopwatch, human_bytes, progress
from dflashops.runs.reading.probe import probe
from dflashops.runs.reading.survey import reread
from dflashops.runs.reading.view import Checkpoint, RunView, ckpt_copy_dir
from dflashops.ssh.session import Session
from dflashops.targets.base import Machine
from dflashops.transfer import Progress


def find_checkpoint(view: RunView, step: int) -> Checkpoint:
    points = view.checkpoints
    match = next((c for c in points if c.step == step and not c.temporary), None)
    if match is None:
        complete = [str(c.step) for c in points if c.complete]
        listed = ", ".join(complete) if complete else "none"
        raise NotFoundError(f"{view.name} has no checkpoint step_{step} (complete steps: {listed})")
    if not match.complete:
        raise UsageError(
            f"{view.name} step_{step} is incomplete (no {MANIFEST}): still being written or cut "
            "short; nothing copies it"
        )
    if match.entries is None:
        raise TransferError(
            f"{view.name} step_{step}: its {MANIFEST} is empty or not in sha256sum format; "
            "nothing copies it"
        )
    return match


def partial_dir(final: str) -> str:
    """The one partial directory of a checkpoint's copy, hidden beside it."""
    return posixpath.join(posixpath.dirname(final), f".partial-{posixpath.basename(final)}")


def pull(
    reader: Session, writer: Session, view: RunView, step: int, dest: Target
) -> dict[str, Any]:
    """Make <ws>/ckpts/RUN/step_STEP on `dest` a verified copy; returns what was done."""
    view = reread(
        reader.machine(view.target), view.name, records="none", checkpoints=True, files=[RUN_CONFIG]
    )
    ckpt = find_checkpoint(view, step)
    manifest, entries = ckpt.manifest or "", ckpt.entries or {}
    final = ckpt_copy_dir(dest, view.name, step)
    report = {"run": view.name, "step": step, "from": view.target, "to": dest.name, "dest": final}
    there = probe(reader.machine(dest), dirs=[final], verify=True).dirs.get(final, {})
    if there.get("exists") and there.get("verified") and there.get("manifest") == manifest:
        return {**report, "copied": False, "files": ckpt.files, "bytes": ckpt.bytes, "seconds": 0}
    if there.get("exists"):
        why = there.get("problem") or "a different checkpoint"
        context.note(f"{dest.name}:{final} is there but does not verify ({why}); copying again")
    clock = Stopwatch()
    partial = partial_dir(final)
    head = json.dumps({"manifest": manifest}).encode() + b"\n"
    earlier = helpers.run(reader.machine(dest), "receive.py", partial, "--plan", final,
                          stdin=head, what=f"reading {partial}")  # fmt: skip
    kept = json.loads(earlier.stdout) if earlier.stdout else {"verified": [], "bytes": 0}
    names = [n for n in sorted(entries) if n not in kept["verified"]]
    src, dst = writer.machine(view.target), writer.machine(dest)
    src_dir = posixpath.join(view.dir, CHECKPOINTS, ckpt.name)
    sent = [0]

    def count(n: int) -> None:
        sent[0] += n
        advance(n)

    with progress(f"{view.name} step_{step} -> {dest.name}", ckpt.bytes - kept["bytes"]) as advance:
        done = send(src, src_dir, names, dst, partial, final, head, count)
    run_yaml = (view.raw.get("files") or {}).get(RUN_CONFIG)
    if not dst.dry_run:
        placed = check_placed(done, entries, dest.name, final, partial)
        for gone in done.get("stale") or []:
            context.note(
                f"{dest.name}: removed {gone['path']} ({human_bytes(gone['bytes'])}), a partial "
                "copy nobody had touched for a day"
            )
        if placed == "already":
            context.note(f"{dest.name}:{final} was put in place by another pull meanwhile")
            return {**report, "copied": False, "files": ckpt.files, "bytes": ckpt.bytes,
                    "seconds": round(clock.seconds, 3)}  # fmt: skip
    beside(dst, final, run_yaml)
    return {**report, "copied": True, "files": len(entries), "bytes": ckpt.bytes,
            "sent_bytes": sent[0], "kept_files": len(entries) - len(names),
            "seconds": round(clock.seconds, 3),
            "verified": "sha256 against MANIFEST.sha256"}  # fmt: skip


def send(
    src: Machine,
    src_dir: str,
    names: list[str],
    dst: Machine,
    partial: str,
    final: str,
    head: bytes,
    advance: Progress,
) -> dict[str, Any]:
    """`tar -c` of `names` in `src` piped into the checkpoint receiver in `dst`; its report.
    With nothing left to send (all verified by an earlier try), the receiver only places it."""
    receive = helpers.argv("receive.py", partial, "--checkpoint", final)
    if names:
        tar = ["tar", "-C", src_dir, "--format=pax", "-cf", "-", "--", *names]
        relayed = relay(src, tar, dst, receive, head=head, progress=advance)
    else:
        received = transfer.stream(dst, receive, stdin=head + b"\0" * 1024)
        relayed = Relayed(received, None, None)
    if dst.dry_run:
        return {}
    if relayed.received.ok:
        return json.loads(relayed.received.stdout)
    if relayed.error is not None:
        raise relayed.error
    if relayed.sent is not None and not relayed.sent.ok:
        raise TransferError(f"{src.name}: tar of {src_dir} failed: {relayed.sent.error_text}")
    if relayed.received.returncode == 127:
        raise OpsError(f"{dst.name}: python3 not found; install it in the target")
    text = relayed.received.error_text.removeprefix("receive: ")
    if text.startswith("no space left"):
        raise TransferError(f"{dst.name}: {text}")
    raise TransferError(f"{dst.name}: receiving into {partial} failed: {text}")


def check_placed(
    done: dict[str, Any], entries: dict[str, str], target: str, final: str, partial: str
) -> bool | str:
    """The receiver's report says every manifest entry arrived with its hash (hashed from the
    destination's disk) and the copy is in place (True), or was put there by another pull
    ("already")."""
    verified = done.get("verified") or {}
    if done.get("placed") not in (True, "already"):
        bad = done.get("bad") or []
        missing = sorted(set(entries) - set(verified) - set(bad))
        raise TransferError(
            f"{target}: the copy to {final} does not match its {MANIFEST} "
            f"({', '.join(bad + missing)}); what verifies ({len(verified)} of {len(entries)} "
            f"files) is kept in {partial} for the next try: run it again"
        )
    if verified != entries:
        raise TransferError(
            f"{target}: the receiver placed {final} but reported hashes that do not match its "
            f"{MANIFEST}; do not use it: run pull-ckpt again"
        )
    return done["placed"]


def beside(machine: Machine, final: str, run_yaml: str | None) -> None:
    """The run's run.yaml beside the checkpoint's copy."""
    if run_yaml is None:
        context.note(f"warning: the run has no run.yaml; none put beside {final}")
        return
    with tempfile.TemporaryDirectory(prefix="dflashops-pull-") as local:
        path = Path(local) / RUN_CONFIG
        path.write_text(run_yaml)
        transfer.put(machine, path, posixpath.join(posixpath.dirname(final), RUN_CONFIG))
