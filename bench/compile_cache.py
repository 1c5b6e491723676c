"""A restart's first step with torch's compile caches kept (what `launch` and `resume` give a
run: TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR in the workspace) against the first start's.

    python bench/compile_cache.py [--tiny DIR] [--runs 2]

Each run is the real trainer in a fresh process (`python -m workload.train`) on the tiny target
(a `python -m workload.tiny --out DIR` build, else a random tiny target made here) with the
drafter's flex attention compiled, as on a GPU (on CPU the trainer runs it eagerly unless told:
this bench tells it), every run with the same shapes and one cache directory. Printed: each
run's first step (the trainer's own "first step" line: seconds, graphs from the cache and
compiled) and the ratio against the first run. The first run fills the cache; later ones read it.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

# the trainer with the drafter's flex attention compiled on CPU too (bench/gpu_check.py's switch)
TRAINER = ("import sys; import workload.drafter.attention as a; a.COMPILE_FLEX = True; "
           "from workload.train.loop import main; sys.exit(main())")  # fmt: skip
FIRST = re.compile(
    r"first step: ([0-9.]+)s.*?(?:: (\d+) graph\(s\) from the cache, (\d+) compiled)?$"
)


def first_step(config: Path, run_dir: Path, cache: Path) -> tuple[float, int, int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
           "TRITON_CACHE_DIR": str(cache / "triton")}  # fmt: skip
    sets = ["optim.max_steps=2", "log.log_every=1", "checkpoint.every=100", "attention=flex",
            "target.attn_implementation=sdpa", "optim.precision=fp32"]  # fmt: skip
    cmd = [sys.executable, "-c", TRAINER, "--config", str(config), "--run-dir", str(run_dir),
           *[a for s in sets for a in ("--set", s)]]  # fmt: skip
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    console = (run_dir / "console.log").read_text() if (run_dir / "console.log").exists() else ""
    line = next((x for x in console.splitlines() if "first step:" in x), None)
    if done.returncode or line is None:
        raise SystemExit(
            f"trainer exited {done.returncode}:\n{done.stderr[-3000:]}{console[-3000:]}"
        )
    m = FIRST.search(line.strip())
    return float(m.group(1)), int(m.group(2) or 0), int(m.group(3) or 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", help="a `python -m workload.tiny --out` directory (default: random)")
    p.add_argument("--runs", type=int, default=2, help="trainer starts sharing one cache")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if a.tiny:
            tiny = Path(a.tiny)
        else:
            from train_step import random_tiny

            tiny = random_tiny(Path(tmp) / "tiny")
        rows = []
        for k in range(a.runs):
            rows.append(first_step(tiny / "run.yaml", Path(tmp) / f"run{k}", Path(tmp) / "cache"))
            print(f"run {k + 1}: {rows[-1]}", file=sys.stderr, flush=True)
    print(f"{'start':<7}{'first step s':>13}{'from cache':>12}{'compiled':>10}{'vs first':>10}")
    for k, (seconds, hits, misses) in enumerate(rows):
        print(f"{k + 1:<7}{seconds:>13.1f}{hits:>12}{misses:>10}{seconds / rows[0][0]:>10.2f}")


if __name__ == "__main__":
    main()
