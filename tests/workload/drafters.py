"""The tiny template's settings for a tiny build, and one trained tiny drafter shared by the
tests that need one (test_train's learning check reads its log, test_eval_vllm evaluates its
checkpoint): trained once per code version, cached beside the builds (tests/workload/conftest.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from tests.workload.conftest import WORKLOAD, cache_root

REPO = WORKLOAD.parent
TEMPLATE = REPO / "templates" / "runs" / "tiny.yaml"
STEPS = 200  # the dense drafter learns (test_train) and drafts a tau near 3 (test_eval_vllm)
# the eval side: a change here does not retrain the drafter
NOT_TRAINING = ("eval/", "data/datagen/", "data/inspect_rows.py", "inspect_data.py",
                "datagen.py", "parity.py", "serve_bench.py")  # fmt: skip


def build_settings(build: Path) -> list[str]:
    """What `workload.tiny` filled into its run.yaml, as overrides of the current template
    (the cached build's run.yaml may come from an older template)."""
    made = yaml.safe_load((build / "run.yaml").read_text())
    return [
        f"target.path={made['target']['path']}",
        f"data.path={made['data']['path']}",
        f"drafter.mask_token_id={made['drafter']['mask_token_id']}",
        f"data.pack={str(made['data'].get('pack', False)).lower()}",
    ]


def trained_drafter(build: Path) -> Path:
    """The run directory of a drafter trained STEPS steps on `build` with the tiny template
    (its log, and checkpoints/step_STEPS), cached keyed by the build, the template and the
    trainer's code, trained once under a lock (the first test to ask waits for it)."""
    sets = [*build_settings(build), f"optim.max_steps={STEPS}", f"checkpoint.every={STEPS}"]
    h = hashlib.sha256(f"{build.name} {sets}".encode())
    h.update(TEMPLATE.read_bytes())
    for path in sorted(WORKLOAD.rglob("*.py")):
        if not path.relative_to(WORKLOAD).as_posix().startswith(NOT_TRAINING):
            h.update(path.read_bytes())
    final = cache_root() / f"drafter-{h.hexdigest()[:16]}"
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{final}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "checkpoints" / f"step_{STEPS}" / "MANIFEST.sha256").is_file():
            return final
        tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        argv = [sys.executable, "-m", "workload.train", "--config", str(TEMPLATE),
                "--run-dir", str(tmp), *(a for s in sets for a in ("--set", s))]  # fmt: skip
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
        done = subprocess.run(argv, capture_output=True, text=True, timeout=3600, cwd=REPO,
                              env=env)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
    return final
