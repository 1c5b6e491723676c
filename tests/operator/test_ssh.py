"""The SSH layer against the fake Proxmox bed: ~/.ssh/config, jump chains and loops, sshd's
session limit, signals, dead pipes. Real sshd servers; nothing mocked."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.operator.cli import dflashops

pytestmark = pytest.mark.testbed


@pytest.fixture
def home(tmp_path):
    path = tmp_path / "home"
    (path / ".ssh").mkdir(parents=True)
    return path


def logins(testbed, host: str) -> list[str]:
    """The addresses sshd of `host` accepted a login from, in order."""
    log = (testbed[host].dir / "sshd.log").read_text()
    return [line.split(" from ")[1].split()[0] for line in log.splitlines()
            if "Accepted publickey" in line]  # fmt: skip


def test_ssh_config_alias_user_port_and_proxyjump_none(testbed, tmp_path, home):
    """The common idiom: every host through a bastion, the bastion itself directly."""
    pve1, pve2 = testbed["pve1"], testbed["pve2"]
    (home / ".ssh" / "config").write_text(
        f"Host bastion\n  HostName {pve1.address}\n  User root\n  ProxyJump none\n"
        f"  IdentityFile {testbed.client_key}\n"
        f"Host p2\n  HostName {pve2.address}\n  Port {pve2.port}\n  User root\n"
        f"  IdentityFile {testbed.client_key}\n"
        "Host *\n  ProxyJump bastion\n"
    )
    testbed.write_known_hosts(home / ".ssh" / "known_hosts")
    inv = tmp_path / "hosts.yaml"
    inv.write_text("hosts:\n  pve2: {address: p2}\ntargets:\n  ct301: {host: pve2, vmid: 301}\n")
    before = len(logins(testbed, "pve2"))
    ran = dflashops("exec", "ct301", "--", "hostname", inventory=inv, home=home)
    assert ran.code == 0, ran.err
    assert ran.out == "ct301\n"
    assert logins(testbed, "pve2")[before:] == [pve1.address]  # it came through the bastion


def test_multi_hop_jump_goes_through_every_hop_in_order(testbed, tmp_path, home):
    """pve1 reached through `pve2,hop1`: us -> pve2 -> hop1 (pve1 under another name) -> pve1."""
    pve1, pve2 = testbed["pve1"], testbed["pve2"]
    inv = testbed.write_inventory(
        tmp_path / "hosts.yaml", {"ct201": ("pve1", 201), "x": ("pve2", 301)}
    )
    inv.write_text(inv.read_text().replace("  pve1:\n", "  pve1:\n    jump: pve2,hop1\n"))
    testbed.write_known_hosts(home / ".ssh" / "known_hosts")
    (home / ".ssh" / "config").write_text(
        f"Host hop1\n  HostName {pve1.address}\n  IdentityFile {testbed.client_key}\n"
    )
    before1, before2 = len(logins(testbed, "pve1")), len(logins(testbed, "pve2"))
    ran = dflashops("exec", "ct201", "--", "hostname", inventory=inv, home=home)
    assert ran.code == 0, ran.err
    assert ran.out == "ct201\n"
    assert len(logins(testbed, "pve2")[before2:]) == 1
    assert logins(testbed, "pve1")[before1:] == [pve2.address, pve1.address]


def test_jump_loop_is_an_error_not_a_hang(testbed, tmp_path, home):
    inv = testbed.write_inventory(tmp_path / "hosts.yaml", {"ct201": ("pve1", 201)})
    text = inv.read_text().replace("  pve1:\n", "  pve1:\n    jump: pve9\n")
    text = text.replace(
        "hosts:\n", f"hosts:\n  pve9:\n    address: {testbed['pve2'].address}\n    jump: pve1\n"
    )
    inv.write_text(text)
    ran = dflashops("exec", "ct201", "--", "true", inventory=inv, home=home, timeout=60)
    assert ran.code == 2, ran
    assert "jump loop: pve1 -> pve9 -> pve1" in ran.err
    assert len(ran.err.strip().splitlines()) == 1


def test_malformed_jump_is_refused_before_any_connection(testbed, tmp_path, home):
    inv = testbed.write_inventory(tmp_path / "hosts.yaml", {"ct201": ("pve1", 201)})
    inv.write_text(inv.read_text().replace("  pve1:\n", "  pve1:\n    jump: root@bastion:2x\n"))
    ran = dflashops("exec", "ct201", "--", "true", inventory=inv, home=home)
    assert (
        ran.code == 2 and "hosts.pve1.jump: 'root@bastion:2x' is not [user@]host[:port]" in ran.err
    )


def test_more_containers_than_sshd_sessions_on_one_host(testbed, make_container, tmp_path, home):
    """sshd allows 10 sessions per connection (MaxSessions, as on Proxmox); 12 CTs still work."""
    cts = [make_container("pve1") for _ in range(12)]
    inv = testbed.write_inventory(tmp_path / "hosts.yaml", {f"c{ct.vmid}": ct for ct in cts})
    ran = dflashops("--json", "hosts", inventory=inv, home=home)
    assert ran.code == 0, ran.out
    states = [t["state"] for t in json.loads(ran.out)["targets"]]
    assert states == ["running"] * 12


def test_a_command_killed_by_a_signal_exits_128_plus_n(testbed, tmp_path, home):
    inv = testbed.write_inventory(tmp_path / "hosts.yaml", {"box": "pve2", "ct201": ("pve1", 201)})
    for target in ("box", "ct201"):
        ran = dflashops("exec", target, "--", "sh", "-c", "kill -9 $$", inventory=inv, home=home)
        assert ran.code == 137, (target, ran)


def test_a_closed_stdout_ends_quietly(testbed, tmp_path, home):
    inv = testbed.write_inventory(tmp_path / "hosts.yaml", {"ct201": ("pve1", 201)})
    cmd = [sys.executable, "-m", "dflashops.cli", "--inventory", str(inv), "exec", "ct201", "--",
           "yes"]  # fmt: skip
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.read(10)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141
    assert err == ""


def test_a_commands_own_255_is_not_mistaken_for_a_stopped_container(testbed, tmp_path, home):
    inv = testbed.write_inventory(tmp_path / "hosts.yaml", {"ct201": ("pve1", 201)})
    ran = dflashops("exec", "ct201", "--", "sh", "-c",
                    "echo 'worker not running!' >&2; echo \"container '201' not running\"; exit 255",
                    inventory=inv, home=home)  # fmt: skip
    assert ran.code == 255
    assert ran.err == "worker not running!\n"
    assert ran.out == "container '201' not running\n"


def test_exec_no_stdin_leaves_the_callers_input_alone(testbed, tmp_path, home):
    inv = testbed.write_inventory(tmp_path / "hosts.yaml", {"ct201": ("pve1", 201)})
    base = [sys.executable, "-m", "dflashops.cli", "--inventory", str(inv), "exec"]
    script = f"""
while read x; do {" ".join(base)} -n ct201 -- true; echo "got $x"; done
"""
    proc = subprocess.run(["sh", "-c", script], input=b"a\nb\nc\n", capture_output=True,
                          env={"HOME": str(home), "PATH": "/usr/bin:/bin"}, timeout=120)  # fmt: skip
    assert proc.stdout.decode().splitlines() == ["got a", "got b", "got c"]


def test_hosts_trust_pins_a_jump_host_known_only_to_ssh_config(testbed, tmp_path, home):
    pve1 = testbed["pve1"]
    (home / ".ssh" / "config").write_text(
        f"Host bastion\n  HostName {pve1.address}\n  IdentityFile {testbed.client_key}\n"
    )
    inv = testbed.write_inventory(tmp_path / "hosts.yaml", {"ct301": ("pve2", 301)})
    inv.write_text(inv.read_text().replace("  pve2:\n", "  pve2:\n    jump: bastion\n"))
    refused = dflashops("exec", "ct301", "--", "true", inventory=inv, home=home)
    assert refused.code == 3 and "dflashops hosts trust bastion" in refused.err
    trusted = dflashops("hosts", "trust", "bastion", "--yes", inventory=inv, home=home)
    assert trusted.code == 0, trusted.err
    pinned = (home / ".config" / "dflashops" / "known_hosts").read_text()
    assert pinned.startswith(f"{pve1.address} ")
    ran = dflashops("exec", "ct301", "--", "hostname", inventory=inv, home=home)
    assert ran.code == 0 and ran.out == "ct301\n", ran.err
