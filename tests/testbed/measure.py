"""Timings of the test bed: `python -m tests.testbed.measure [--cold]` (as root).

--cold builds the LXC rootfs into a fresh cache dir first (debootstrap, about a minute).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time
from pathlib import Path

from .bed import TestBed
from .sshclient import run


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def start_bed(with_lxc: bool) -> tuple[TestBed, float]:
    started = time.perf_counter()
    bed = TestBed(("pve1", "pve2")).start()
    bed["pve1"].add_container(201)
    bed["pve2"].add_container(301)
    bed["pve2"].add_container(302, "lxc" if with_lxc else "ns")
    return bed, time.perf_counter() - started


def exec_round_trip(bed: TestBed, host: str, vmid: int, n: int = 20) -> float:
    with bed.ssh(host) as client:
        samples = [timed(lambda: run(client, f"pct exec {vmid} -- true")) for _ in range(n)]
    return statistics.median(samples)


def push_200mb(bed: TestBed, host: str, vmid: int, source: Path, digest: str) -> float:
    ct = bed[host][vmid]
    with bed.ssh(host) as client:
        seconds = timed(
            lambda: run(client, f"pct exec {vmid} -- sh -c 'cat > /workspace/big'", stdin=source)
        )
    got = hashlib.sha256(ct.host_path("/workspace/big").read_bytes()).hexdigest()
    assert got == digest, "200 MB push arrived corrupted"
    ct.host_path("/workspace/big").unlink()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cold", action="store_true", help="time a debootstrap of the rootfs")
    args = parser.parse_args()
    if args.cold:
        with tempfile.TemporaryDirectory(dir="/var/cache") as cache:
            os.environ["DFLASHOPS_TESTBED_CACHE"] = cache
            bed, seconds = start_bed(with_lxc=True)
            bed.close()
            print(f"cold bed start (2 hosts, 2 ns + 1 lxc CT, debootstrap): {seconds:.1f} s")
        del os.environ["DFLASHOPS_TESTBED_CACHE"]
    for with_lxc in (False, True):
        bed, seconds = start_bed(with_lxc)
        bed.close()
        kinds = "2 ns + 1 lxc" if with_lxc else "3 ns"
        print(f"warm bed start (2 hosts, {kinds} CTs): {seconds:.2f} s")
    bed, _ = start_bed(with_lxc=True)
    try:
        mode = bed.mode
        with bed.ssh("pve1") as client:
            bare = statistics.median(timed(lambda: run(client, "true")) for _ in range(20))
        print(f"[{mode}] ssh exec of `true` (baseline): {bare * 1000:.0f} ms")
        for host, vmid, kind in (("pve1", 201, "ns"), ("pve2", 302, "lxc")):
            rtt = exec_round_trip(bed, host, vmid)
            print(f"[{mode}] ssh + pct exec {kind}: {rtt * 1000:.0f} ms (median of 20)")
        with tempfile.NamedTemporaryFile(dir="/var/tmp") as big:
            data = os.urandom(200 << 20)
            big.write(data)
            big.flush()
            digest = hashlib.sha256(data).hexdigest()
            del data
            for host, vmid, kind in (("pve1", 201, "ns"), ("pve2", 302, "lxc")):
                seconds = push_200mb(bed, host, vmid, Path(big.name), digest)
                print(f"[{mode}] 200 MB via pct exec stdin, {kind}: {seconds:.2f} s "
                      f"({200 / seconds:.0f} MB/s, sha256 ok)")  # fmt: skip
    finally:
        bed.close()


if __name__ == "__main__":
    main()
