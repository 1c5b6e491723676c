"""A run resumed at another world size against the same run left uninterrupted: the loss
curves, their largest difference after the resume, and the rows seen (the data position).

    python bench/resume_resized.py [--tiny DIR] [--steps 40] [--at 12] [--plot FILE.png]

The real trainer under torchrun (gloo, CPU) on the tiny target (a `python -m workload.tiny
--out DIR` build, else a random one made here), ZeRO-1, 2 rows a rank: the straight run on 2
ranks; 2 ranks stopped at step --at and resumed on 1 (grad_accum 1 -> 2); 1 rank at grad_accum
2 stopped there and resumed on 2 (2 -> 1); and, for scale, the straight run on 1 rank at
grad_accum 2 (the same batches, other random draws: what the resumed runs can differ by); and
2 ranks stopped there, the run directory copied elsewhere (what `resume --host OTHER` lands after
its verified copy; the original removed) and resumed there on 1 rank.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def train(config: Path, run_dir: Path, nproc: int, sets: list[str], *extra: str) -> None:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", str(nproc)] if nproc > 1 else [sys.executable])  # fmt: skip
    cmd = [*launcher, "-m", "workload.train", "--config", str(config), "--run-dir", str(run_dir),
           *[a for s in sets for a in ("--set", s)], *extra]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise SystemExit(f"{run_dir.name}: exit {done.returncode}\n{done.stderr[-3000:]}")


def log(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "train_log.jsonl").read_text().splitlines()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", help="a `python -m workload.tiny --out` directory (default: random)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--at", type=int, default=12, help="the step the runs stop and resume at")
    p.add_argument("--plot", help="write the curves here (PNG)")
    a = p.parse_args()
    sets = [f"optim.max_steps={a.steps}", "optim.batch_size=2", "log.log_every=2",
            f"checkpoint.every={a.steps}", "dist.sharding=zero1", "data.max_length=128",
            "drafter.num_layers=1", "drafter.block_size=4", "data.num_anchors=8"]  # fmt: skip
    accum2 = [*sets, "optim.grad_accum=2"]
    with tempfile.TemporaryDirectory() as tmp:
        if a.tiny:
            tiny = Path(a.tiny)
        else:
            from train_step import random_tiny

            tiny = random_tiny(Path(tmp) / "tiny")
        cfg, out = tiny / "run.yaml", Path(tmp)
        train(cfg, out / "straight", 2, sets)
        train(cfg, out / "straight-1x2", 1, accum2)
        train(cfg, out / "2-to-1", 2, sets, "--stop-after", str(a.at))
        train(cfg, out / "2-to-1", 1, sets, "--resume")
        train(cfg, out / "1-to-2", 1, accum2, "--stop-after", str(a.at))
        train(cfg, out / "1-to-2", 2, accum2, "--resume")
        train(cfg, out / "stopped", 2, sets, "--stop-after", str(a.at))
        shutil.copytree(out / "stopped", out / "moved-2-to-1")  # what `resume --host` lands
        shutil.rmtree(out / "stopped")
        train(cfg, out / "moved-2-to-1", 1, sets, "--resume")
        names = ("straight", "straight-1x2", "2-to-1", "1-to-2", "moved-2-to-1")
        runs = {name: log(out / name) for name in names}
    base = {r["step"]: r for r in runs["straight"]}
    print(
        f"{'run':<14}{'largest |dloss|/loss after step ' + str(a.at):>38}{'rows seen = straight':>22}"
    )
    for name, records in runs.items():
        after = [r for r in records if r["step"] > a.at]
        worst = max(abs(r["loss"] - base[r["step"]]["loss"]) / base[r["step"]]["loss"]
                    for r in after)  # fmt: skip
        same = all(r["epoch"] == base[r["step"]]["epoch"] for r in records)
        print(f"{name:<14}{worst:>38.4f}{str(same):>22}")
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, records in runs.items():
            ax.plot([r["step"] for r in records], [r["loss"] for r in records], label=name,
                    marker="." if name != "straight" else None)  # fmt: skip
        ax.axvline(a.at, color="grey", linestyle=":", label=f"resumed at step {a.at}")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=100)
        print(f"plot: {a.plot}")


if __name__ == "__main__":
    main()
