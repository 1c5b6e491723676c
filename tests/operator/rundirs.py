"""Run directories as the trainer leaves them (contract sections 2-4), and a stand-in trainer
that writes them, for tests that read or drive runs without training."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

STAND_IN_TRAINER = """\
#!/usr/bin/python3
# Stands in for `python -m workload.train` where torch is not installed: the same run-dir
# protocol (state.json, train_log.jsonl, console output; on SIGTERM a checkpoint with its
# manifest and exit 0, state "stopped"; --resume goes on after the newest checkpoint, its log
# rewound to it), so the launch machinery can be tried for real in a second.
import hashlib, json, os, signal, sys, time
if "workload.plan" in sys.argv:  # the memory plan, answered as workload.plan would
    print(json.dumps({"world": 1, "sharding": "none", "device": "cpu", "per_rank": {"total": 1 << 20},
                      "gpu_memory": None, "fits": None, "notes": []}))
    sys.exit(0)
run = sys.argv[sys.argv.index("--run-dir") + 1]
json.dump(dict(os.environ), open(os.path.join(run, "env.json"), "w"))
stop = []
if "# IGNORE_TERM" in open("run.yaml").read():  # a trainer that does not stop when asked
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
def state(**kw):
    path = os.path.join(run, "state.json")
    s = json.load(open(path)) if os.path.exists(path) else {}
    s.update(kw)
    json.dump(s, open(path + ".tmp", "w"))
    os.replace(path + ".tmp", path)
log_path, step = os.path.join(run, "train_log.jsonl"), 0
if "--resume" in sys.argv:
    step = max(int(n[5:]) for n in os.listdir(os.path.join(run, "checkpoints")))
    kept = [line for line in open(log_path) if json.loads(line)["step"] <= step]
    open(log_path + ".tmp", "w").writelines(kept)
    os.replace(log_path + ".tmp", log_path)
with open(log_path, "a") as log:
    while not stop and step < 1000:
        step += 1
        log.write(json.dumps({"step": step, "time": time.time(), "loss": 1 / step}) + "\\n")
        log.flush()
        print(f"step {step}/1000 loss {1 / step:.4f}", flush=True)
        if not stop:  # running once a first step is logged
            state(pid=os.getpid(), started=time.time(), status="running", exit_code=None,
                  finished=None, total_steps=1000)
        time.sleep(0.2)
ckpt = os.path.join(run, "checkpoints", f"step_{step}")
os.makedirs(ckpt)
open(os.path.join(ckpt, "model.safetensors"), "wb").write(os.urandom(4096))
digest = hashlib.sha256(open(os.path.join(ckpt, "model.safetensors"), "rb").read()).hexdigest()
open(os.path.join(ckpt, "MANIFEST.sha256"), "w").write(f"{digest}  model.safetensors\\n")
state(status="stopped", finished=time.time(), exit_code=0, last_step=step)
print(f"stopped at step {step} on request", flush=True)
"""


def make_run(
    ws: Path,
    name: str,
    records: list[dict] | None = None,
    *,
    where: str = "runs",
    ckpts: tuple[int, ...] = (),
    log_text: str | None = None,
    status: str = "finished",
) -> Path:
    """A run directory as the trainer leaves it."""
    run = ws / where / name
    (run / "checkpoints").mkdir(parents=True)
    now = time.time()
    records = records or [{"step": s, "time": now - 100 + s, "loss": 5.0 / s, "acc": s / 100}
                          for s in (10, 20, 30)]  # fmt: skip
    text = log_text if log_text is not None else "".join(json.dumps(r) + "\n" for r in records)
    (run / "train_log.jsonl").write_text(text)
    state = {"status": status, "exit_code": 0, "started": now - 100, "finished": now,
             "last_step": records[-1]["step"], "pid": 999999}  # fmt: skip
    (run / "state.json").write_text(json.dumps(state))
    (run / "run.yaml").write_text("loss: {type: ce}\noptim: {max_steps: 30}\n")
    (run / "console.log").write_text("step 30/30 loss 0.1\n")
    for step in ckpts:
        write_checkpoint(run / "checkpoints" / f"step_{step}", step)
    return run


def write_checkpoint(path: Path, step: int, *, complete: bool = True) -> None:
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(os.urandom(1000 + step))
    (path / "config.json").write_text(json.dumps({"step": step}))
    if complete:
        lines = [
            f"{hashlib.sha256((path / n).read_bytes()).hexdigest()}  {n}\n"
            for n in ("config.json", "model.safetensors")
        ]
        (path / "MANIFEST.sha256").write_text("".join(lines))
