"""Faults tried on copies (issue 9, items 3, 6 and 8): what each command did (exit code, time to
answer) and what it left on disk, as one Markdown table.

Run: python bench/copy_faults.py. Needs root (a test bed of two fake Proxmox hosts, one
container on each). The same faults are asserted by tests/operator/test_copies.py and
tests/operator/test_hostile_tar.py; this prints the numbers for the issue's closing note.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from pathlib import Path

from _bed import bed

from dflashops.remote import source
from tests.operator.ckpt_copies import (
    BIG,
    big_checkpoint,
    checkpoint,
    cut_link,
    hashes,
    left_on_disk,
    sha,
    stop_mid_transfer,
)
from tests.operator.cli import dflashops, finished, start
from tests.operator.hostile_tars import EVIL_TAR, HOSTILE, special_files

ROWS: list[tuple[str, str, str, str, str]] = []


def row(fault: str, command: str, code: object, seconds: float, left: str) -> None:
    ROWS.append((fault, command, str(code), f"{seconds:.2f} s", left))
    print(f"| {fault} | {command} | {code} | {seconds:.2f} s | {left} |", flush=True)


def two_pushes(tb, inv: Path, home: Path, tmp: Path) -> None:
    trees = {}
    for who in ("a", "b"):
        tree = tmp / who
        tree.mkdir()
        for i in range(12):
            (tree / f"f{i}.bin").write_bytes(os.urandom(256 << 10))
        (tree / "big.bin").write_bytes(os.urandom(8 << 20))
        trees[who] = {p.name: sha(p) for p in tree.iterdir()}
    started = time.monotonic()
    procs = [start("push", "src", str(tmp / w), "/workspace/shared", inventory=inv, home=home)
             for w in ("a", "b")]  # fmt: skip
    codes = [finished(p)[0] for p in procs]
    seconds = time.monotonic() - started
    landed = tb["pve1"][201].host_path("/workspace/shared")
    names = sorted(p.name for p in landed.iterdir())
    whole = all(sha(landed / n) in (trees["a"][n], trees["b"][n]) for n in names if n in trees["a"])
    extra = sorted(set(names) - set(trees["a"]))
    row("two pushes of different trees into one directory at once", "push ×2", codes, seconds,
        f"{len(names)} files, each whole: {whole}; other files: {extra or 'none'}")  # fmt: skip


def cut_short(tb, inv: Path, home: Path, fault: str, run: str) -> None:
    src, dst = tb["pve1"][201], tb["pve2"][301]
    big_checkpoint(src, run)
    ckpts = dst.host_path(f"/workspace/ckpts/{run}")
    partial = ckpts / ".partial-step_4"
    dst.host.set_faults(slow_exec_stdin_after=12 << 20)  # 8 MiB/s past 12 MiB: act mid-copy
    try:
        proc = start("pull-ckpt", "4", "--to", "dst", "--run", run, inventory=inv, home=home)
        stop = {"Ctrl-C (SIGINT)": lambda: proc.send_signal(signal.SIGINT), "kill -9": proc.kill,
                "link cut (sshd sessions killed)": lambda: cut_link(dst.host)}[fault]  # fmt: skip
        code, err, seconds = stop_mid_transfer(proc, partial, stop)
    finally:
        dst.host.set_faults()
    left = left_on_disk(ckpts)
    said = err.strip().splitlines()[-1] if err.strip() else "(killed)"
    row(f"pull-ckpt of 104 MiB cut short by {fault} after 3 of 4 files", "pull-ckpt", code,
        seconds, f"left: {', '.join(left)}; said: {said}")  # fmt: skip
    started = time.monotonic()
    again = dflashops("--json", "pull-ckpt", "4", "--to", "dst", "--run", run, inventory=inv,
                      home=home)  # fmt: skip
    seconds = time.monotonic() - started
    doc = json.loads(again.out)
    same = hashes(ckpts / "step_4") == hashes(
        src.host_path(f"/workspace/runs/{run}/checkpoints/step_4")
    )
    row(f"  then the same pull again ({fault})", "pull-ckpt", again.code, seconds,
        f"kept {doc.get('kept_files')} files, sent {doc['sent_bytes'] / 2**20:.1f} MiB of "
        f"{doc['bytes'] / 2**20:.1f} MiB ({BIG} only); step_4 identical: {same}; left: "
        f"{sorted(p.name for p in ckpts.iterdir())}")  # fmt: skip


def two_pulls(tb, inv: Path, home: Path, rounds: int = 5) -> None:
    src, dst = tb["pve1"][201], tb["pve2"][301]
    source_dir = checkpoint(src, "twice", 2, {"config.json": 200, "model.safetensors": 1 << 20})
    final = dst.host_path("/workspace/ckpts/twice/step_2")
    outcomes, worst = [], 0.0
    for _ in range(rounds):
        started = time.monotonic()
        procs = [start("--json", "pull-ckpt", "2", "--to", "dst", "--run", "twice",
                       inventory=inv, home=home) for _ in range(2)]  # fmt: skip
        results = [finished(p) for p in procs]
        worst = max(worst, time.monotonic() - started)
        ok = hashes(final) == hashes(source_dir)
        copied = [json.loads(out)["copied"] if code == 0 else code for code, out, _ in results]
        outcomes.append((tuple(r[0] for r in results), tuple(copied), ok))
        (final / "model.safetensors").write_bytes(b"damaged")  # the next round replaces it
    all_ok = all(o[2] for o in outcomes)
    row(f"two pulls of one step at once, {rounds} rounds (a bad copy there after round 1)",
        "pull-ckpt ×2", sorted({o[0] for o in outcomes}), worst,
        f"one exact copy, nothing nested, every round: {all_ok}; copied flags "
        f"{[o[1] for o in outcomes]}; left: {sorted(p.name for p in final.parent.iterdir())}")  # fmt: skip


def full_disk(tb, inv: Path, home: Path) -> None:
    src, dst = tb["pve1"][201], tb["pve2"][301]
    checkpoint(src, "full", 6, {"config.json": 200, "model.safetensors": 12 << 20})
    dst.run(["mkdir", "-p", "/workspace/ckpts"], check=True)
    dst.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", "/workspace/ckpts"], check=True)
    try:
        started = time.monotonic()
        ran = dflashops("pull-ckpt", "6", "--to", "dst", "--run", "full", inventory=inv,
                        home=home)  # fmt: skip
        seconds = time.monotonic() - started
        left = dst.run(["find", "/workspace/ckpts"], check=True).stdout.decode().split()
    finally:
        dst.run(["umount", "/workspace/ckpts"], check=True)
    row("pull-ckpt of 12 MiB onto a 6 MiB tmpfs", "pull-ckpt", ran.code, seconds,
        f"{left}; said: {ran.err.strip()}")  # fmt: skip


def corrupted(tb, inv: Path, home: Path) -> None:
    src, dst = tb["pve1"][201], tb["pve2"][301]
    checkpoint(src, "bent", 8, {"a.bin": 2 << 20, "b.bin": 2 << 20})
    tb["pve2"].set_faults(corrupt_exec_stdin_at=3 << 20)  # inside b.bin
    try:
        started = time.monotonic()
        ran = dflashops("pull-ckpt", "8", "--to", "dst", "--run", "bent", inventory=inv,
                        home=home)  # fmt: skip
        seconds = time.monotonic() - started
    finally:
        tb["pve2"].set_faults()
    ckpts = dst.host_path("/workspace/ckpts/bent")
    row("pull-ckpt with one byte flipped in flight (inside b.bin)", "pull-ckpt", ran.code, seconds,
        f"{left_on_disk(ckpts)}; said: {ran.err.strip()}")  # fmt: skip
    again = dflashops("--json", "pull-ckpt", "8", "--to", "dst", "--run", "bent", inventory=inv,
                      home=home)  # fmt: skip
    doc = json.loads(again.out)
    row(
        "  then the same pull again",
        "pull-ckpt",
        again.code,
        doc["seconds"],
        f"kept {doc['kept_files']} (a.bin), sent {doc['sent_bytes'] / 2**20:.2f} MiB",
    )


def corrupted_push(tb, inv: Path, home: Path, tmp: Path) -> None:
    """A push whose stream has one byte flipped, over an older copy, then the same push again
    (before issue 24: the corrupted file was in place and the re-run said '1 unchanged')."""
    f = tmp / "w.bin"
    f.write_bytes(b"old" * 1000)
    dflashops("push", "dst", str(f), "w.bin", inventory=inv, home=home)
    landed = tb["pve2"][301].host_path("/workspace/w.bin")
    f.write_bytes(os.urandom(4 << 20))
    tb["pve2"].set_faults(corrupt_exec_stdin_at=1 << 20)
    try:
        started = time.monotonic()
        ran = dflashops("push", "dst", str(f), "w.bin", inventory=inv, home=home)
        seconds = time.monotonic() - started
    finally:
        tb["pve2"].set_faults()
    there = "the old file" if landed.read_bytes() == b"old" * 1000 else "another file"
    row("push of 4 MiB with one byte flipped in flight, over an older copy", "push", ran.code,
        seconds, f"at its name: {there}; said: {ran.err.strip()}")  # fmt: skip
    started = time.monotonic()
    again = dflashops("push", "dst", str(f), "w.bin", inventory=inv, home=home)
    same = landed.read_bytes() == f.read_bytes()
    row("  then the same push again", "push", again.code, time.monotonic() - started,
        f"identical: {same}; said: {again.err.strip() or again.out.strip()}")  # fmt: skip


def hostile_source(tb, inv_dir: Path, home: Path) -> None:
    src, dst = tb["pve1"][201], tb["pve2"][301]
    checkpoint(src, "victim", 10, {"config.json": 100, "model.safetensors": 1000})
    evil = src.host_path("/workspace/evil")
    evil.mkdir()
    (evil / "tar").write_text(EVIL_TAR)
    (evil / "tar").chmod(0o755)
    path = "/workspace/evil:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    inv = tb.write_inventory(inv_dir / "evil.yaml",
                             {"src": ("pve1", 201, {"path": path}), "dst": dst})  # fmt: skip
    started = time.monotonic()
    ran = dflashops("pull-ckpt", "10", "--to", "dst", "--run", "victim", inventory=inv, home=home)
    seconds = time.monotonic() - started
    pwned = [
        str(p) for r in ("/tmp", "/root", "/workspace") for p in dst.host_path(r).rglob("pwned*")
    ]
    row("pull-ckpt from a container whose `tar` sends a link then a file through it", "pull-ckpt",
        ran.code, seconds, f"pwned anywhere: {pwned or 'no'}; said: {ran.err.strip()}")  # fmt: skip


def hostile_streams(tb) -> None:
    ct = tb["pve2"][301]
    for case, stream, _refusal in HOSTILE:
        dst = f"/workspace/hostile-{abs(hash(case)) % 10**6}"
        started = time.monotonic()
        ran = ct.run(["python3", "-c", source("receive.py"), dst], input=stream)
        seconds = time.monotonic() - started
        root = ct.host_path(dst)
        entries = sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []
        shown = [e if len(e) < 40 else e[:37] + "..." for e in entries]
        specials = special_files(root) if root.exists() else []
        said = ran.stderr.decode().strip()
        said = said if len(said) < 140 else said[:137] + "..."
        row(f"receiver fed: {case}", "receive.py in CT 301", ran.returncode, seconds,
            f"in the destination: {shown or 'nothing'}; special files: {len(specials)}; said: {said}")  # fmt: skip


def setuid_push(tb, inv: Path, home: Path, tmp: Path) -> None:
    f = tmp / "tool"
    f.write_bytes(b"#!/bin/sh\n")
    f.chmod(0o4755)
    started = time.monotonic()
    ran = dflashops("push", "src", str(f), "/workspace/tool", inventory=inv, home=home)
    seconds = time.monotonic() - started
    mode = tb["pve1"][201].host_path("/workspace/tool").stat().st_mode & 0o7777
    row("push of a 0o4755 file", "push", ran.code, seconds, f"arrives as 0o{mode:o}")


def main() -> None:
    print("| fault | command | exit | time to answer | left on disk / what it said |")
    print("| --- | --- | --- | --- | --- |")
    with bed({"pve1": (201,), "pve2": (301,)}) as tb, tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)
        home = tmp / "home"
        home.mkdir()
        inv = tb.write_inventory(tmp / "hosts.yaml", {"src": ("pve1", 201), "dst": ("pve2", 301)})
        two_pushes(tb, inv, home, tmp)
        for n, fault in enumerate(
            ["Ctrl-C (SIGINT)", "kill -9", "link cut (sshd sessions killed)"]
        ):
            cut_short(tb, inv, home, fault, f"big{n}")
        two_pulls(tb, inv, home)
        full_disk(tb, inv, home)
        corrupted(tb, inv, home)
        corrupted_push(tb, inv, home, tmp)
        hostile_source(tb, tmp, home)
        hostile_streams(tb)
        setuid_push(tb, inv, home, tmp)


if __name__ == "__main__":
    main()
