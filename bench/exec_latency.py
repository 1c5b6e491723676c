"""`dflashops exec` against a bare OpenSSH `ssh host true`, on the test bed (target: <= 1.5x).

Run: python bench/exec_latency.py [--runs 15]. Needs root (the bed makes network namespaces).
Prints medians of interleaved runs, whole commands as a user types them (process start included).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _bed import bed, compare, dflashops_argv, home_env, openssh_argv, timed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    runs = parser.parse_args().runs
    with bed({"pve1": [201]}) as tb, tempfile.TemporaryDirectory() as tmp:
        inv = tb.write_inventory(Path(tmp) / "hosts.yaml", {"ct201": ("pve1", 201), "box": "pve1"})
        env = home_env(Path(tmp))
        cases = {
            "exec box -- true  vs  ssh host true": (
                dflashops_argv(inv, "exec", "box", "--", "true"),
                openssh_argv(tb, "pve1", "true"),
            ),
            "exec ct201 -- true  vs  ssh host pct exec": (
                dflashops_argv(inv, "exec", "ct201", "--", "true"),
                openssh_argv(tb, "pve1", "pct", "exec", "201", "--", "true"),
            ),
        }
        for label, (ours_argv, base_argv) in cases.items():
            timed(ours_argv, env=env), timed(base_argv, env=env)  # warm caches
            ours, base = [], []
            for _ in range(runs):
                ours.append(timed(ours_argv, env=env))
                base.append(timed(base_argv, env=env))
            compare(label, ours, base)


if __name__ == "__main__":
    main()
