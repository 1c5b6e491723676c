"""SSH configuration as users have it, against the test bed's real sshd: known_hosts markers,
Include and Match exec in ~/.ssh/config (with OpenSSH's ssh -G and without it), and keys with
a passphrase (no agent, an agent, a terminal)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import pty
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.operator.cli import dflashops

pytestmark = pytest.mark.testbed

NO_OPENSSH = {"PATH": "/nonexistent"}  # where the OpenSSH client is not installed


@pytest.fixture
def home(tmp_path):
    path = tmp_path / "home"
    (path / ".ssh").mkdir(parents=True)
    return path


@pytest.fixture
def inv(testbed, tmp_path):
    return testbed.write_inventory(tmp_path / "hosts.yaml", {"ct201": ("pve1", 201)})


def hostname(inv: Path, home: Path, **kw):
    return dflashops("exec", "ct201", "--", "hostname", inventory=inv, home=home, **kw)


def other_key(tmp_path: Path) -> str:
    """A public key line of some other host (type and base64)."""
    path = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", path], check=True)
    return " ".join(Path(f"{path}.pub").read_text().split()[:2])


def test_cert_authority_and_revoked_lines_of_other_hosts_do_not_break_anything(
    testbed, tmp_path, home, inv
):
    ours = (tmp_path / "known_hosts").read_text()
    other = other_key(tmp_path)
    (tmp_path / "known_hosts").write_text(
        f"@cert-authority *.example.com {other}\n@revoked bad.example.com {other}\n{ours}"
    )
    ran = hostname(inv, home)
    assert ran.code == 0 and ran.out == "ct201\n", ran.err


def test_a_revoked_host_key_is_refused_even_when_pinned(testbed, tmp_path, home, inv):
    pve1 = testbed["pve1"]
    key = " ".join(pve1.host_key)
    (home / ".ssh" / "known_hosts").write_text(f"@revoked * {key}\n")
    ran = hostname(inv, home)
    assert ran.code == 3, ran
    assert "is marked @revoked in" in ran.err and "refusing to connect" in ran.err
    assert len(ran.err.strip().splitlines()) == 1
    trust = dflashops("hosts", "trust", "pve1", "--yes", inventory=inv, home=home)
    assert trust.code == 3 and "@revoked" in trust.err


def test_hashed_and_wildcard_known_hosts_lines_are_trusted(testbed, tmp_path, home):
    pve1 = testbed["pve1"]
    inv = testbed.write_inventory(tmp_path / "hosts.yaml", {"ct201": ("pve1", 201)}, pin_keys=False)
    name = pve1.address if pve1.port == 22 else f"[{pve1.address}]:{pve1.port}"
    salt = os.urandom(20)
    digest = hmac.new(salt, name.encode(), hashlib.sha1).digest()
    hashed = f"|1|{base64.b64encode(salt).decode()}|{base64.b64encode(digest).decode()}"
    key = " ".join(pve1.host_key)
    (home / ".ssh" / "known_hosts").write_text(f"{hashed} {key}\n")
    assert hostname(inv, home).code == 0
    prefix = pve1.address.rsplit(".", 1)[0]
    pattern = f"{prefix}.*,!{prefix}.250" if pve1.port == 22 else f"[{prefix}.*]:{pve1.port}"
    (home / ".ssh" / "known_hosts").write_text(f"{pattern} {key}\n")
    assert hostname(inv, home).code == 0


def alias_config(testbed, home: Path) -> Path:
    """~/.ssh/config that defines the alias `p1` for pve1 only through an Include."""
    pve1 = testbed["pve1"]
    included = home / ".ssh" / "hosts.d" / "pve.conf"
    included.parent.mkdir()
    included.write_text(f"Host p1\n  HostName {pve1.address}\n  Port {pve1.port}\n")
    (home / ".ssh" / "config").write_text(f"Include {included.parent}/*.conf\n")
    return included


def aliased(testbed, tmp_path: Path, **extra) -> Path:
    """An inventory that names pve1 only by the alias `p1` (no port: the config gives it)."""
    inv = testbed.write_inventory(tmp_path / "hosts.yaml", {"ct201": ("pve1", 201)})
    doc = yaml.safe_load(inv.read_text())
    doc["hosts"]["pve1"]["address"] = "p1"
    del doc["hosts"]["pve1"]["port"]
    doc["hosts"]["pve1"].update(extra)
    inv.write_text(yaml.safe_dump(doc))
    return inv


@pytest.mark.parametrize("env", [None, NO_OPENSSH], ids=["ssh -G", "no OpenSSH"])
def test_include_in_ssh_config_is_read(testbed, tmp_path, home, env):
    alias_config(testbed, home)
    ran = hostname(aliased(testbed, tmp_path), home, env=env)
    assert ran.code == 0 and ran.out == "ct201\n", ran.err


@pytest.mark.parametrize("env", [None, NO_OPENSSH], ids=["ssh -G", "no OpenSSH"])
def test_match_exec_is_run_by_the_shell_and_decides(testbed, tmp_path, home, env):
    """`Match exec` picks the address: pve1 while a flag file exists, else a dead one."""
    pve1, flag = testbed["pve1"], tmp_path / "on-site"
    (home / ".ssh" / "config").write_text(
        f'Match originalhost p1 exec "test -e {flag}"\n  HostName {pve1.address}\n'
        f"Host p1\n  HostName {testbed.unused_address()}\n  Port {pve1.port}\n"
    )
    inv = aliased(testbed, tmp_path)
    inv.write_text(
        inv.read_text().replace("    user: root\n", "    user: root\n    connect_timeout: 3\n")
    )
    away = hostname(inv, home, env=env)
    assert away.code == 3 and "internal error" not in away.err, away
    flag.touch()
    here = hostname(inv, home, env=env)
    assert here.code == 0 and here.out == "ct201\n", here.err


@pytest.mark.parametrize("env", [None, NO_OPENSSH], ids=["ssh -G", "no OpenSSH"])
def test_no_shell_ever_sees_a_host_or_user_that_is_not_a_plain_name(
    testbed, tmp_path, home, inv, env
):
    """`Match exec` and a ProxyCommand's %h and %r go through /bin/sh (with paramiko's parser
    as with OpenSSH's): a host of hosts.yaml or of the command line, or a user, that carries
    shell syntax is refused (exit 2, one line) before any ssh configuration is read."""
    pwned, seen = tmp_path / "pwned", tmp_path / "seen"
    (home / ".ssh" / "config").write_text(f'Match exec "echo %h >> {seen}"\n  User root\n')
    bad = f"x;/usr/bin/touch {pwned}"  # an absolute path: PATH has no touch without OpenSSH
    address = f"address: {testbed['pve1'].address}"
    hostile = tmp_path / "hostile.yaml"
    hostile.write_text(inv.read_text().replace(address, f"address: {json.dumps(bad)}"))
    as_user = tmp_path / "user.yaml"
    as_user.write_text(
        inv.read_text().replace("    user: root\n", f"    user: {json.dumps(bad)}\n")
    )
    runs = [
        dflashops("hosts", inventory=hostile, home=home, env=env),
        dflashops("hosts", inventory=as_user, home=home, env=env),
        dflashops("hosts", "trust", "--yes", bad, inventory=inv, home=home, env=env),
        dflashops("hosts", "trust", "--yes", f"{bad},pve1", inventory=inv, home=home, env=env),
        dflashops("hosts", "trust", "--yes", f"root@pve1,{bad}", inventory=inv, home=home, env=env),
    ]
    for ran in runs:
        assert ran.code == 2 and len(ran.err.strip().splitlines()) == 1, ran
        assert "Traceback" not in ran.err and f"'{bad}'" in ran.err, ran.err
    assert not pwned.exists()
    assert not seen.exists() or "touch" not in seen.read_text()


# ------------------------------------------------------------------ keys with a passphrase


@pytest.fixture
def locked_key(testbed, tmp_path):
    """A key with the passphrase 'secret', authorized on every bed host while the test runs."""
    path = tmp_path / "locked"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "secret", "-f", path], check=True)
    authorized = testbed.dir / "client" / "authorized_keys"
    before = authorized.read_text()
    authorized.write_text(before + Path(f"{path}.pub").read_text())
    yield path
    authorized.write_text(before)


def with_identity(inv: Path, key: Path) -> Path:
    text = inv.read_text()
    start = text.index("identity: ") + len("identity: ")
    end = text.index("\n", start)
    inv.write_text(text[:start] + str(key) + text[end:])
    return inv


def test_a_locked_key_without_agent_or_terminal_says_what_to_do(home, inv, locked_key):
    ran = hostname(with_identity(inv, locked_key), home, env={"SSH_AUTH_SOCK": ""})
    assert ran.code == 3, ran
    assert f"the key {locked_key} has a passphrase and no ssh-agent holds it" in ran.err
    assert f"ssh-add {locked_key}" in ran.err and "set 'identity'" not in ran.err
    assert len(ran.err.strip().splitlines()) == 1


def test_a_locked_key_held_by_ssh_agent_needs_no_passphrase(tmp_path, home, inv, locked_key):
    sock = tmp_path / "agent.sock"
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        clear = tmp_path / "clear"  # the same key without its passphrase, for ssh-add
        shutil.copy(locked_key, clear)
        clear.chmod(0o600)
        subprocess.run(
            ["ssh-keygen", "-q", "-p", "-P", "secret", "-N", "", "-f", clear], check=True
        )
        env = {**os.environ, "SSH_AUTH_SOCK": str(sock)}
        subprocess.run(["ssh-add", "-q", clear], env=env, check=True, capture_output=True)
        ran = hostname(with_identity(inv, locked_key), home, env={"SSH_AUTH_SOCK": str(sock)})
        assert ran.code == 0 and ran.out == "ct201\n", ran.err
    finally:
        agent.kill()
        agent.wait()


def test_a_locked_key_asks_for_its_passphrase_on_a_terminal(home, inv, locked_key):
    argv = [sys.executable, "-m", "dflashops.cli", "--inventory", str(with_identity(inv, locked_key)),
            "exec", "ct201", "--", "hostname"]  # fmt: skip
    env = {**os.environ, "HOME": str(home), "SSH_AUTH_SOCK": ""}
    pid, fd = pty.fork()
    if pid == 0:
        os.execve(argv[0], argv, env)
    seen = read_until(fd, b"passphrase")
    assert f"Enter passphrase for key '{locked_key}'".encode() in seen
    os.write(fd, b"secret\n")
    seen += read_until(fd, None)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    assert code == 0 and seen.endswith(b"ct201\r\n"), seen


def read_until(fd: int, marker: bytes | None, timeout: float = 60) -> bytes:
    got, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline and (marker is None or marker not in got):
        if not select.select([fd], [], [], 0.5)[0]:
            continue
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        got += chunk
    return got
