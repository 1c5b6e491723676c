"""Shared fixtures for workload tests: a tiny chat tokenizer and tiny targets (dense, hybrid).

The tiny targets are built once and cached under $DFLASHOPS_TEST_CACHE (default: a folder in
the system temp dir), keyed by the source of the code that builds them and the build options,
so a change to workload/tiny.py or workload/data/ (chat.py, batches.py) rebuilds them and nothing else does.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

WORKLOAD = Path(__file__).resolve().parents[2] / "workload"
# Small enough for a test session, trained enough that greedy replies follow the task patterns.
FIXTURE_BUILDS = {
    "dense": {"kind": "dense", "steps": 300, "conversations": 1200, "prompts": 24, "seed": 0},
    "hybrid": {"kind": "hybrid", "steps": 150, "conversations": 600, "prompts": 24, "seed": 0},
}


def cache_root() -> Path:
    root = os.environ.get("DFLASHOPS_TEST_CACHE") or Path(tempfile.gettempdir()) / "dflashops-tests"
    return Path(root)


def build_key(options: dict) -> str:
    import torch
    import transformers

    h = hashlib.sha256()
    for name in ("tiny.py", "data/chat.py", "data/batches.py", "drafter/targets.py"):
        h.update((WORKLOAD / name).read_bytes())
    h.update(repr(sorted(options.items())).encode())
    h.update(f"{torch.__version__} {transformers.__version__}".encode())
    return f"tiny-{options['kind']}-{h.hexdigest()[:16]}"


def cached_tiny(options: dict) -> Path:
    """The build directory for `options`, building it (once, under a lock) when missing."""
    import torch

    from workload import tiny

    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    final = root / build_key(options)
    with open(root / f"{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "tiny.json").is_file():
            return final
        for stale in root.glob(f"{final.name}.tmp-*"):  # left by a build that was killed
            shutil.rmtree(stale, ignore_errors=True)
        tmp = root / f"{final.name}.tmp-{os.getpid()}"
        rng_state, py_state = torch.get_rng_state(), random.getstate()
        t0 = time.time()
        try:
            tiny.build(tmp, **options)
        finally:
            torch.set_rng_state(rng_state)
            random.setstate(py_state)
        _retarget(tmp, final)
        os.rename(tmp, final)
        print(f"\n[conftest] built {final.name} in {time.time() - t0:.1f}s")
    return final


def _retarget(tmp: Path, final: Path) -> None:
    """run.yaml holds absolute paths; point them at the final directory."""
    run = tmp / "run.yaml"
    run.write_text(run.read_text().replace(str(tmp.resolve()), str(final.resolve())))


@pytest.fixture(scope="session")
def tiny_dense() -> Path:
    """A tiny dense (Qwen3) target build: target/, data.jsonl, prompts.jsonl, run.yaml."""
    return cached_tiny(FIXTURE_BUILDS["dense"])


@pytest.fixture(scope="session")
def tiny_hybrid() -> Path:
    """A tiny hybrid (Qwen3.5 text: Gated DeltaNet + full attention) target build."""
    return cached_tiny(FIXTURE_BUILDS["hybrid"])


@pytest.fixture(scope="session")
def chat_tokenizer():
    """A byte-level BPE tokenizer with the tiny ChatML template (no `{% generation %}` markers)."""
    from workload import tiny

    r = random.Random(0)
    convs = [tiny.conversation(r)[0] for _ in range(200)]
    return tiny.build_tokenizer([tiny.chatml(c) for c in convs], vocab_size=512)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny-tensor tests (opt in with usefixtures): a second
    thread only adds synchronisation, and suffers most when other processes share the cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
