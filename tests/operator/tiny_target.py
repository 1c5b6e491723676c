"""The tiny target the bed's runs train on: built once per cache key (the code that builds it
and its options) under $DFLASHOPS_TEST_CACHE, pushed into containers by the tests."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


TINY_OPTIONS = ["--steps", "1", "--conversations", "120", "--prompts", "3", "--no-regenerate"]


def tiny_build() -> Path:
    """A tiny target (barely trained: only its format matters here), cached by code and options."""
    key = hashlib.sha256()
    for name in ("tiny.py", "data/chat.py", "data/batches.py"):
        key.update((ROOT / "workload" / name).read_bytes())
    key.update(repr(TINY_OPTIONS).encode())
    root = Path(
        os.environ.get("DFLASHOPS_TEST_CACHE") or Path(tempfile.gettempdir()) / "dflashops-tests"
    )
    out = root / f"ops-tiny-{key.hexdigest()[:16]}"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{out.name}.lock", "w") as lock:  # another worker or tests.prebuild
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "run.yaml").is_file():
            tmp = root / f"{out.name}.tmp{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            env = {**os.environ, "HF_HUB_OFFLINE": "1"}
            cmd = [sys.executable, "-m", "workload.tiny", "--out", str(tmp), *TINY_OPTIONS]
            subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=ROOT, timeout=600)
            os.replace(tmp, out)
    return out


def tiny_run_config(
    cli, out: Path, sections: dict, targets=("train", "evalbox"), name: str = "run.yaml"
) -> Path:
    """The tiny build pushed into each target at /workspace/tiny, and a run config in `out`
    pointing at it there, with `sections` ({"optim": {...}, ...}) merged into its sections."""
    import yaml

    tiny = tiny_build()
    for target in targets:
        pushed = cli("push", target, str(tiny), "/workspace/tiny")
        assert pushed.code == 0, pushed.err
    cfg = yaml.safe_load((tiny / "run.yaml").read_text())
    cfg["target"]["path"] = "/workspace/tiny/target"
    cfg["data"]["path"] = "/workspace/tiny/data.jsonl"
    for section, values in sections.items():
        cfg[section].update(values)
    path = out / name
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path
