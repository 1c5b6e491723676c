"""`pull-ckpt STEP --to TARGET [--run RUN]`: copy a complete checkpoint to another target.

The source's `tar -c` stdout feeds the destination's receiver (remote/receive.py) through this
process, with no temporary copy on any disk; it lands in a temporary directory, every file is
checked against the checkpoint's own MANIFEST.sha256 (hashed from the destination's disk), and
only then is it renamed to <ws>/ckpts/RUN/step_STEP, with the run's run.yaml beside it.
Pulling again is free when the copy there still verifies.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import queue
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any

import typer

from dflashops import context, runs, transfer
from dflashops.errors import NotFoundError, OpsError, TransferError, UsageError
from dflashops.inventory import Target
from dflashops.remote import argv as helper_argv
from dflashops.render import Stopwatch, human_bytes, progress
from dflashops.runs import Checkpoint, RunView
from dflashops.session import Session
from dflashops.targets.base import Machine, Result

MANIFEST = "MANIFEST.sha256"


def register(app: typer.Typer) -> None:
    @app.command("pull-ckpt")
    @context.command
    def pull_ckpt(
        ctx: typer.Context,
        step: int = typer.Argument(
            ..., metavar="STEP", help="The checkpoint's step (checkpoints/step_STEP)."
        ),
        to: str = typer.Option(..., "--to", metavar="TARGET", help="The target to copy it to."),
        run: str = typer.Option(
            None, "--run", metavar="RUN", help="The run (default: the newest running one)."
        ),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON document."),
    ) -> None:
        """Copy a run's checkpoint to <ws>/ckpts/RUN/step_STEP on TARGET, verified."""
        opts = context.get(ctx)
        as_json = opts.want_json(json_out)
        dest = opts.inventory().target(to)
        with runs.sessions(opts) as (reader, writer):
            view = runs.resolve(reader, run, records="none")
            done = pull(reader, writer, view, step, dest)
        if opts.dry_run:
            runs.dry_run_done(opts, **done)
            return
        if as_json:
            opts.emit(done)
        elif not done["copied"]:
            context.say(
                f"{view.name} step_{step}: already on {dest.name} at {done['dest']} "
                "and it verifies against its MANIFEST.sha256; nothing copied"
            )
        else:
            rate = done["bytes"] / done["seconds"] if done["seconds"] else 0
            context.say(
                f"{view.name} step_{step}: {view.target} -> {dest.name}:{done['dest']}, "
                f"{done['files']} files, {human_bytes(done['bytes'])} in {done['seconds']:.1f}s "
                f"({human_bytes(rate)}/s), verified against MANIFEST.sha256"
            )


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


def pull(
    reader: Session, writer: Session, view: RunView, step: int, dest: Target
) -> dict[str, Any]:
    """Make <ws>/ckpts/RUN/step_STEP on `dest` a verified copy; returns what was done."""
    view = runs.reread(
        reader.machine(view.target), view.name, records="none", checkpoints=True, files=["run.yaml"]
    )
    ckpt = find_checkpoint(view, step)
    manifest, entries = ckpt.manifest or "", ckpt.entries
    final = runs.ckpt_copy_dir(dest, view.name, step)
    report = {"run": view.name, "step": step, "from": view.target, "to": dest.name, "dest": final}
    there = runs.probe(reader.machine(dest), dirs=[final], verify=True).dirs.get(final, {})
    if there.get("exists") and there.get("verified") and there.get("manifest") == manifest:
        return {**report, "copied": False, "files": ckpt.files, "bytes": ckpt.bytes, "seconds": 0}
    if there.get("exists"):
        why = there.get("problem") or "a different checkpoint"
        context.note(f"{dest.name}:{final} is there but does not verify ({why}); copying again")
    clock = Stopwatch()
    src_dir = posixpath.join(view.dir, "checkpoints", ckpt.name)
    names = sorted(entries) + [MANIFEST]
    tmp = posixpath.join(posixpath.dirname(final), f".tmp-{ckpt.name}-{uuid.uuid4().hex[:8]}")
    src, dst = writer.machine(view.target), writer.machine(dest)
    label = f"{view.name} step_{step} -> {dest.name}"
    with progress(label, ckpt.bytes) as advance:
        found = stream_tree(src, src_dir, names, dst, tmp, advance)
    if dst.dry_run:
        finish(dst, tmp, final, (view.raw.get("files") or {}).get("run.yaml"))
        return {
            **report,
            "copied": True,
            "files": len(names) - 1,
            "bytes": ckpt.bytes,
            "seconds": 0,
        }
    try:
        check_copy(found, entries, manifest, dest.name, final)
    except TransferError:
        dst.run(["rm", "-rf", "--", tmp])
        raise
    finish(dst, tmp, final, (view.raw.get("files") or {}).get("run.yaml"))
    seconds = round(clock.seconds, 3)
    return {**report, "copied": True, "files": len(names) - 1, "bytes": ckpt.bytes,
            "seconds": seconds, "verified": "sha256 against MANIFEST.sha256"}  # fmt: skip


def stream_tree(
    src: Machine, src_dir: str, names: list[str], dst: Machine, dst_dir: str, advance: Any
) -> dict[str, Any]:
    """`tar -c` of `names` in `src` piped into the receiver in `dst`; the receiver's report."""
    tar = ["tar", "-C", src_dir, "--format=pax", "-cf", "-", "--", *names]
    receive = helper_argv("receive.py", dst_dir)
    pipe = _Pipe(advance)
    produced: dict[str, Any] = {}

    def produce() -> None:
        try:
            produced["result"] = src.run(tar, stdout=pipe.put)
        except BaseException as exc:  # noqa: BLE001 (reported below, after the receiver ends)
            produced["error"] = exc
        finally:
            pipe.close()

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    try:
        received = dst.run(receive, stdin=pipe.chunks())
    finally:
        pipe.abandon()
        thread.join()
    if "error" in produced:
        raise produced["error"]
    sent: Result = produced["result"]
    if src.dry_run:
        return {}
    if not sent.ok:
        dst.run(["rm", "-rf", "--", dst_dir])
        raise TransferError(f"{src.name}: tar of {src_dir} failed: {sent.error_text}")
    if not received.ok:
        dst.run(["rm", "-rf", "--", dst_dir])
        raise TransferError(f"{dst.name}: receiving into {dst_dir} failed: {received.error_text}")
    return json.loads(received.stdout)


class _Pipe:
    """A bounded queue from the source's stdout to the destination's stdin. When the receiver
    is gone, what the source still sends is dropped, so the source can finish."""

    END = object()

    def __init__(self, advance: Any) -> None:
        self.queue: queue.Queue = queue.Queue(maxsize=16)
        self.advance = advance
        self.gone = threading.Event()

    def put(self, chunk: bytes) -> None:
        self.advance(len(chunk))
        self._put(chunk)

    def _put(self, item: object) -> None:
        while not self.gone.is_set():
            try:
                self.queue.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def close(self) -> None:
        self._put(self.END)

    def abandon(self) -> None:
        self.gone.set()

    def chunks(self):  # noqa: ANN201 (a generator of bytes)
        while (item := self.queue.get()) is not self.END:
            yield item


def check_copy(
    found: dict[str, Any], entries: dict[str, str], manifest: str, target: str, where: str
) -> None:
    """Every manifest entry arrived with its hash (hashed from the destination's disk), the
    manifest itself arrived intact, and nothing else came."""
    expected = {**entries, MANIFEST: hashlib.sha256(manifest.encode()).hexdigest()}
    bad = sorted(n for n, d in expected.items() if (found.get(n) or {}).get("sha256") != d)
    extra = sorted(set(found) - set(expected))
    if bad or extra:
        shown = ", ".join(bad + extra)
        raise TransferError(
            f"{target}: the copy to {where} does not match its {MANIFEST} ({shown}); "
            "nothing was kept: run it again"
        )


def finish(machine: Machine, tmp: str, final: str, run_yaml: str | None) -> None:
    """Put the verified copy in place (replacing a bad one) and run.yaml beside it."""
    swap = 'rm -rf -- "$2" && mv -- "$1" "$2"'
    done = machine.run(["sh", "-c", swap, "sh", tmp, final])
    if not done.ok and not machine.dry_run:
        raise OpsError(f"{machine.name}: could not move {tmp} to {final}: {done.error_text}")
    if run_yaml is None:
        context.note(f"warning: the run has no run.yaml; none put beside {final}")
        return
    with tempfile.TemporaryDirectory(prefix="dflashops-pull-") as local:
        path = Path(local) / "run.yaml"
        path.write_text(run_yaml)
        transfer.put(machine, path, posixpath.join(posixpath.dirname(final), "run.yaml"))
