"""`dflashops push` of a 1 GB directory into a container against `ssh host 'cat > /dev/null'`
of the same bytes, side by side (target: at least 0.7x the throughput).

Run: python bench/push_throughput.py [--mb 1024] [--runs 3] (BENCH_EACH=1:
every trial's seconds on stderr). Needs root. Ours includes the CRC-32 check inside the
container; the baseline verifies nothing. Push runs twice per round: as installed (the OpenSSH
client carries the bytes) and with no OpenSSH client on PATH (paramiko's one channel), next to
the baseline (the user's default cipher: OpenSSH 9's is chacha20-poly1305) and two more for
what a push cannot avoid: that baseline with the cipher our bulk client asks for where it can
(aes128-gcm), and that one writing the bytes to a file on the host's disk instead of /dev/null
(a push writes them into the container's page cache).

This test machine is a VM whose free memory goes back to its host (virtio-balloon free page
reporting) seconds after it is freed: a GB written into page cache the host took back costs
1.5-2.5 CPU s more than one written into memory freed just before (`dd` of 1 GB: 0.2 s sys
right after an `rm` of 1 GB, 1.9 s ten seconds later). Every writer pays it, `cat > FILE` as
much as a push; `cat > /dev/null` writes nothing and never does. Measured with each writer's
GB removed just before the next one writes, writers run back to back alternate between the two
costs (push 2.9, 1.6, 3.1 s; `cat > FILE` 1.3, 2.9 s), and with nothing removed every one pays
it (push 3.0-3.2 s, `cat > FILE` 2.4-3.0 s). So each writer runs twice back to back in a round,
its previous output removed just before: "steady" is the faster of the two (memory as a server
without page reporting gives it), "fresh" the slower (it wrote into memory the host took
back). The baselines that write nothing run twice as well, and count with the faster. The
bar is the steady push against `cat > /dev/null`; the fresh push is shown against the fresh
`cat > FILE`, which paid the same.

"whole" is the command as a user runs it (process start, login, change check included);
"copy" is the command's own timing of the copy (its --json seconds); CPU s/GB counts every
process involved (see _cpu.py). Rates are the best of the rounds; the ratios are the median
over rounds of each round's own ratio (a machine shared with other work swings between rounds
more than within one).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
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
        if os.environ.get("BENCH_EACH"):  # every trial on stderr, to see the rounds' spread
            shown = f"{self.cpu:6.2f} s CPU" if self.cpu is not None else ""
            print(f"  {argv[-1][:40]:<40} {self.wall:6.2f} s {shown}", file=sys.stderr)


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


def pair(trials: list[Trial]) -> tuple[Trial, Trial]:
    """(steady, fresh) of two back-to-back runs of one writer."""
    first, second = trials
    return (first, second) if first.wall <= second.wall else (second, first)


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


class Writers:
    """Trials of commands that write what they copy: each run twice back to back, the
    previous writer's output removed just before each starts."""

    def __init__(self, meter: CpuMeter) -> None:
        self.meter = meter
        self.last: Path | None = None
        self.steady: dict[str, list[Trial]] = {}
        self.fresh: dict[str, list[Trial]] = {}

    def twice(self, label: str, make) -> None:  # noqa: ANN001 (i -> argv, env, stdin, out)
        runs = []
        for i in range(2):
            argv, environ, stdin, out = make(i)
            self.remove()
            runs.append(Trial(self.meter, argv, environ, stdin))
            self.last = out
        steady, fresh = pair(runs)
        self.steady.setdefault(label, []).append(steady)
        self.fresh.setdefault(label, []).append(fresh)

    def remove(self) -> None:
        if self.last is not None:
            shutil.rmtree(self.last) if self.last.is_dir() else self.last.unlink()
            self.last = None


def run(size_mb: int, runs: int, meter: CpuMeter) -> None:
    with bed({"pve1": [201]}) as tb, tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        src = make_tree(Path(tmp) / "ckpt", size_mb)
        flat = joined(src, Path(tmp) / "joined.bin")
        mb = flat.stat().st_size / 1e6
        inv = tb.write_inventory(Path(tmp) / "hosts.yaml", {"ct201": ("pve1", 201)})
        env = home_env(Path(tmp))
        plain = {**env, "PATH": NO_OPENSSH}
        ct = tb["pve1"][201]
        base, gcm = [], []
        aes = ("-c", "aes128-gcm@openssh.com")
        into = "/var/tmp/bench-push-baseline"
        writers = Writers(meter)
        paths = {"openssh": env, "paramiko": plain}

        def to_file(_: int):  # noqa: ANN202
            argv = openssh_argv(tb, "pve1", f"cat > {into}", options=aes)
            return argv, env, flat, Path(tb["pve1"].host_path(into))

        def pushing(name: str, r: int):  # noqa: ANN202
            def make(i: int):  # noqa: ANN202
                dest = f"bench/{r}-{name}-{i}"
                argv = dflashops_argv(inv, "--json", "push", "ct201", str(src), dest)
                return argv, paths[name], None, Path(ct.host_path(f"/workspace/{dest}"))

            return make

        print(f"load average at the start: {os.getloadavg()[0]:.2f}")
        for r in range(runs):
            for trials, options in ((base, ()), (gcm, aes)):  # best of two, as the writers
                argv = openssh_argv(tb, "pve1", "cat > /dev/null", options=options)
                trials.append(pair([Trial(meter, argv, env, flat) for _ in range(2)])[0])
            writers.twice("file", to_file)
            order = ["openssh", "paramiko"] if r % 2 == 0 else ["paramiko", "openssh"]
            for name in order:  # the pushes take turns going first
                writers.twice(name, pushing(name, r))
        writers.remove()
        steady, fresh = writers.steady, writers.fresh
        head = f"{mb:.0f} MB in 8 files, {runs} rounds"
        print(f"{head:<44} MB/s whole  MB/s copy  CPU s/GB")
        report("push, the OpenSSH client carries the bytes", steady["openssh"], mb)
        report("push, paramiko's channel (no ssh on PATH)", steady["paramiko"], mb)
        report("ssh host 'cat > /dev/null', same bytes", base, mb)
        report("  the same, aes128-gcm", gcm, mb)
        report("  the same, aes128-gcm, 'cat > FILE'", steady["file"], mb)
        report("fresh memory: push, OpenSSH client", fresh["openssh"], mb)
        report("fresh memory: push, paramiko", fresh["paramiko"], mb)
        report("fresh memory: 'cat > FILE', aes128-gcm", fresh["file"], mb)
        print("ratio to ssh cat (default cipher), median of rounds (steady):")
        ratios("  push, the OpenSSH client carries the bytes", steady["openssh"], base)
        ratios("  push, paramiko's channel", steady["paramiko"], base)
        print("ratio to ssh -c aes128-gcm cat, median of rounds (steady):")
        ratios("  push, the OpenSSH client carries the bytes", steady["openssh"], gcm)
        print("ratio to ssh -c aes128-gcm 'cat > FILE', median of rounds, steady / fresh:")
        ratios("  push, OpenSSH, steady", steady["openssh"], steady["file"])
        ratios("  push, paramiko, steady", steady["paramiko"], steady["file"])
        ratios("  push, OpenSSH, fresh", fresh["openssh"], fresh["file"])
        ratios("  push, paramiko, fresh", fresh["paramiko"], fresh["file"])
        print("for the record, with the fresh push: ratio to ssh cat (default cipher)")
        ratios("  push, OpenSSH, fresh", fresh["openssh"], base)
        print(f"load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
