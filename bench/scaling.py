"""Data-parallel scaling of the trainer on CPU: step time and tokens/s for 1, 2, 4 and 2x2
processes, side by side.

    python bench/scaling.py [--tiny DIR] [--procs 1,2,4,2x2] [--steps 10] [--batch 4]
        [--sharding auto|none|zero1|hybrid] [--grad-comm auto|fp32|bf16] [--accum N]

Each case is the real trainer, `torchrun ... -m workload.train` with gloo, on the tiny target (a
`python -m workload.tiny --out DIR` build, else a random tiny target made here: time does not
depend on the weights), with the same batch per rank, so N processes train N times the rows
of one. `2x2` is two torchrun agents on this machine joined by a c10d rendezvous, as two nodes
would be. log_every 1 and one checkpoint at the end; from train_log.jsonl after the warm-up
steps: step time (median seconds between log lines) and tokens/s (median, all ranks).
Efficiency = tok/s(N) / (N x tok/s(1)), 1.0 being perfect. Each process gets --threads torch
threads (default 1), so N processes need N cores: on a machine with fewer the efficiency
measures the oversubscription, not the trainer.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

WARMUP = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _overrides(steps: int, batch: int, sharding: str, grad_comm: str = "auto",
               accum: int = 1) -> list[str]:  # fmt: skip
    return [f"optim.max_steps={steps}", f"optim.batch_size={batch}", "log.log_every=1",
            f"checkpoint.every={steps}", f"dist.sharding={sharding}",
            "optim.precision=fp32", f"dist.grad_comm_dtype={grad_comm}",
            f"optim.grad_accum={accum}"]  # fmt: skip


def run_case(case: str, config: Path, run_dir: Path, sets: list[str], threads: int) -> dict:
    """Train once as `case` ("N" processes, or "KxN": K agents of N); its log's timings."""
    nodes, _, per = case.rpartition("x")
    nodes, per = int(nodes or 1), int(per)
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT),
           "HF_HUB_OFFLINE": "1"}  # fmt: skip
    trainer = ["-m", "workload.train", "--config", str(config), "--run-dir", str(run_dir),
               *[a for s in sets for a in ("--set", s)]]  # fmt: skip
    procs = []
    t0 = time.time()
    for node in range(nodes):
        if nodes == 1:
            where = ["--standalone"]
        else:
            where = ["--nnodes", str(nodes), "--rdzv-backend", "c10d", "--rdzv-id", "scaling",
                     "--rdzv-endpoint", f"127.0.0.1:{port}", "--local-addr", "127.0.0.1"]  # fmt: skip
        cmd = [sys.executable, "-m", "torch.distributed.run", *where, "--nproc-per-node",
               str(per), *trainer]  # fmt: skip
        log = open(run_dir.parent / f"{run_dir.name}.node{node}.log", "w")  # noqa: SIM115
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=log))
    codes = [p.wait(timeout=1800) for p in procs]
    if any(codes):
        tail = (run_dir.parent / f"{run_dir.name}.node0.log").read_text()[-3000:]
        raise SystemExit(f"{case}: torchrun exited {codes}:\n{tail}")
    records = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    timed = records[WARMUP:]
    gaps = [b["time"] - a["time"] for a, b in zip(records[WARMUP - 1 :], timed, strict=False)]
    return {"case": case, "ranks": nodes * per, "step_s": statistics.median(gaps),
            "tok_s": statistics.median(r["tok_s"] for r in timed), "wall_s": time.time() - t0,
            "last_loss": records[-1]["loss"]}  # fmt: skip


def report(rows: list[dict], cores: int, threads: int) -> None:
    base = next((r for r in rows if r["ranks"] == 1), None)
    print(f"{cores} CPU cores, {threads} torch thread(s) per process")
    print(f"{'case':<6}{'ranks':>6}{'step ms':>9}{'tok/s':>9}{'speed-up':>10}{'efficiency':>11}")
    for r in rows:
        speed = r["tok_s"] / base["tok_s"] if base else float("nan")
        print(f"{r['case']:<6}{r['ranks']:>6}{1000 * r['step_s']:>9.0f}{r['tok_s']:>9.0f}"
              f"{speed:>10.2f}{speed / r['ranks']:>11.2f}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", help="a `python -m workload.tiny --out` directory (default: random)")
    p.add_argument("--procs", default="1,2,4,2x2", help="cases: N processes, or KxN (K agents)")
    p.add_argument("--steps", type=int, default=10, help="steps per case (2 are warm-up)")
    p.add_argument("--batch", type=int, default=4, help="rows per rank and step")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--sharding", default="auto", choices=("auto", "none", "zero1", "hybrid"))
    p.add_argument("--grad-comm", default="auto", choices=("auto", "fp32", "bf16"),
                   help="dist.grad_comm_dtype")  # fmt: skip
    p.add_argument("--accum", type=int, default=1, help="optim.grad_accum")
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if a.tiny:
            tiny = Path(a.tiny)
        else:
            from train_step import random_tiny

            tiny = random_tiny(Path(tmp) / "tiny")
        sets = _overrides(a.steps, a.batch, a.sharding, a.grad_comm, a.accum)
        for case in a.procs.split(","):
            rows.append(run_case(case, tiny / "run.yaml", Path(tmp) / f"run-{case}", sets,
                                 a.threads))  # fmt: skip
            print(f"{case}: {rows[-1]}", file=sys.stderr, flush=True)
    report(rows, os.cpu_count() or 1, a.threads)
    if a.json:
        Path(a.json).write_text(json.dumps({"threads": a.threads, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
