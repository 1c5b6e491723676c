"""The test bed itself: real sshd hosts whose pct behaves like Proxmox's, dangerous parts too.

Everything goes through paramiko (RejectPolicy, pinned known_hosts) and one quoting layer
(shlex.join), the way dflashops talks to a real node.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shlex
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import paramiko
import pytest
import yaml

from tests.testbed import TestBed
from tests.testbed.fakepve.state import proc_start_time

pytestmark = pytest.mark.testbed

NASTY_ARGS = [
    "plain",
    "two words",
    "it's",
    '"double"',
    "$(touch /tmp/pwned)",
    "`touch /tmp/pwned2`",
    "a;b|c&d>e<f",
    "line1\nline2\n",
    "tab\there",
    "ünïcødé ✓ 日本",
    "",
    "*",
    "-la",
    "--",
    "back\\slash",
    "~root",
]
ECHO_ARGV = "import os,sys; sys.stdout.buffer.write(b'\\0'.join(map(os.fsencode, sys.argv[1:])))"


@pytest.fixture(scope="module")
def pve1(testbed):
    with testbed.ssh("pve1") as client:
        yield client


def run(client, argv, *, stdin=None, timeout=120):
    from tests.testbed.sshclient import run as ssh_run

    return ssh_run(client, argv, stdin=stdin, timeout=timeout)


def pct_exec(client, vmid, *argv, stdin=None):
    return run(client, ["pct", "exec", str(vmid), "--", *argv], stdin=stdin)


@pytest.fixture(params=["ns", "lxc"])
def any_ct(request, testbed):
    """CT 201 (ns) on pve1, or the LXC CT 302 on pve2."""
    if request.param == "ns":
        return testbed["pve1"][201]
    return request.getfixturevalue("lxc_ct")


def test_argv_arrives_byte_for_byte(testbed, any_ct):
    with testbed.ssh(any_ct.host) as client:
        result = pct_exec(client, any_ct.vmid, "python3", "-c", ECHO_ARGV, *NASTY_ARGS)
    assert result.rc == 0, result.stderr
    assert result.stdout == b"\0".join(a.encode() for a in NASTY_ARGS)
    assert not any_ct.host_path("/tmp/pwned").exists()
    assert not any_ct.host_path("/tmp/pwned2").exists()


def test_argv_without_double_dash_is_a_parse_error_and_runs_nothing(pve1, testbed):
    result = run(pve1, ["pct", "exec", "201", "touch", "/tmp/no-dashdash", "-c"])
    assert result.rc == 255
    assert b"Unknown option: c\n400 unable to parse option\n" in result.stderr
    assert b"pct exec <vmid> [<extra-args>] [OPTIONS]" in result.stderr
    assert not testbed["pve1"][201].host_path("/tmp/no-dashdash").exists()


def test_environment_has_forced_path_and_no_ssl_cert_vars(pve1):
    remote = "SSL_CERT_FILE=/x SSL_CERT_DIR=/y FOO=bar " + shlex.join(
        ["pct", "exec", "201", "--", "env"]
    )
    env = dict(line.split("=", 1) for line in run(pve1, remote).stdout.decode().splitlines())
    assert env["PATH"] == "/sbin:/bin:/usr/sbin:/usr/bin"
    assert env["FOO"] == "bar"
    assert env["container"] == "lxc"
    assert "SSL_CERT_FILE" not in env and "SSL_CERT_DIR" not in env


def test_keep_env_0_leaves_what_lxc_attach_clear_env_leaves(pve1):
    result = run(pve1, "FOO=bar pct exec 201 --keep-env 0 -- /usr/bin/env")
    lines = sorted(result.stdout.decode().splitlines())
    assert lines == [
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "container=lxc",
    ]


@pytest.mark.parametrize(
    ("argv", "rc"),
    [
        (["sh", "-c", "exit 7"], 7),
        (["sh", "-c", "kill -9 $$"], 137),
        (["no-such-command-here"], 127),
        (["/etc/passwd"], 126),
    ],
)
def test_exit_status_is_the_commands(pve1, argv, rc):
    assert pct_exec(pve1, 201, *argv).rc == rc


def test_binary_stdin_and_stdout_pass_through(pve1):
    data = os.urandom(8 << 20) + bytes(range(256)) * 4
    result = pct_exec(pve1, 201, "cat", stdin=data)
    assert result.rc == 0
    assert hashlib.sha256(result.stdout).digest() == hashlib.sha256(data).digest()


def test_injected_fault_flips_exactly_one_byte(testbed, pve1, fresh_ct):
    data = os.urandom(100_000)
    testbed["pve1"].set_faults(corrupt_exec_stdin_at=12_345)
    assert pct_exec(pve1, fresh_ct.vmid, "sh", "-c", "cat > /workspace/f", stdin=data).rc == 0
    got = fresh_ct.host_path("/workspace/f").read_bytes()
    assert len(got) == len(data)
    assert [i for i in range(len(data)) if got[i] != data[i]] == [12_345]
    testbed["pve1"].set_faults()
    assert pct_exec(pve1, fresh_ct.vmid, "sh", "-c", "cat > /workspace/f", stdin=data).rc == 0
    assert fresh_ct.host_path("/workspace/f").read_bytes() == data


def upload(client, data: bytes, path: str) -> None:
    with client.open_sftp() as sftp, sftp.open(path, "wb") as fh:
        fh.write(data)


def test_push_into_missing_dir_exits_0_and_leaves_no_file(testbed, pve1, fresh_ct):
    upload(pve1, b"payload", "/tmp/payload")
    result = run(pve1, ["pct", "push", str(fresh_ct.vmid), "/tmp/payload", "/nope/dir/file"])
    assert result.rc == 0  # the dangerous part: only the text tells
    assert result.stderr == b"failed to create file: /nope/dir/file: No such file or directory\n"
    assert not fresh_ct.host_path("/nope").exists()
    assert "TASK ERROR: failed to create file: /nope/dir/file" in testbed["pve1"].tasks_log()


def test_push_onto_a_directory_exits_0_too(pve1, fresh_ct):
    upload(pve1, b"payload", "/tmp/payload")
    result = run(pve1, ["pct", "push", str(fresh_ct.vmid), "/tmp/payload", "/workspace"])
    assert (result.rc, result.stderr) == (0, b"failed to create file: /workspace: Is a directory\n")


def test_push_writes_the_file_and_keeps_an_old_mode(pve1, fresh_ct):
    upload(pve1, b"#!/bin/sh\necho hi\n", "/tmp/script")
    vmid = str(fresh_ct.vmid)
    assert run(pve1, ["pct", "push", vmid, "/tmp/script", "/workspace/s", "--perms", "755"]).rc == 0
    target = fresh_ct.host_path("/workspace/s")
    assert target.read_bytes() == b"#!/bin/sh\necho hi\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    upload(pve1, b"second", "/tmp/script")
    assert run(pve1, ["pct", "push", vmid, "/tmp/script", "/workspace/s"]).rc == 0
    assert target.read_bytes() == b"second"
    assert stat.S_IMODE(target.stat().st_mode) == 0o755


def test_pull_copies_out_and_a_missing_source_still_exits_0(pve1, fresh_ct):
    fresh_ct.host_path("/workspace/out").write_bytes(b"from the CT")
    vmid = str(fresh_ct.vmid)
    assert run(pve1, ["pct", "pull", vmid, "/workspace/out", "/tmp/pulled"]).rc == 0
    assert run(pve1, ["cat", "/tmp/pulled"]).stdout == b"from the CT"
    result = run(pve1, ["pct", "pull", vmid, "/workspace/missing", "/tmp/pulled2"])
    assert (result.rc, result.stderr) == (
        0,
        b"failed to open /workspace/missing: No such file or directory\n",
    )
    assert run(pve1, ["stat", "-c", "%s", "/tmp/pulled2"]).stdout == b"0\n"  # made first


def test_stopped_container_is_refused(pve1, make_container):
    ct = make_container("pve1", start=False)
    vmid = str(ct.vmid)
    result = pct_exec(pve1, vmid, "true")
    assert (result.rc, result.stderr) == (255, f"container '{vmid}' not running!\n".encode())
    upload(pve1, b"x", "/tmp/dfo-pushed-probe")
    result = run(pve1, ["pct", "push", vmid, "/tmp/dfo-pushed-probe", "/workspace/x"])
    assert (result.rc, result.stderr) == (255, b"can only push files to a running CT\n")
    assert run(pve1, ["pct", "status", vmid]).stdout == b"status: stopped\n"
    assert run(pve1, ["pct", "start", vmid]).rc == 0
    assert run(pve1, ["pct", "status", vmid]).stdout == b"status: running\n"
    assert pct_exec(pve1, vmid, "hostname").stdout == f"ct{vmid}\n".encode()


@pytest.mark.parametrize(
    ("vmid", "message"),
    [
        (
            "99",
            "400 Parameter verification failed.\nvmid: value must have a minimum value of 100\n",
        ),
        ("ct201", "vmid: type check ('integer') failed - got 'ct201'\n"),
        ("999", "Configuration file 'nodes/pve1/lxc/999.conf' does not exist\n"),
        ("301", "Configuration file 'nodes/pve1/lxc/301.conf' does not exist\n"),
    ],
)
def test_wrong_vmid_is_refused(pve1, vmid, message):
    result = pct_exec(pve1, vmid, "true")
    assert result.rc == 255
    assert message.encode() in result.stderr


def test_exec_without_a_command(pve1):
    result = run(pve1, ["pct", "exec", "201", "--"])
    assert result.rc == 255
    assert result.stderr.startswith(b"missing command at ")


def test_list_and_status(pve1):
    lines = run(pve1, ["pct", "list"]).stdout.decode().splitlines()
    assert lines[0].split() == ["VMID", "Status", "Lock", "Name"]
    assert lines[1].split() == ["201", "running", "ct201"]
    assert lines[2].split() == ["202", "running", "ct202"]
    verbose = run(pve1, ["pct", "status", "201", "--verbose"]).stdout.decode()
    assert "status: running\n" in verbose and "name: ct201\n" in verbose
    assert "hostname: ct202\n" in run(pve1, ["pct", "config", "202"]).stdout.decode()


def test_containers_have_no_network(testbed, any_ct):
    host = testbed["pve1"]
    probe = (
        "import socket,sys\n"
        "print(open('/proc/net/dev').read().count(':'))\n"
        "try:\n"
        f"    socket.create_connection(({host.address!r}, {host.port}), timeout=3)\n"
        "except OSError as e:\n"
        "    print(e.errno)\n"
    )
    result = any_ct.run(["python3", "-c", probe])
    interfaces, error = result.stdout.split()
    assert interfaces == b"1"  # lo only
    # netns mode: no route at all; loopback mode: the CT's own lo, where nothing listens
    assert int(error) in (errno.ENETUNREACH, errno.ECONNREFUSED)


@pytest.mark.parametrize("kind", ["ns", "lxc"])
def test_bridged_containers_on_two_hosts_reach_each_other(testbed, make_container, kind):
    a = make_container("pve1", kind, network=True)
    b = make_container("pve2", "ns", network=True)
    config = run_host(testbed, "pve1", ["pct", "config", str(a.vmid)])
    assert f"net0: name=eth0,bridge=vmbr0,firewall=1,ip={a.address}/24,type=veth" in config
    listen = (
        "import socket\n"
        "s = socket.socket(); s.bind(('0.0.0.0', 5555)); s.listen(); print('ready', flush=True)\n"
        "while True:\n"
        "    c, peer = s.accept(); print(c.recv(16).decode(), peer[0], flush=True)\n"
    )
    server = subprocess.Popen(b.command(["python3", "-c", listen]), stdout=subprocess.PIPE)
    try:
        assert server.stdout.readline() == b"ready\n"
        send = "import socket,sys; socket.create_connection((sys.argv[1], 5555), 5).send(b'hi')"
        assert a.run(["python3", "-c", send, b.address]).returncode == 0
        assert server.stdout.readline().decode().split() == ["hi", a.address]
        # a restart through pct gives the CT its network back
        for action in ("stop", "start"):
            run_host(testbed, "pve1", ["pct", action, str(a.vmid)])
        assert a.run(["python3", "-c", send, b.address]).returncode == 0
        assert server.stdout.readline().decode().split() == ["hi", a.address]
    finally:
        server.kill()


def test_a_port_joining_or_leaving_a_host_bridge_keeps_the_host_answering(testbed):
    """A container's veth with a lower MAC than any port joins then leaves vmbr0: the host keeps
    its MAC, so the bed's ARP cache stays right and ssh answers at once (an unpinned bridge
    would take the veth's MAC, then 00:00:00:00:00:00, and go silent for up to a minute)."""
    host = testbed["pve1"]
    if host.netns is None:
        pytest.skip("host bridges exist in netns mode only")

    def ip(*args: str) -> str:
        return subprocess.run(["ip", "-n", host.netns, *args], check=True, capture_output=True,
                              text=True).stdout  # fmt: skip

    before = ip("link", "show", "vmbr0")
    assert testbed.ssh_run(host, "true").rc == 0  # the bed has the host's MAC in its cache
    ip("link", "add", "dfoprobe0", "address", "00:00:00:00:00:01", "type", "veth",
       "peer", "name", "dfoprobe1")  # fmt: skip
    try:
        ip("link", "set", "dfoprobe0", "master", "vmbr0", "up")
        assert ip("link", "show", "vmbr0").split("link/ether")[1] == before.split("link/ether")[1]
    finally:
        ip("link", "del", "dfoprobe0")
    assert ip("link", "show", "vmbr0").split("link/ether")[1] == before.split("link/ether")[1]
    started = time.monotonic()
    assert testbed.ssh_run(host, "true").rc == 0
    assert time.monotonic() - started < 5


def run_host(testbed, host: str, argv: list[str]) -> str:
    result = testbed.ssh_run(host, argv)
    assert result.rc == 0, result.stderr
    return result.stdout.decode()


def test_hosts_are_distinct_machines(testbed):
    pve1, pve2 = testbed["pve1"], testbed["pve2"]
    assert (pve1.address, pve1.port) != (pve2.address, pve2.port)
    assert pve1.known_hosts_line().split()[2] != pve2.known_hosts_line().split()[2]
    for host in (pve1, pve2):
        assert testbed.ssh_run(host, "hostname").stdout == f"{host.name}\n".encode()
    testbed.ssh_run(pve1, "echo only-here > /tmp/marker")
    assert testbed.ssh_run(pve2, "cat /tmp/marker").rc != 0
    assert pve1.host_path("/tmp/marker").read_bytes() == b"only-here\n"


def test_the_test_venv_works_on_hosts_and_in_ns_containers(testbed):
    code = "import yaml, paramiko; print('ok')"
    assert testbed["pve1"][201].run([sys.executable, "-c", code]).stdout == b"ok\n"
    assert testbed.ssh_run("pve2", [sys.executable, "-c", code]).stdout == b"ok\n"
    written = testbed["pve1"][201].run(["touch", os.path.join(sys.prefix, "x")])
    assert b"Read-only file system" in written.stderr or not sys.prefix.startswith("/root/")


def test_a_stopped_host_refuses_then_comes_back(testbed):
    host = testbed["pve2"]
    host.stop()
    try:
        with pytest.raises(OSError) as caught:
            socket.create_connection((host.address, host.port), timeout=5)
        assert caught.value.errno == errno.ECONNREFUSED
        assert host[301].running  # containers don't care about sshd
    finally:
        host.start()
    assert testbed.ssh_run(host, ["pct", "status", "301"]).stdout == b"status: running\n"


def test_a_key_not_pinned_is_rejected(testbed, tmp_path):
    known = testbed.write_known_hosts(tmp_path / "known_hosts", hosts=["pve1"])
    with testbed.ssh("pve1", known_hosts=known) as client:
        assert run(client, "true").rc == 0
    with pytest.raises(paramiko.SSHException, match="not found in known_hosts"):
        testbed.ssh("pve2", known_hosts=known)


def test_unused_address_fails_fast(testbed):
    address, port = testbed.unused_endpoint()
    started = time.monotonic()
    with pytest.raises(OSError) as caught:
        socket.create_connection((address, port), timeout=10)
    assert caught.value.errno in (errno.EHOSTUNREACH, errno.ECONNREFUSED)
    assert time.monotonic() - started < 5


def test_inventory_points_at_the_bed(testbed, tmp_path):
    path = testbed.write_inventory(
        tmp_path / "hosts.yaml",
        {"ct201": ("pve1", 201), "ct301": ("pve2", 301, {"role": "eval"}), "box": "pve2"},
        extra_defaults={"env": {"HF_HOME": "/workspace/hf"}},
    )
    doc = yaml.safe_load(path.read_text())
    assert doc["version"] == 1
    assert doc["defaults"]["workspace"] == "/workspace"
    assert doc["defaults"]["env"] == {"HF_HOME": "/workspace/hf"}
    assert doc["targets"]["ct301"] == {"host": "pve2", "vmid": 301, "role": "eval"}
    assert doc["targets"]["box"]["kind"] == "ssh"
    pve1 = doc["hosts"]["pve1"]
    client = paramiko.SSHClient()
    client.load_host_keys(pve1["known_hosts"])
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(
        pve1["address"],
        port=pve1["port"],
        username=pve1["user"],
        key_filename=pve1["identity"],
        look_for_keys=False,
        allow_agent=False,
    )
    with client:
        python = doc["defaults"]["python"]
        assert pct_exec(client, 201, python, "-c", "print(1)").stdout == b"1\n"


@pytest.mark.lxc
def test_lxc_container_is_a_real_debian_container(testbed, lxc_ct):
    assert lxc_ct.kind == "lxc"
    with testbed.ssh(lxc_ct.host) as client:
        result = pct_exec(
            client,
            lxc_ct.vmid,
            "sh",
            "-c",
            "hostname; cat /etc/debian_version; "
            "ls /usr/local/sbin; python3 -m venv --help >/dev/null && echo venv",
        )
        assert result.rc == 0, result.stderr
        hostname, version, venv = result.stdout.decode().split()
        assert (hostname, version.split(".")[0], venv) == (f"ct{lxc_ct.vmid}", "12", "venv")
        pct_exec(client, lxc_ct.vmid, "sh", "-c", "echo in-ct > /workspace/lxc-marker")
    assert lxc_ct.host_path("/workspace/lxc-marker").read_bytes() == b"in-ct\n"


def test_a_crashed_bed_is_cleaned_by_the_next_one(testbed):
    crashed = TestBed(("x1",)).start()
    kinds = ["ns", "lxc"] if testbed.lxc_available else ["ns"]
    inits = [crashed["x1"].add_container(900 + i, kind).pid for i, kind in enumerate(kinds)]
    slot = crashed.slot
    os.close(slot.lock_fd)  # what dying does to the lock; nothing else is cleaned
    slot.lock_fd = -1
    second = TestBed(("y1",), lxc="0").start()
    try:
        assert second.slot.index == slot.index
        assert crashed["x1"]._sshd.wait(5) == -9  # killed by the cleanup
        assert all(proc_start_time(pid) is None for pid in inits)  # gone, or a zombie
        assert not list(Path("/sys/fs/cgroup").glob(f"*/dflashops-testbed/{slot.prefix}-*"))
        assert testbed.ssh_run("pve1", "true").rc == 0  # the session's bed is untouched
    finally:
        second.close()
