"""`dflashops fetch-model` of one large file from the hub stand-in (tests/operator/hub_standin.py,
loopback, no rate limit) against `curl` of the same file from the same stand-in into a file,
and the verify pass of a complete copy (a second fetch-model: every file hashed, nothing
fetched) per GB.

Run: python bench/fetch_throughput.py [--mb 1536] [--runs 2]. A `local` target on this
machine; fetch-model's time is the whole command (process start, listing, HEAD, download,
then the sha256 of what arrived); "fetch" is the helper's own timing of its download phase
(download and hash), "check" that of the verify pass. curl verifies nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _bed import ROOT

from tests.operator.hub_standin import COMMIT, Hub

TOKEN = "bench-token"
REPO = "org/bench-model"


def timed(argv: list[str], env: dict) -> tuple[float, float, bytes]:
    """Wall seconds, CPU seconds of the command and everything it waited for, its stdout."""
    began, cpu = time.perf_counter(), _children_cpu()
    done = subprocess.run(argv, capture_output=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{argv[:4]}: exit {done.returncode}: {done.stderr.decode()[-2000:]}")
    return time.perf_counter() - began, _children_cpu() - cpu, done.stdout


def _children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=1536)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fetch-bench-"))
    try:
        big = tmp / "model.safetensors"
        block = os.urandom(1 << 20)
        with big.open("wb") as f:
            for _ in range(args.mb):
                f.write(block)
        hub = Hub(REPO, {"model.safetensors": big}, {"model.safetensors"}, TOKEN)
        env = {**os.environ, "DFO_HUB_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)}
        target = {"kind": "local", "workspace": str(tmp / "ws"), "python": sys.executable,
                  "env": {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp / "hf-home"),
                          "HF_HUB_DISABLE_XET": "1"}}  # fmt: skip
        inventory = tmp / "hosts.yaml"
        inventory.write_text("version: 1\ntargets:\n  here: " + json.dumps(target) + "\n")
        fetch = [sys.executable, "-m", "dflashops.cli", "--inventory", str(inventory), "--json",
                 "fetch-model", "here", REPO, "--secret", "DFO_HUB_TOKEN"]  # fmt: skip
        url = f"{hub.url}/{REPO}/resolve/{COMMIT}/model.safetensors"
        curl = ["curl", "-sS", "--fail", "-H", f"Authorization: Bearer {TOKEN}", "-o",
                str(tmp / "curl.out"), url]  # fmt: skip
        gb = args.mb * (1 << 20) / 1e9
        for _ in range(args.runs):
            shutil.rmtree(tmp / "ws", ignore_errors=True)
            (tmp / "curl.out").unlink(missing_ok=True)
            curl_s, curl_cpu, _ = timed(curl, env)
            ours_s, ours_cpu, out = timed(fetch, env)
            first = json.loads(out)
            verify_s, verify_cpu, out = timed(fetch, env)
            check_s = json.loads(out)["seconds"]["check"]
            print(f"{args.mb} MiB: curl {curl_s:.2f} s ({gb / curl_s:.2f} GB/s, "
                  f"{curl_cpu / gb:.2f} CPU s/GB); fetch-model {ours_s:.2f} s "
                  f"({gb / ours_s:.2f} GB/s, {ours_cpu / gb:.2f} CPU s/GB; its download and "
                  f"hash {first['seconds']['fetch']:.2f} s): throughput ratio "
                  f"{curl_s / ours_s:.2f}; verify pass {check_s:.2f} s ({check_s / gb:.2f} "
                  f"s/GB; the whole rerun {verify_s:.2f} s, {verify_cpu / gb:.2f} CPU s/GB)")  # fmt: skip
        hub.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
