"""A bad hosts.yaml gets one line naming file:line and key, exit 2, and no connection attempt."""

from __future__ import annotations

import json
import socket
import textwrap
from pathlib import Path

import pytest

from dflashops.errors import InventoryError
from dflashops.inventory import find_inventory, load_inventory
from tests.operator.cli import dflashops

GOOD = """\
version: 1
defaults:
  workspace: /workspace
  env: {HF_HOME: /workspace/hf}
hosts:
  pve1:
    address: ADDRESS
    port: PORT
    connect_timeout: 2
targets:
  ct200: {host: pve1, vmid: 200, role: train, gpus: 8}
  ct129: {host: pve1, vmid: 129, role: eval, gpus: 1, python: /opt/venv/bin/python}
  gpubox: {kind: ssh, address: 10.1.2.9, user: ubuntu, role: [train, eval]}
  local: {kind: local, workspace: .dflashops/workspace, python: python3}
"""


@pytest.fixture
def listener():
    """A TCP port on loopback that records whether anyone connected."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    yield sock
    sock.close()


def connected(sock: socket.socket) -> bool:
    try:
        conn, _ = sock.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hosts.yaml"
    path.write_text(text)
    return path


def test_good_inventory_parses_with_defaults_and_overrides(tmp_path):
    inv = load_inventory(write(tmp_path, GOOD.replace("ADDRESS", "10.1.2.6").replace("PORT", "22")))
    ct200, ct129 = inv.target("ct200"), inv.target("ct129")
    assert (ct200.kind, ct200.vmid, ct200.host, ct200.role, ct200.gpus) == (
        "pct",
        200,
        "pve1",
        ("train",),
        8,
    )
    assert ct200.python == "/root/venv/bin/python" and ct129.python == "/opt/venv/bin/python"
    assert ct200.env == {"HF_HOME": "/workspace/hf"} and ct200.workspace == "/workspace"
    gpubox = inv.target("gpubox")
    assert gpubox.kind == "ssh" and gpubox.endpoint.user == "ubuntu"
    assert gpubox.endpoint.port is None  # not given: ~/.ssh/config or 22 decides at connect time
    local = inv.target("local")
    assert local.workspace == str((tmp_path / ".dflashops/workspace").resolve())
    assert inv.hosts["pve1"].connect_timeout == 2.0


BAD = [
    # (what to change in GOOD, expected line, expected fragment)
    (
        "ct200: {host: pve1, vmid: 200,",
        "ct200: {host: pve9, vmid: 200,",
        11,
        "targets.ct200.host: 'pve9' is not a host in this file",
    ),
    (
        "vmid: 200,",
        "vmid: two-hundred,",
        11,
        "targets.ct200.vmid: expected an integer 100..999999999",
    ),
    ("vmid: 129,", "vmid: 12,", 12, "targets.ct129.vmid: expected an integer 100..999999999"),
    (
        "    connect_timeout: 2\n",
        "    connect_timeout: 2\n    identiy: ~/.ssh/k\n",
        10,
        "hosts.pve1.identiy: unknown key (did you mean 'identity'?)",
    ),
    (
        "role: train, gpus: 8",
        "role: trian, gpus: 8",
        11,
        "targets.ct200.role: 'trian' is not one of",
    ),
    (
        "  env: {HF_HOME: /workspace/hf}\n",
        "  env: {HF_HOME: /workspace/hf\n",
        5,
        "YAML syntax error",
    ),
    (
        "  workspace: /workspace\n",
        "  workspace: workspace\n",
        3,
        "defaults.workspace: 'workspace' must be an absolute path",
    ),
    # odd YAML: never a traceback or a hang, always file:line, exit 2 (issue 16 item 9)
    ("  workspace: /workspace\n", "  workspace: 2023-13-45\n", 3, "not a valid timestamp"),
    ("  env: {HF_HOME: /workspace/hf}\n", "  env: &a [*a]\n", 4, "contains itself"),
    ("connect_timeout: 2", "connect_timeout: !!int abc", 9, "'abc' is not a valid int"),
    ("role: eval, gpus: 1", "role: ev\0al, gpus: 1", 12, "#x0000"),
    (
        "  workspace: /workspace\n",
        "  workspace: !!python/name:os.system\n",
        3,
        "!!python/name:os.system is not supported",
    ),
    ("version: 1\n", "version: 1\nbomb: BOMB\n", 2, "more than 100000 values"),
]
BOMB = "[&a [x,x,x,x,x,x,x,x,x,x], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a], &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b], &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c], &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d], [*e,*e,*e,*e,*e,*e,*e,*e,*e,*e]]"


@pytest.mark.parametrize(("old", "new", "line", "fragment"), BAD)
def test_bad_inventory_is_one_line_exit_2_and_no_connection(
    tmp_path, listener, old, new, line, fragment
):
    port = listener.getsockname()[1]
    assert old in GOOD
    text = GOOD.replace(old, new).replace("ADDRESS", "127.0.0.1").replace("PORT", str(port))
    path = write(tmp_path, text.replace("BOMB", BOMB))
    ran = dflashops("hosts", inventory=path, home=tmp_path, timeout=30)  # a bomb must not hang
    assert ran.code == 2, ran
    lines = ran.err.strip().splitlines()
    assert len(lines) == 1, ran.err
    assert "Traceback" not in ran.err
    assert f"hosts.yaml:{line}:" in lines[0] and fragment in lines[0], lines[0]
    assert ran.out == ""
    assert not connected(listener)


def test_missing_required_keys_are_named(tmp_path):
    path = write(tmp_path, "version: 1\nhosts:\n  pve1: {port: 22}\n")
    with pytest.raises(InventoryError, match=r"hosts.yaml:3: hosts.pve1: missing 'address'"):
        load_inventory(path)
    path = write(tmp_path, "hosts:\n  pve1: {address: 10.0.0.1}\ntargets:\n  ct1: {host: pve1}\n")
    with pytest.raises(InventoryError, match=r"hosts.yaml:4: targets.ct1: missing 'vmid'"):
        load_inventory(path)


def test_lookup_order(tmp_path, monkeypatch):
    explicit, from_env, here = (tmp_path / n for n in ("a.yaml", "b.yaml", "hosts.yaml"))
    for p in (explicit, from_env, here):
        p.write_text("version: 1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DFLASHOPS_INVENTORY", str(from_env))
    assert find_inventory(str(explicit)) == explicit
    assert find_inventory(None) == from_env
    monkeypatch.delenv("DFLASHOPS_INVENTORY")
    assert find_inventory(None) == here  # absolute: the errors name the file read
    here.unlink()
    user = tmp_path / "home" / ".config" / "dflashops" / "hosts.yaml"
    user.parent.mkdir(parents=True)
    user.write_text("version: 1\n")
    assert find_inventory(None) == user
    user.unlink()
    with pytest.raises(InventoryError, match="no inventory"):
        find_inventory(None)


def test_unknown_target_is_not_found_exit_4(tmp_path):
    path = write(
        tmp_path,
        textwrap.dedent("""\
        targets:
          local: {kind: local, workspace: ws, python: python3}
    """),
    )
    ran = dflashops("exec", "lokal", "--", "true", inventory=path, home=tmp_path)
    assert ran.code == 4 and "no target 'lokal'" in ran.err and "did you mean 'local'" in ran.err


REPO = Path(__file__).resolve().parents[2]


def test_shipped_inventory_has_only_local():
    inv = load_inventory(REPO / "demo-hosts.yaml")
    assert list(inv.targets) == ["local"] and inv.hosts == {}


def test_from_the_clone_the_users_inventory_is_read_and_errors_name_it(tmp_path):
    """Issue 34, item 1: from a clone (the README puts its .venv/bin on PATH), every command
    reads ~/.config/dflashops/hosts.yaml; the clone's own demo inventory is never taken from
    the current directory, and an unknown target's error names the file that was read."""
    user = tmp_path / ".config" / "dflashops" / "hosts.yaml"
    user.parent.mkdir(parents=True)
    user.write_text(GOOD.replace("ADDRESS", "10.1.2.6").replace("PORT", "22"))
    found = dflashops("--dry-run", "doctor", "ct200", home=tmp_path, cwd=REPO)
    assert "no target" not in found.err and "Traceback" not in found.err, found.err
    assert found.code == 0, found.err
    typo = dflashops("--dry-run", "doctor", "ct2000", home=tmp_path, cwd=REPO)
    assert typo.code == 4, typo.err
    assert f"no target 'ct2000' in {user} (did you mean 'ct200'?)" in typo.err, typo.err
    none = dflashops("hosts", home=tmp_path / "nobody", cwd=tmp_path)
    assert none.code == 2 and "no inventory" in none.err and "demo-hosts.yaml" in none.err
    assert str(tmp_path / "nobody" / ".config" / "dflashops" / "hosts.yaml") in none.err


def test_hosts_and_trust_name_the_inventory_they_read(tmp_path):
    path = write(tmp_path, "version: 1\ntargets:\n  local: {kind: local, python: python3}\n")
    listed = dflashops("hosts", inventory=path, home=tmp_path)
    assert listed.code == 0, listed.err
    assert f"inventory: {path}" in listed.err, listed.err
    trusted = dflashops("hosts", "trust", "pve1", "--yes", inventory=path, home=tmp_path)
    assert trusted.code == 4, trusted.err
    assert f"pve1: not a host of {path} (hosts: none), nor an ~/.ssh/config alias" in trusted.err


HOSTILE = ["pve1 -oProxyCommand=x", "-oProxyCommand=touch x", "fe80::1%eth0", "a;touch x",
           "$(touch x)", "`touch x`", "a|b", "a&b", "a>b", "'a'", "a\nb", "a\tb"]  # fmt: skip
WHERE = [  # (what to change in GOOD, with VALUE for the hostile text; its line; its key)
    ("    address: ADDRESS\n", "    address: VALUE\n", 7, "hosts.pve1.address"),
    ("address: 10.1.2.9,", "address: VALUE,", 13, "targets.gpubox.address"),
    ("user: ubuntu,", "user: VALUE,", 13, "targets.gpubox.user"),
    (
        "    connect_timeout: 2\n",
        "    connect_timeout: 2\n    jump: VALUE\n",
        10,
        "hosts.pve1.jump",
    ),
]


@pytest.mark.parametrize("value", HOSTILE)
@pytest.mark.parametrize(("old", "new", "line", "key"), WHERE, ids=[w[3] for w in WHERE])
def test_an_address_a_user_or_a_jump_that_is_not_a_plain_name_is_refused(
    tmp_path, listener, old, new, line, key, value
):
    """Only an IP address or a host name (no whitespace, `%`, leading `-` or anything a shell
    reads): these reach ssh's command line, a ProxyCommand's %h and %r, `Match exec`."""
    port = listener.getsockname()[1]
    quoted = json.dumps(value)  # a YAML double-quoted string
    text = GOOD.replace("ADDRESS", "127.0.0.1").replace("PORT", str(port))
    path = write(
        tmp_path, text.replace(old.replace("ADDRESS", "127.0.0.1"), new.replace("VALUE", quoted))
    )
    ran = dflashops("hosts", inventory=path, home=tmp_path)
    assert ran.code == 2, ran
    lines = ran.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in ran.err, ran.err
    assert f"hosts.yaml:{line}: {key}: " in lines[0], lines[0]
    said = ("not an IP address or host name", "not a user name", "not [user@]host[:port]")
    assert any(words in lines[0] for words in said), lines[0]
    assert not connected(listener)


def test_plain_addresses_users_and_aliases_are_taken(tmp_path):
    text = GOOD.replace("ADDRESS", "pve-1.lab_site.example").replace("PORT", "22")
    text = text.replace("address: 10.1.2.9, user: ubuntu", "address: 'fd00::9', user: deploy_1")
    inv = load_inventory(write(tmp_path, text.replace("    connect_timeout: 2\n",
                                                      "    connect_timeout: 2\n    jump: 'op@bastion_2:2222,10.0.0.1'\n")))  # fmt: skip
    assert inv.hosts["pve1"].address == "pve-1.lab_site.example"
    assert inv.target("gpubox").endpoint.address == "fd00::9"
    assert inv.target("gpubox").endpoint.user == "deploy_1"


def test_a_target_says_its_gpus_model_and_memory(tmp_path):
    text = (
        GOOD.replace("ADDRESS", "10.1.2.6")
        .replace("PORT", "22")
        .replace("gpus: 8}", "gpus: 8, gpu_model: NVIDIA H200, gpu_memory_gib: 139.8}")
    )
    ct = load_inventory(write(tmp_path, text)).targets["ct200"]
    assert (ct.gpus, ct.gpu_model, ct.gpu_memory_gib) == (8, "NVIDIA H200", 139.8)
    bad = write(tmp_path, text.replace("139.8", "lots"))
    with pytest.raises(InventoryError, match=r"hosts.yaml:11: targets.ct200.gpu_memory_gib: "
                       r"expected one GPU's memory in GiB"):  # fmt: skip
        load_inventory(bad)
