"""Where the operator finds the workload it ships to targets, and where it puts it there."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REMOTE_HOME = "dflashops"  # under the target's workspace


def workload_dir() -> Path:
    return ROOT / "workload"


def templates_dir() -> Path:
    return ROOT / "templates"


def requirements_file() -> Path:
    return workload_dir() / "requirements.txt"


def shipped(rel: str) -> bool:
    """False for build litter that never travels (caches, compiled files)."""
    parts = rel.split("/")
    return not any(p == "__pycache__" or p.endswith(".pyc") or p == ".pytest_cache" for p in parts)
