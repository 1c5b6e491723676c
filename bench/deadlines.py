"""Faults against deadlines: what each command does and how long it takes to answer.

Run: python bench/deadlines.py [--timeout 5]. Needs root. Each fault is made on the test bed
(sshd stopped with SIGSTOP, a container whose python3 hangs); the time is from the fault (or
the start, for faults there from the beginning) to the command's exit.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _bed import bed, dflashops_argv, home_env

from tests.operator.sshd_faults import HUNG_PYTHON, RELAY, freeze, thaw

EXEC = ["exec", "ct201", "--", "sh", "-c", "echo started; sleep 120"]


def during(argv: list[str], env: dict, host, ready: str) -> tuple[int, float, str]:
    """Start `argv`, freeze `host`'s sshd once `ready` shows on stdout (or, when empty, after
    a second of copying), time the exit."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    if ready:
        proc.stdout.readline()
    else:
        time.sleep(3)
    pids = freeze(host)
    began = time.monotonic()
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        thaw(pids)
    return proc.returncode, time.monotonic() - began, err.decode().strip().splitlines()[-1]


def whole(argv: list[str], env: dict) -> tuple[int, float, str]:
    began = time.monotonic()
    done = subprocess.run(argv, capture_output=True, env=env, timeout=120)
    lines = done.stderr.decode().strip().splitlines() or ["-"]
    return done.returncode, time.monotonic() - began, lines[-1]


def frozen_from_start(argv: list[str], env: dict, host) -> tuple[int, float, str]:
    pids = freeze(host)
    try:
        return whole(argv, env)
    finally:
        thaw(pids)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=5)
    t = str(parser.parse_args().timeout)
    with bed({"pve1": [201], "pve2": [301]}) as tb, tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        env = home_env(tmpdir)
        (tmpdir / "home" / ".ssh").mkdir(parents=True)
        pve1, pve2 = tb["pve1"], tb["pve2"]
        direct = tb.write_inventory(tmpdir / "direct.yaml", {"ct201": ("pve1", 201)})
        jumped = tb.write_inventory(tmpdir / "jumped.yaml", {"ct201": ("pve2", 301)},
                                    extra_hosts={"pve1": {"address": pve1.address}})  # fmt: skip
        jumped.write_text(jumped.read_text().replace("  pve2:\n", "  pve2:\n    jump: pve1\n"))
        relay = tmpdir / "relay.py"
        relay.write_text(RELAY)
        (tmpdir / "home" / ".ssh" / "config").write_text(
            f"Host relayed\n  HostName {pve1.address}\n  Port {pve1.port}\n"
            f"  ProxyCommand {sys.executable} {relay} %h %p\n"
        )
        proxied = tmpdir / "proxied.yaml"
        proxied.write_text(
            direct.read_text().replace(f"address: {pve1.address}", "address: relayed")
        )
        hung = pve2.add_container(901)
        wrapper = hung.host_path("/root/bin/python3")
        wrapper.parent.mkdir(parents=True)
        wrapper.write_text(HUNG_PYTHON)
        wrapper.chmod(0o755)
        extra = {"path": "/root/bin:/usr/sbin:/usr/bin:/sbin:/bin", "python": "/root/bin/python3"}
        mixed = tb.write_inventory(
            tmpdir / "mixed.yaml",
            {"ct201": ("pve1", 201), "ct301": ("pve2", 301), "stuck": ("pve2", 901, extra)},
        )
        blob = tmpdir / "blob.bin"
        blob.write_bytes(os.urandom(1 << 30))
        faults = [
            ("exec; sshd SIGSTOPped while it runs", lambda: during(
                dflashops_argv(direct, "--timeout", t, *EXEC), env, pve1, "started")),
            ("exec through a jump host; sshd behind it SIGSTOPped", lambda: during(
                dflashops_argv(jumped, "--timeout", t, *EXEC), env, pve2, "started")),
            ("exec through a ProxyCommand; sshd SIGSTOPped", lambda: during(
                dflashops_argv(proxied, "--timeout", t, *EXEC), env, pve1, "started")),
            ("exec; sshd SIGSTOPped before it starts", lambda: frozen_from_start(
                dflashops_argv(direct, "--timeout", t, "exec", "ct201", "--", "true"), env, pve1)),
            ("push 1 GiB; sshd SIGSTOPped during the copy", lambda: during(
                dflashops_argv(direct, "--timeout", t, "push", "ct201", str(blob), "f/blob.bin"),
                env, pve1, "")),
            ("hosts; one container's python3 hangs", lambda: whole(
                dflashops_argv(mixed, "--timeout", t, "hosts"), env)),
            ("status --all; one container's python3 hangs", lambda: whole(
                dflashops_argv(mixed, "--timeout", t, "status", "--all"), env)),
        ]  # fmt: skip
        print(f"--timeout {t}")
        print(f"{'fault':<54} {'exit':>4} {'answer in':>9}  last line on stderr")
        for label, fault in faults:
            code, seconds, line = fault()
            print(f"{label:<54} {code:>4} {seconds:8.1f}s  {line[:90]}")
        time.sleep(5)  # the receiver of the cut push sees its stdin end once sshd runs again
        dest = pve1[201].host_path("/workspace/f")
        left = sorted(os.listdir(dest)) if dest.exists() else []
        print(f"left in ct201:/workspace/f after the cut push: {left or 'nothing'}")


if __name__ == "__main__":
    main()
