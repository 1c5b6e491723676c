"""`dflashops hosts` over 8 containers on 2 hosts against the same over 1 container (target: <= 1.5x).

Run: python bench/hosts_parallel.py [--runs 7]. Needs root. The ratio near 1 shows that the
probes run in parallel over one reused connection per host, not one after another.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _bed import bed, compare, dflashops_argv, home_env, timed

CONTAINERS = {"pve1": [201, 202, 203, 204], "pve2": [301, 302, 303, 304]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    runs = parser.parse_args().runs
    with bed(CONTAINERS) as tb, tempfile.TemporaryDirectory() as tmp:
        all_targets = {f"ct{v}": (h, v) for h, vs in CONTAINERS.items() for v in vs}
        many = tb.write_inventory(Path(tmp) / "many.yaml", all_targets)
        one = tb.write_inventory(Path(tmp) / "one.yaml", {"ct201": ("pve1", 201)})
        env = home_env(Path(tmp))
        ours_argv, base_argv = dflashops_argv(many, "hosts"), dflashops_argv(one, "hosts")
        timed(ours_argv, env=env), timed(base_argv, env=env)
        ours, base = [], []
        for _ in range(runs):
            ours.append(timed(ours_argv, env=env))
            base.append(timed(base_argv, env=env))
        compare("hosts: 8 CTs on 2 hosts vs 1 CT on 1 host", ours, base)


if __name__ == "__main__":
    main()
