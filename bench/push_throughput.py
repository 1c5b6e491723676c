"""`dflashops push` of a 1 GB directory into a container against `ssh host 'cat > /dev/null'`
of the same bytes, side by side (target: at least 0.7x the throughput).

Run: python bench/push_throughput.py [--mb 1024] [--runs 3]. Needs root. Ours includes the
CRC-32 verification inside the container; the baseline verifies nothing. Push runs twice per
round: as installed (the OpenSSH client carries the bytes) and with no OpenSSH client on PATH
(paramiko's one channel), next to the baseline (the user's default cipher: OpenSSH 9's is
chacha20-poly1305) and two more for what a push cannot avoid: the same baseline with the cipher
our bulk client asks for where it can (aes128-gcm), and that one writing the bytes to a file on
the host's disk instead of /dev/null (a push writes them into the container's page cache; in a
VM that gives freed memory back to its host, fresh page cache costs far more than the copy). "whole" is the command as a user runs it
(process start, login, change check included); "copy" is the command's own timing of the copy
(its --json seconds); CPU s/GB counts every process involved (see _cpu.py). Rates are the best
of the rounds; the ratios are the median over rounds of each round's own ratio (a machine
shared with other work swings between rounds more than within one).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from _bed import bed, dflashops_argv, home_env, openssh_argv
from _cpu import CpuMeter

NO_OPENSSH = "/nonexistent"  # a PATH without the OpenSSH client: paramiko carries the bytes


class Trial:
    """Wall seconds, the command's own seconds (None for the baseline) and CPU seconds."""

    def __init__(self, meter: CpuMeter, argv: list[str], env: dict, stdin_path: Path | None):
        cpu = meter.seconds()
        began = time.perf_counter()
        with open(stdin_path or os.devnull, "rb") as stdin:
            done = subprocess.run(argv, stdin=stdin, capture_output=True, env=env)
        if done.returncode != 0:
            raise SystemExit(
                f"{' '.join(argv[3:])}: exit {done.returncode}: {done.stderr.decode()}"
            )
        self.wall = time.perf_counter() - began
        self.own = json.loads(done.stdout)["seconds"] if done.stdout.startswith(b"{") else None
        after = meter.seconds()
        self.cpu = None if cpu is None else after - cpu


def make_tree(root: Path, mb: int, files: int = 8) -> Path:
    root.mkdir(parents=True)
    chunk = os.urandom(1 << 20)
    for i in range(files):
        with open(root / f"shard-{i}.bin", "wb") as f:
            for _ in range(mb // files):
                f.write(chunk)
    return root


def joined(tree: Path, out: Path) -> Path:
    with open(out, "wb") as f:
        for p in sorted(tree.iterdir()):
            with open(p, "rb") as src:
                shutil.copyfileobj(src, f, 1 << 20)
    return out


def report(label: str, trials: list[Trial], mb: float) -> None:
    best = min(trials, key=lambda t: t.wall)
    copy = f"{mb / min(t.own for t in trials):8.1f}" if best.own else "       -"
    cpus = [t.cpu for t in trials if t.cpu is not None]
    cpu = f"{statistics.median(cpus) / (mb / 1000):8.2f}" if cpus else "       -"
    print(f"{label:<44} {mb / best.wall:8.1f} {copy} {cpu}")


def ratios(label: str, ours: list[Trial], base: list[Trial]) -> None:
    """Median over rounds of baseline time / our time: whole command, copy alone, CPU."""
    whole = statistics.median(b.wall / o.wall for o, b in zip(ours, base, strict=True))
    copy = statistics.median(b.wall / o.own for o, b in zip(ours, base, strict=True))
    line = f"{label:<44} whole {whole:5.2f}x   copy {copy:5.2f}x"
    if ours[0].cpu is not None:
        cpu = statistics.median(b.cpu / o.cpu for o, b in zip(ours, base, strict=True))
        line += f"   CPU per byte {cpu:5.2f}x"
    print(line)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    meter = CpuMeter()
    try:
        run(args.mb, args.runs, meter)
    finally:
        meter.close()


def run(size_mb: int, runs: int, meter: CpuMeter) -> None:
    with bed({"pve1": [201]}) as tb, tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        src = make_tree(Path(tmp) / "ckpt", size_mb)
        flat = joined(src, Path(tmp) / "joined.bin")
        mb = flat.stat().st_size / 1e6
        inv = tb.write_inventory(Path(tmp) / "hosts.yaml", {"ct201": ("pve1", 201)})
        env = home_env(Path(tmp))
        plain = {**env, "PATH": NO_OPENSSH}
        ct = tb["pve1"][201]
        ours, channel, base, gcm, disk = [], [], [], [], []
        aes = ("-c", "aes128-gcm@openssh.com")
        print(f"load average at the start: {os.getloadavg()[0]:.2f}")
        for i in range(runs):
            base.append(Trial(meter, openssh_argv(tb, "pve1", "cat > /dev/null"), env, flat))
            argv = openssh_argv(tb, "pve1", "cat > /dev/null", options=aes)
            gcm.append(Trial(meter, argv, env, flat))
            into = "/var/tmp/bench-push-baseline"
            disk.append(
                Trial(meter, openssh_argv(tb, "pve1", f"cat > {into}", options=aes), env, flat)
            )
            subprocess.run(openssh_argv(tb, "pve1", f"rm {into}"), env=env, check=True)
            for trials, environ in ((ours, env), (channel, plain)):
                dest = f"bench/{i}-{len(trials)}-{environ['PATH'] == NO_OPENSSH}"
                argv = dflashops_argv(inv, "--json", "push", "ct201", str(src), dest)
                trials.append(Trial(meter, argv, environ, None))
                shutil.rmtree(ct.host_path(f"/workspace/{dest}"))
        head = f"{mb:.0f} MB in 8 files, {runs} rounds"
        print(f"{head:<44} MB/s whole  MB/s copy  CPU s/GB")
        report("push, the OpenSSH client carries the bytes", ours, mb)
        report("push, paramiko's channel (no ssh on PATH)", channel, mb)
        report("ssh host 'cat > /dev/null', same bytes", base, mb)
        report("  the same, aes128-gcm", gcm, mb)
        report("  the same, aes128-gcm, 'cat > FILE'", disk, mb)
        print("ratio to ssh cat (default cipher), median of rounds:")
        ratios("  push, the OpenSSH client carries the bytes", ours, base)
        ratios("  push, paramiko's channel", channel, base)
        print("ratio to ssh -c aes128-gcm cat, median of rounds:")
        ratios("  push, the OpenSSH client carries the bytes", ours, gcm)
        print("ratio to ssh -c aes128-gcm 'cat > FILE', median of rounds:")
        ratios("  push, the OpenSSH client carries the bytes", ours, disk)
        ratios("  push, paramiko's channel", channel, disk)
        print(f"load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
