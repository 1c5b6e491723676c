"""`dflashops pull-ckpt` of a 1 GB checkpoint from a container on one host to a container on
another, against `ssh A 'cat FILE' | ssh B 'cat > /dev/null'` of the same bytes, side by side
(target: at least 0.7x the throughput).

Run: python bench/pull_ckpt_throughput.py [--mb 1024] [--runs 3]. Needs root. Ours reads the
checkpoint in CT 201 on pve1, relays it through this machine and checks every file against
MANIFEST.sha256 from CT 301's disk on pve2; the baseline moves the bytes host to host and
verifies nothing. Pull runs as installed (the OpenSSH client carries the bytes) and with no
OpenSSH client on PATH (paramiko's channels), next to the baseline. Columns and ratios as in
push_throughput.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from _bed import bed, dflashops_argv, home_env, openssh_argv
from _cpu import CpuMeter
from push_throughput import NO_OPENSSH, Trial, joined, make_tree, ratios, report

RUN = "benchrun"


def checkpoint(ct, mb: int) -> Path:
    """A complete checkpoint step_1 of run RUN in the container, with its manifest."""
    run = ct.host_path(f"/workspace/runs/{RUN}")
    step = make_tree(run / "checkpoints" / "step_1", mb)
    (step / "config.json").write_text("{}\n")
    lines = []
    for path in sorted(step.iterdir()):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        lines.append(f"{digest.hexdigest()}  {path.name}\n")
    (step / "MANIFEST.sha256").write_text("".join(lines))
    now = time.time()
    state = {"status": "finished", "exit_code": 0, "started": now - 60, "finished": now}
    (run / "state.json").write_text(json.dumps(state))
    return step


class Piped:
    """`a | b`, timed like a Trial."""

    def __init__(self, meter: CpuMeter, a: list[str], b: list[str], env: dict) -> None:
        cpu = meter.seconds()
        began = time.perf_counter()
        first = subprocess.Popen(a, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)
        second = subprocess.Popen(b, stdin=first.stdout, env=env)
        first.stdout.close()
        if second.wait() or first.wait():
            raise SystemExit(f"baseline failed: {a} | {b}")
        self.wall = time.perf_counter() - began
        self.own = None
        self.cpu = None if cpu is None else meter.seconds() - cpu


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
    with bed({"pve1": [201], "pve2": [301]}) as tb, tempfile.TemporaryDirectory() as tmp:
        src_ct, dst_ct = tb["pve1"][201], tb["pve2"][301]
        step = checkpoint(src_ct, size_mb)
        flat = joined(step, tb["pve1"].host_path("/tmp/joined.bin"))
        mb = sum(p.stat().st_size for p in step.iterdir()) / 1e6
        inv = tb.write_inventory(
            Path(tmp) / "hosts.yaml", {"ct201": ("pve1", 201), "ct301": ("pve2", 301)}
        )
        env = home_env(Path(tmp))
        plain = {**env, "PATH": NO_OPENSSH}
        copies = dst_ct.host_path(f"/workspace/ckpts/{RUN}")
        pull = dflashops_argv(inv, "--json", "pull-ckpt", "1", "--to", "ct301", "--run", RUN)
        ours, channel, base = [], [], []
        for _ in range(runs):
            base.append(Piped(meter, openssh_argv(tb, "pve1", "cat", "/tmp/joined.bin"),
                              openssh_argv(tb, "pve2", "cat > /dev/null"), env))  # fmt: skip
            for trials, environ in ((ours, env), (channel, plain)):
                trials.append(Trial(meter, pull, environ, None))
                shutil.rmtree(copies)
        flat.unlink()
        head = f"{mb:.0f} MB checkpoint pve1 -> pve2, {runs} rounds"
        print(f"{head:<44} MB/s whole  MB/s copy  CPU s/GB")
        report("pull-ckpt, the OpenSSH client carries bytes", ours, mb)
        report("pull-ckpt, paramiko's channels (no ssh)", channel, mb)
        report("ssh A 'cat FILE' | ssh B 'cat > /dev/null'", base, mb)
        print("ratio to ssh | ssh, median of rounds:")
        ratios("  pull-ckpt, the OpenSSH client carries bytes", ours, base)
        ratios("  pull-ckpt, paramiko's channels", channel, base)


if __name__ == "__main__":
    main()
