"""`dflashops push` of a 1 GB directory into a container against `ssh host 'cat > /dev/null'`
of the same bytes (target: at least 0.7x the throughput).

Run: python bench/push_throughput.py [--mb 1024] [--runs 3]. Needs root. Ours includes the
sha256 verification inside the container; the baseline verifies nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from _bed import bed, dflashops_argv, home_env, openssh_argv, timed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with bed({"pve1": [201]}) as tb, tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        src = Path(tmp) / "ckpt"
        src.mkdir()
        files = 8
        chunk = os.urandom(1 << 20)
        for i in range(files):
            with open(src / f"shard-{i}.bin", "wb") as f:
                for _ in range(args.mb // files):
                    f.write(chunk)
        total = sum(p.stat().st_size for p in src.iterdir())
        joined = Path(tmp) / "joined.bin"
        with open(joined, "wb") as out:
            for p in sorted(src.iterdir()):
                out.write(p.read_bytes())
        inv = tb.write_inventory(Path(tmp) / "hosts.yaml", {"ct201": ("pve1", 201)})
        env = home_env(Path(tmp))
        ours, base = [], []
        for i in range(args.runs):
            ours.append(
                timed(dflashops_argv(inv, "push", "ct201", str(src), f"bench/{i}"), env=env)
            )
            with open(joined, "rb") as f:
                base.append(timed(openssh_argv(tb, "pve1", "cat > /dev/null"), stdin=f, env=env))
            shutil.rmtree(tb["pve1"][201].host_path(f"/workspace/bench/{i}"))
        mb = total / 1e6
        best_ours, best_base = min(ours), min(base)
        print(f"push {mb:.0f} MB dir into CT (verified)   {mb / best_ours:7.1f} MB/s")
        print(f"ssh host 'cat > /dev/null' same bytes  {mb / best_base:7.1f} MB/s")
        print(
            f"throughput ratio ours/baseline         {best_base / best_ours:7.2f}x (best of {args.runs})"
        )


if __name__ == "__main__":
    main()
