"""The Debian bookworm rootfs of the LXC tier, built once with debootstrap and cached.

$DFLASHOPS_TESTBED_CACHE (default /var/cache/dflashops-testbed)/bookworm-minbase-v1/rootfs,
complete once bookworm-minbase-v1/complete exists. Containers never write to it: each one
gets an overlay. $DFLASHOPS_TESTBED_LXC: `auto` (default; use LXC if the rootfs exists or
can be built), `0` (never), `require` (fail loudly when it can't be had).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
from pathlib import Path

from .slots import TestBedError

NAME = "bookworm-minbase-v1"
PACKAGES = "python3,python3-venv,tmux,ca-certificates"
TOOLS = ("debootstrap", "lxc-start", "lxc-attach", "lxc-stop")


def cache_dir() -> Path:
    return Path(os.environ.get("DFLASHOPS_TESTBED_CACHE", "/var/cache/dflashops-testbed"))


def lxc_mode() -> str:
    mode = os.environ.get("DFLASHOPS_TESTBED_LXC", "auto").strip().lower() or "auto"
    if mode not in ("auto", "0", "require"):
        raise TestBedError(f"DFLASHOPS_TESTBED_LXC={mode!r}: expected auto, 0 or require")
    return mode


def cached_rootfs() -> Path | None:
    target = cache_dir() / NAME
    return target / "rootfs" if (target / "complete").exists() else None


def ensure_rootfs(timeout: float = 900) -> Path:
    """The cached rootfs, built first if needed (about a minute and 280 MB)."""
    found = cached_rootfs()
    if found:
        return found
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise TestBedError(f"LXC tier needs {', '.join(missing)} (apt-get install lxc debootstrap)")
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = cached_rootfs()
        if found:
            return found
        return _build(cache, timeout)


def _build(cache: Path, timeout: float) -> Path:
    work = cache / f"{NAME}.building"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    argv = [
        "debootstrap",
        "--variant=minbase",
        f"--include={PACKAGES}",
        "bookworm",
        str(work / "rootfs"),
        mirror(),
    ]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise TestBedError(f"{' '.join(argv)} took more than {timeout:.0f} s") from None
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-2000:]
        raise TestBedError(f"{' '.join(argv)} failed (exit {proc.returncode}):\n{tail}")
    (work / "complete").write_text(" ".join(argv) + "\n")
    target = cache / NAME
    shutil.rmtree(target, ignore_errors=True)
    work.rename(target)
    return target / "rootfs"


def mirror() -> str:
    """$DFLASHOPS_TESTBED_MIRROR, else the first Debian mirror apt is configured with."""
    if os.environ.get("DFLASHOPS_TESTBED_MIRROR"):
        return os.environ["DFLASHOPS_TESTBED_MIRROR"]
    sources = [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*")]
    for path in sources:
        try:
            text = path.read_text()
        except OSError:
            continue
        for url in re.findall(r"(?:^deb\s+(?:\[[^]]*\]\s+)?|URIs:\s*)(\S+)", text, re.M):
            if url.startswith("http") and "security" not in url and "debian" in url:
                return url
    return "http://deb.debian.org/debian"
