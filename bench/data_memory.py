"""Peak resident memory and time to the first step of the trainer against the size of its data,
before (the trainer as it was: every rank tokenized the whole file into lists) and after (the
token store, built once and memory-mapped).

    python bench/data_memory.py [--tiny DIR] [--sizes 2000,20000,200000] [--before REV]
                                [--workers N]

Each case is the real trainer, `python -m workload.train` (one rank), for two steps of the tests'
small run on a tiny target (a `python -m workload.tiny --out DIR` build, else a random tiny
target made here: memory and tokenizing do not depend on the weights), on a file of N short
synthetic conversations. `before` runs the workload of git revision REV (extracted with git
archive), `after` this checkout's, on a fresh copy of the file (so its store is built in that
run), then `after, reused` starts again on the same file (the store is found, nothing is
tokenized). Peak RSS is the trainer's own and its tokenizer workers' (os.wait4's ru_maxrss: the
largest of them); time to first step is from the start of the process to the `time` of the
first line of train_log.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

BEFORE = "76725cb"  # the last revision whose trainer held the tokenized data in lists
COMMON = ["drafter.num_layers=1", "drafter.block_size=4", "data.max_length=128",
          "data.num_anchors=8", "optim.batch_size=2", "optim.max_steps=2", "log.log_every=1",
          "checkpoint.every=2"]  # fmt: skip


def conversation(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Say {i} twice."},
                         {"role": "assistant", "content": f"Here it is: {i} {i}."}]}  # fmt: skip


def write_data(path: Path, n: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps(conversation(i)) + "\n")
    return path


def checkout(rev: str, out: Path) -> Path:
    """The workload (and templates) of `rev`, extracted into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "workload", "templates"],
                             check=True, capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def run_trainer(code: Path, build: Path, data: Path, run_dir: Path, extra: list[str]) -> dict:
    import yaml

    made = yaml.safe_load((build / "run.yaml").read_text())
    sets = [f"target.path={made['target']['path']}", f"data.path={data}",
            f"drafter.mask_token_id={made['drafter']['mask_token_id']}", *COMMON, *extra]  # fmt: skip
    cmd = [sys.executable, "-m", "workload.train", "--config",
           str(code / "templates" / "runs" / "tiny.yaml"), "--run-dir", str(run_dir),
           *[a for s in sets for a in ("--set", s)]]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(code)}
    with open(run_dir.parent / f"{run_dir.name}.out", "w+b") as out:
        t0 = time.time()
        proc = subprocess.Popen(cmd, env=env, cwd=code, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            out.seek(0)
            raise SystemExit(f"{cmd}: failed:\n{out.read().decode()[-3000:]}")
    first = json.loads((run_dir / "train_log.jsonl").read_text().splitlines()[0])
    return {"rss_mib": usage.ru_maxrss / 1024, "first_step_s": first["time"] - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", type=Path, help="a `python -m workload.tiny --out DIR` build")
    p.add_argument("--sizes", default="2000,20000,200000")
    p.add_argument("--before", default=BEFORE, help="git revision of the trainer as it was")
    p.add_argument("--workers", type=int, default=None, help="data.workers of `after`")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="data-memory-"))
    try:
        build = a.tiny
        if build is None:
            from train_step import random_tiny

            build = random_tiny(work / "tiny")
        before = checkout(a.before, work / "before")
        extra = [f"data.workers={a.workers}"] if a.workers else []
        rows = []
        for n in (int(x) for x in a.sizes.split(",")):
            case = work / str(n)
            b = run_trainer(before, build, write_data(case / "b" / "chat.jsonl", n),
                            case / "b-run", [])  # fmt: skip
            data = write_data(case / "a" / "chat.jsonl", n)
            first = run_trainer(ROOT, build, data, case / "a-run", extra)
            again = run_trainer(ROOT, build, data, case / "a-run2", extra)
            rows.append((n, b, first, again))
            print(f"{n}: before {b}, after {first}, after reused {again}", file=sys.stderr)
        print(f"{'conversations':>13} | {'peak RSS per rank (MiB)':^32} | "
              f"{'time to first step (s)':^32}")  # fmt: skip
        print(f"{'':>13} | {'before':>10}{'after':>10}{'reused':>12} | "
              f"{'before':>10}{'after':>10}{'reused':>12}")  # fmt: skip
        for n, b, first, again in rows:
            print(f"{n:>13} | {b['rss_mib']:>10.0f}{first['rss_mib']:>10.0f}"
                  f"{again['rss_mib']:>12.0f} | {b['first_step_s']:>10.1f}"
                  f"{first['first_step_s']:>10.1f}{again['first_step_s']:>12.1f}")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
