"""The operator against fake Proxmox hosts: real sshd in network namespaces, a faithful pct,
real containers (namespaces; LXC where marked). Nothing here is mocked."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflashops.errors import NotFoundError, TransferError, UnreachableError
from dflashops.inventory import load_inventory
from dflashops.ssh.session import Session
from dflashops.transfer import put
from tests.operator.cli import dflashops
from tests.operator.trees import fingerprint, make_tree

pytestmark = pytest.mark.testbed

ECHO_ARGV = "import json, sys; sys.stdout.write(json.dumps(sys.argv[1:]))"


@pytest.fixture
def home(tmp_path) -> Path:
    """An empty HOME, so nobody's ~/.ssh decides what we trust."""
    path = tmp_path / "home"
    path.mkdir()
    return path


@pytest.fixture
def inventory(testbed, tmp_path, home) -> Path:
    return testbed.write_inventory(
        tmp_path / "hosts.yaml",
        {"ct201": ("pve1", 201), "ct202": ("pve1", 202), "ct301": ("pve2", 301), "box": "pve2"},
    )


@pytest.fixture
def session(inventory, home, monkeypatch):
    monkeypatch.setenv("HOME", str(home))
    with Session(load_inventory(inventory)) as s:
        yield s


ARG = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"))
NASTY = st.sampled_from(
    [
        "",
        " ",
        "'",
        '"',
        "$(id)",
        "`id`",
        "*",
        "?",
        "~",
        ";",
        "&&",
        "|",
        ">",
        "<",
        "\\",
        "\n",
        "\t",
        "a b",
        "$HOME",
        "${PATH}",
        "--",
        "-la",
        "\u00e9\u4e2d\U0001f600",
        "'\"'\"'",
        "!",
        "#x",
    ]
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(argv=st.lists(st.one_of(ARG, NASTY), min_size=1, max_size=8))
def test_any_argv_arrives_in_the_container_byte_for_byte(session, argv):
    result = session.machine("ct201").run(["python3", "-c", ECHO_ARGV, *argv])
    assert result.ok, result.stderr
    assert json.loads(result.stdout) == argv


@pytest.mark.lxc
@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(argv=st.lists(st.one_of(ARG, NASTY), min_size=1, max_size=6))
def test_any_argv_arrives_in_an_lxc_container(lxc_ct, testbed, tmp_path_factory, argv):
    where = tmp_path_factory.mktemp("lxc")
    inv = testbed.write_inventory(where / "hosts.yaml", {"lxc": lxc_ct})
    with pytest.MonkeyPatch.context() as mp, Session(load_inventory(inv)) as s:
        mp.setenv("HOME", str(where))
        result = s.machine("lxc").run(["python3", "-c", ECHO_ARGV, *argv])
    assert result.ok, result.stderr
    assert json.loads(result.stdout) == argv


def test_environment_is_the_targets_not_pcts(session):
    result = session.machine("ct201").run(["sh", "-c", "env | sort"], env={"EXTRA": "x y"})
    env = dict(line.split("=", 1) for line in result.text.splitlines())
    assert env["PATH"] == "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    assert env["HOME"] == "/root" and env["EXTRA"] == "x y"
    assert not {"SSH_CONNECTION", "SSH_CLIENT", "MAIL", "container"} & set(env)


def test_stdin_streams_through_exec(session):
    data = os.urandom(3 << 20)
    result = session.machine("ct301").run(["sha256sum"], stdin=data)
    import hashlib

    assert result.text.split()[0] == hashlib.sha256(data).hexdigest()


def test_one_login_per_host_per_command(inventory, home, testbed):
    """`hosts` over three containers and a plain target on two hosts: sshd sees one login each."""
    logs = {h: testbed[h].dir / "sshd.log" for h in ("pve1", "pve2")}
    before = {h: log.read_text().count("Accepted publickey") for h, log in logs.items()}
    ran = dflashops("hosts", inventory=inventory, home=home)
    assert ran.code == 0, ran.err
    after = {h: log.read_text().count("Accepted publickey") for h, log in logs.items()}
    # pve2 serves CT 301 and the kind: ssh target "box": the same endpoint, one connection
    assert {h: after[h] - before[h] for h in logs} == {"pve1": 1, "pve2": 1}


def test_push_tree_into_container_is_identical(inventory, home, testbed, tmp_path):
    src = make_tree(tmp_path / "src")
    ran = dflashops(
        "push", "ct202", str(src), "/workspace/data/tree", inventory=inventory, home=home
    )
    assert ran.code == 0, ran.err
    copied = testbed["pve1"][202].host_path("/workspace/data/tree")
    assert fingerprint(copied) == fingerprint(src)


@pytest.mark.lxc
def test_push_tree_into_lxc_container_is_identical(lxc_ct, testbed, tmp_path, home):
    inv = testbed.write_inventory(tmp_path / "hosts.yaml", {"lxc": lxc_ct})
    src = make_tree(tmp_path / "src")
    ran = dflashops("push", "lxc", str(src), "data/tree", inventory=inv, home=home)
    assert ran.code == 0, ran.err
    assert fingerprint(lxc_ct.host_path("/workspace/data/tree")) == fingerprint(src)


def test_push_corrupted_in_flight_is_detected(session, testbed, tmp_path):
    src = make_tree(tmp_path / "src", big=1 << 20)
    testbed["pve1"].set_faults(corrupt_exec_stdin_at=40_000)
    with pytest.raises(TransferError, match=r"differ after the copy \(crc32\): blob.bin"):
        put(session.machine("ct201"), src, "/workspace/corrupt")


def test_push_corrupted_in_flight_exits_1_from_the_cli(inventory, home, testbed, tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(os.urandom(200_000))
    testbed["pve2"].set_faults(corrupt_exec_stdin_at=5000)
    ran = dflashops("push", "ct301", str(f), "w.bin", inventory=inventory, home=home)
    assert ran.code == 1 and "(crc32)" in ran.err and "Traceback" not in ran.err


def test_a_push_corrupted_in_flight_leaves_the_old_file_and_its_rerun_sends_it(
    inventory, home, testbed, tmp_path
):
    """The corrupted bytes never reach the file's name; the re-run finds the old file there,
    not a copy it could take for unchanged (before: '1 unchanged, crc32 verified', exit 0)."""
    f = tmp_path / "w.bin"
    f.write_bytes(b"old" * 1000)
    assert dflashops("push", "ct301", str(f), "w.bin", inventory=inventory, home=home).code == 0
    landed = testbed["pve2"][301].host_path("/workspace/w.bin")
    new = os.urandom(200_000)
    f.write_bytes(new)
    testbed["pve2"].set_faults(corrupt_exec_stdin_at=5000)
    ran = dflashops("push", "ct301", str(f), "w.bin", inventory=inventory, home=home)
    assert ran.code == 1 and "w.bin" in ran.err and "run it again" in ran.err
    assert landed.read_bytes() == b"old" * 1000
    assert sorted(p.name for p in landed.parent.iterdir() if p.name.endswith(".part")) == []
    testbed["pve2"].set_faults()
    again = dflashops("push", "ct301", str(f), "w.bin", inventory=inventory, home=home)
    assert again.code == 0, again.err
    assert "unchanged" not in again.err + again.out
    assert landed.read_bytes() == new


def test_unknown_host_key_is_refused_then_trusted(testbed, tmp_path, home):
    inv = testbed.write_inventory(tmp_path / "hosts.yaml", {"ct201": ("pve1", 201)}, pin_keys=False)
    ran = dflashops("exec", "ct201", "--", "true", inventory=inv, home=home)
    assert ran.code == 3
    assert _fingerprint(testbed["pve1"].host_key[1]) in ran.err
    assert "dflashops hosts trust pve1" in ran.err
    asked = dflashops("hosts", "trust", "pve1", inventory=inv, home=home)
    assert asked.code == 2 and "--yes" in asked.err  # no terminal to ask on: refuses, pins nothing
    assert dflashops("exec", "ct201", "--", "true", inventory=inv, home=home).code == 3
    trusted = dflashops("hosts", "trust", "pve1", "--yes", inventory=inv, home=home)
    assert trusted.code == 0, trusted.err
    assert (home / ".config/dflashops/known_hosts").read_text().startswith(testbed["pve1"].address)
    ran = dflashops("exec", "ct201", "--", "hostname", inventory=inv, home=home)
    assert ran.code == 0 and ran.out == "ct201\n"


def test_changed_host_key_is_refused(testbed, tmp_path, home):
    inv = testbed.write_inventory(tmp_path / "hosts.yaml", {"ct201": ("pve1", 201)})
    known = tmp_path / "known_hosts"
    line = testbed.known_hosts_line("pve2").split(" ", 1)[1]  # pve2's key under pve1's name
    known.write_text(f"{testbed['pve1'].address} {line}")
    ran = dflashops("exec", "ct201", "--", "true", inventory=inv, home=home)
    assert ran.code == 3 and "host key CHANGED" in ran.err


def test_stopped_unreachable_and_wrong_vmid_are_distinct(testbed, make_container, tmp_path, home):
    stopped = make_container("pve2", start=False)
    inv = testbed.write_inventory(
        tmp_path / "hosts.yaml",
        {"stopped": stopped, "wrong": ("pve1", 999), "gone": {"host": "ghost", "vmid": 200}},
        extra_hosts={"ghost": {"address": testbed.unused_address(), "connect_timeout": 3}},
    )
    runs = {
        name: dflashops("exec", name, "--", "true", inventory=inv, home=home)
        for name in ("stopped", "wrong", "gone")
    }
    assert runs["stopped"].code == 3 and "is stopped" in runs["stopped"].err
    assert f"pct start {stopped.vmid}" in runs["stopped"].err
    assert runs["wrong"].code == 4 and "CT 999 on pve1 does not exist" in runs["wrong"].err
    assert runs["gone"].code == 3 and "ghost" in runs["gone"].err
    assert "unreachable" in runs["gone"].err or "no answer" in runs["gone"].err
    assert len({r.err for r in runs.values()}) == 3
    for r in runs.values():
        assert len(r.err.strip().splitlines()) == 1 and "Traceback" not in r.err


def test_errors_raise_typed_exceptions_in_the_api(session, testbed, make_container):
    with pytest.raises(NotFoundError):
        Session(load_inventory(_inv_with(testbed, session, {"x": ("pve1", 998)}))).machine("x").run(
            ["true"]
        )
    ct = make_container("pve1", start=False)
    with pytest.raises(UnreachableError, match="stopped"):
        Session(load_inventory(_inv_with(testbed, session, {"y": ct}))).machine("y").run(["true"])


def _inv_with(testbed, session, targets) -> Path:
    return testbed.write_inventory(session.inventory.path.parent / "more.yaml", targets)


def test_run_script_keeps_quotes_heredocs_and_exit_code(inventory, home, tmp_path, testbed):
    script = tmp_path / "job.py"
    script.write_text(
        "import os, subprocess, sys\n"
        "print('''it's \"quoted\" $(not run) `nor this` ;&|''')\n"
        "print(subprocess.run(['sh', '-c', \"cat <<'EOF'\\n$HOME `x` \\\\$y\\nEOF\"],"
        " capture_output=True, text=True).stdout, end='')\n"
        "print(os.uname().nodename, sys.argv[1:])\n"
        "sys.exit(42)\n"
    )
    ran = dflashops(
        "run-script",
        "ct202",
        str(script),
        "--",
        "--opt",
        "a b",
        "$(x)",
        inventory=inventory,
        home=home,
    )
    assert ran.code == 42, ran.err
    assert ran.out.splitlines() == [
        'it\'s "quoted" $(not run) `nor this` ;&|',
        "$HOME `x` \\$y",
        "ct202 ['--opt', 'a b', '$(x)']",
    ]


def test_hosts_table_and_json(inventory, home, testbed, make_container, tmp_path):
    stopped = make_container("pve2", start=False)
    inv = testbed.write_inventory(
        tmp_path / "h2.yaml",
        {"ct201": ("pve1", 201), "off": stopped, "nope": ("pve2", 777), "box": "pve2"},
    )
    ran = dflashops("--json", "hosts", inventory=inv, home=home)
    assert ran.code == 0, ran.err
    doc = json.loads(ran.out)
    assert {h["name"]: h["reachable"] for h in doc["hosts"]} == {"pve1": True, "pve2": True}
    states = {t["name"]: t["state"] for t in doc["targets"]}
    assert states == {"ct201": "running", "off": "stopped", "nope": "missing", "box": "running"}
    ct201 = next(t for t in doc["targets"] if t["name"] == "ct201")
    assert ct201["disk_free_bytes"] > 0 and ct201["python"] is True
    table = dflashops("hosts", inventory=inv, home=home)
    assert table.code == 0, table.err
    assert "stopped" in table.out and "missing" in table.out


def test_dry_run_prints_exact_host_argv_and_changes_nothing(inventory, home, testbed, tmp_path):
    src = tmp_path / "f.txt"
    src.write_text("x")
    ran = dflashops(
        "--dry-run", "push", "ct201", str(src), "dry/f.txt", inventory=inventory, home=home
    )
    assert ran.code == 0, ran.err
    assert ran.out.startswith("pve1: pct exec 201 -- /usr/bin/env -i PATH=")
    assert not testbed["pve1"][201].host_path("/workspace/dry").exists()
    ran = dflashops(
        "--dry-run", "exec", "ct301", "--", "echo", "a b", "$(x)", inventory=inventory, home=home
    )
    assert ran.out.strip().endswith("echo 'a b' '$(x)'")


def test_jump_host_carries_the_connection(testbed, tmp_path, home):
    """pve2 reached with pve1 as ProxyJump: pve2's sshd sees the login come from pve1."""
    inv = testbed.write_inventory(tmp_path / "hosts.yaml", {"ct301": ("pve2", 301)})
    text = inv.read_text().replace("  pve2:\n", "  pve2:\n    jump: pve1\n")
    inv.write_text(
        text.replace(
            "hosts:\n",
            "hosts:\n  pve1:\n"
            f"    address: {testbed['pve1'].address}\n"
            f"    identity: {testbed.client_key}\n"
            f"    known_hosts: {tmp_path / 'known_hosts'}\n",
            1,
        )
    )
    log = testbed["pve2"].dir / "sshd.log"
    before = log.read_bytes()
    ran = dflashops("exec", "ct301", "--", "hostname", inventory=inv, home=home)
    assert ran.code == 0, ran.err
    assert ran.out == "ct301\n"
    new_lines = log.read_bytes()[len(before) :].decode()
    assert f"Accepted publickey for root from {testbed['pve1'].address}" in new_lines


def test_setup_offline_from_pushed_wheels(testbed, make_container, tmp_path, home):
    ct = make_container("pve2")
    wheel_dir = tmp_path / "wheels"
    _build_wheel(tmp_path / "pkg", wheel_dir)
    reqs = tmp_path / "req.txt"
    reqs.write_text("dfo-probe==1.0\n")
    inv = testbed.write_inventory(
        tmp_path / "hosts.yaml", {"ct": ct}, extra_defaults={"python": "/root/venv/bin/python"}
    )
    ran = dflashops(
        "--json",
        "setup",
        "ct",
        "--wheels",
        str(wheel_dir),
        "--requirements",
        str(reqs),
        inventory=inv,
        home=home,
        timeout=300,
    )
    assert ran.code == 0, ran.err
    doc = json.loads(ran.out)
    assert doc["installed_from"] == "wheels" and doc["sync"]["sent"] > 5
    check = dflashops(
        "exec",
        "ct",
        "--",
        "/root/venv/bin/python",
        "-c",
        "import dfo_probe; print(dfo_probe.VALUE)",
        inventory=inv,
        home=home,
    )
    assert check.out == "probe-ok\n", check.err
    synced = ct.host_path("/workspace/dflashops/workload/__init__.py")
    root = Path(__file__).resolve().parents[2]
    assert synced.read_text() == (root / "workload" / "__init__.py").read_text()
    again = json.loads(
        dflashops("--json", "setup", "ct", "--no-install", inventory=inv, home=home).out
    )
    assert again["sync"]["sent"] == 0 and again["sync"]["unchanged"] == doc["sync"]["sent"]


def _build_wheel(src: Path, out: Path) -> None:
    import subprocess
    import sys

    (src / "dfo_probe").mkdir(parents=True)
    (src / "dfo_probe" / "__init__.py").write_text("VALUE = 'probe-ok'\n")
    (src / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "dfo-probe"\nversion = "1.0"\n'
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
    )


def _fingerprint(b64: str) -> str:
    """OpenSSH's SHA256 fingerprint of a base64 public key blob, computed independently."""
    import base64
    import hashlib

    digest = hashlib.sha256(base64.b64decode(b64)).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")
