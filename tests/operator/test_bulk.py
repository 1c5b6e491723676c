"""Bulk copies through the OpenSSH client: the same host keys, strictly (nothing accepted,
nothing written), the same jump chain, the same deadline; paramiko's channel where the client
is not installed. Real sshd servers of the test bed."""

from __future__ import annotations

import glob
import hashlib
import itertools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from dflashops import transfer
from dflashops.errors import HostKeyError, NoAnswerError
from dflashops.inventory import load_inventory
from dflashops.ssh.session import Session
from tests.operator.cli import dflashops
from tests.operator.sshd_faults import RELAY, freeze, thaw

pytestmark = pytest.mark.testbed


@pytest.fixture
def home(tmp_path, monkeypatch):
    path = tmp_path / "home"
    (path / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(path))
    return path


def logins(host) -> int:
    return (host.dir / "sshd.log").read_text().count("Accepted publickey")


def big_file(tmp_path: Path, mb: int = 8) -> Path:
    path = tmp_path / "blob.bin"
    path.write_bytes(os.urandom(mb << 20))
    return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize(("path", "extra_logins"), [(None, 1), ("/nonexistent", 0)],
                         ids=["OpenSSH client", "no OpenSSH"])  # fmt: skip
def test_push_carries_its_bytes_through_the_openssh_client_where_installed(
    testbed, tmp_path, home, path, extra_logins
):
    inv = testbed.write_inventory(tmp_path / "hosts.yaml", {"ct201": ("pve1", 201)})
    src = big_file(tmp_path, 24)  # more than the receiver's buffers hold: each is reused
    known = (tmp_path / "known_hosts").read_text()
    before = logins(testbed["pve1"])
    dest = f"bulk/{extra_logins}/blob.bin"
    ran = dflashops("push", "ct201", str(src), dest, inventory=inv, home=home,
                    env={"PATH": path} if path else None)  # fmt: skip
    assert ran.code == 0, ran.err
    assert logins(testbed["pve1"]) - before == 1 + extra_logins
    assert digest(testbed["pve1"][201].host_path(f"/workspace/{dest}")) == digest(src)
    assert (tmp_path / "known_hosts").read_text() == known  # nothing written to our files
    assert not (home / ".ssh" / "known_hosts").exists()  # nor to OpenSSH's own


def test_push_through_a_jump_host_goes_through_it(testbed, tmp_path, home):
    inv = testbed.write_inventory(tmp_path / "hosts.yaml", {"ct301": ("pve2", 301)},
                                  extra_hosts={"pve1": {"address": testbed["pve1"].address}})  # fmt: skip
    inv.write_text(inv.read_text().replace("  pve2:\n", "  pve2:\n    jump: pve1\n"))
    src = big_file(tmp_path)
    log = (testbed["pve2"].dir / "sshd.log").read_text()
    ran = dflashops("push", "ct301", str(src), "bulk/jumped.bin", inventory=inv, home=home)
    assert ran.code == 0, ran.err
    new = (testbed["pve2"].dir / "sshd.log").read_text()[len(log) :]
    froms = [x.split(" from ")[1].split()[0] for x in new.splitlines() if "Accepted publickey" in x]
    assert (
        froms == [testbed["pve1"].address] * 2
    )  # paramiko's login and the client's, both via pve1
    assert digest(testbed["pve2"][301].host_path("/workspace/bulk/jumped.bin")) == digest(src)


def test_push_through_a_proxy_command_goes_through_it(testbed, tmp_path, home):
    relay = tmp_path / "relay.py"
    relay.write_text(RELAY)
    pve1, count = testbed["pve1"], tmp_path / "relayed"
    (home / ".ssh" / "config").write_text(
        f"Host relayed\n  HostName {pve1.address}\n  Port {pve1.port}\n"
        f"  ProxyCommand sh -c 'echo >> {count}; exec {sys.executable} {relay} %h %p'\n"
    )
    inv = testbed.write_inventory(tmp_path / "hosts.yaml", {"ct201": ("pve1", 201)})
    inv.write_text(inv.read_text().replace(f"address: {pve1.address}", "address: relayed"))
    src = big_file(tmp_path)
    ran = dflashops("push", "ct201", str(src), "bulk/proxied.bin", inventory=inv, home=home)
    assert ran.code == 0, ran.err
    assert count.read_text() == "\n\n"  # paramiko's connection and the client's
    assert digest(testbed["pve1"][201].host_path("/workspace/bulk/proxied.bin")) == digest(src)


def test_a_killed_copy_leaves_no_client_config_behind_the_next_command(testbed, tmp_path, home):
    inv = testbed.write_inventory(tmp_path / "hosts.yaml", {"ct201": ("pve1", 201)})
    src = big_file(tmp_path, 256)
    argv = [sys.executable, "-m", "dflashops.cli", "--inventory", str(inv), "push", "ct201",
            str(src), "bulk/killed.bin"]  # fmt: skip
    proc = subprocess.Popen(argv, env={**os.environ, "HOME": str(home)}, stderr=subprocess.PIPE)
    pattern = f"{tempfile.gettempdir()}/dflashops-ssh-{proc.pid}-*"
    deadline = time.monotonic() + 60
    while not glob.glob(pattern) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert glob.glob(pattern), proc.stderr.read() if proc.poll() is not None else "no config"
    proc.kill()
    proc.wait()
    assert glob.glob(pattern)  # a killed command cleans nothing up itself
    ran = dflashops("push", "ct201", str(big_file(tmp_path, 1)), "bulk/next.bin",
                    inventory=inv, home=home)  # fmt: skip
    assert ran.code == 0, ran.err
    assert glob.glob(pattern) == []


def test_the_openssh_client_refuses_a_key_that_changed_after_login(testbed, tmp_path, home):
    """The client checks the host key against our files itself, strictly: a key that no longer
    matches (swapped after paramiko's login) stops the copy; nothing is accepted or written."""
    inv = testbed.write_inventory(tmp_path / "hosts.yaml", {"ct201": ("pve1", 201)})
    known = tmp_path / "known_hosts"
    with Session(load_inventory(inv)) as session:
        machine = session.machine("ct201")
        assert machine.run(["true"]).ok  # logged in with the right key
        wrong = testbed.known_hosts_line("pve2").split(" ", 1)[1]
        known.write_text(f"{testbed['pve1'].address} {wrong}")
        with pytest.raises(HostKeyError, match="OpenSSH client refused the host key"):
            transfer.put(machine, big_file(tmp_path, 1), "bulk/refused.bin")
    assert known.read_text() == f"{testbed['pve1'].address} {wrong}"
    assert not (home / ".ssh" / "known_hosts").exists()


def test_a_bulk_copy_to_a_stopped_sshd_ends_within_the_deadline(testbed, tmp_path, home):
    """sshd stops while the OpenSSH client is copying: its keepalive (ServerAlive, the same
    deadline) ends it, and the call fails like any other that gets no answer."""
    inv = testbed.write_inventory(tmp_path / "hosts.yaml", {"ct201": ("pve1", 201)})
    frozen: list[int] = []
    began = [0.0]

    def feed():
        for i in itertools.count():
            if i == 20:  # the client has taken 1 MiB: it is connected and copying
                frozen.extend(freeze(testbed["pve1"]))
                began[0] = time.monotonic()
            yield b"x" * 65536
            time.sleep(0.05)

    try:
        with Session(load_inventory(inv), timeout=3) as session:
            machine = session.machine("ct201")
            with pytest.raises(NoAnswerError, match="ct201: no answer in 3 s"):
                machine.run(["sh", "-c", "cat > /dev/null"], stdin=feed(), bulk=True)
            assert frozen and time.monotonic() - began[0] < 3 + 5
    finally:
        thaw(frozen)
