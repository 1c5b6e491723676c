"""`shell TARGET` and `attach RUN` on the fake Proxmox bed (real sshd, faithful pct, real
tmux), driven as a user would: typed into a pane of a tmux server the test owns, read back
from the screen. The run is the stand-in trainer (test_runs_local), slow enough to attach to."""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflashops.commands.attach import ATTACH
from tests.operator.cli import Ran, dflashops
from tests.operator.rundirs import STAND_IN_TRAINER, make_run

pytestmark = pytest.mark.testbed

ROOT = Path(__file__).resolve().parents[2]
VMID = 961
RUN = "att.v1"  # a '.' in the name: its session is dflash-att=v1
PROMPT = re.compile(r"(#|\$)$")
_servers = itertools.count()


class Pane:
    """The one pane of a tmux server of the test's own (neither the user's nor dflashops'),
    running bash with HOME set to the test's home."""

    def __init__(self, home: Path) -> None:
        self.tmux = ["tmux", "-L", f"dfo-test-{os.getpid()}-{next(_servers)}", "-f", "/dev/null"]
        shell = ["env", f"HOME={home}", "PS1=$ ", "bash", "--norc", "--noprofile"]
        # wide: a typed line exactly as wide as the pane would be joined (-J) with the next
        self._tmux("new-session", "-d", "-x", "400", "-y", "50", "-s", "t", *shell)

    def _tmux(self, *args: str) -> str:
        done = subprocess.run([*self.tmux, *args], capture_output=True, text=True, timeout=10)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def type(self, line: str) -> None:
        self._tmux("send-keys", "-t", "t", "-l", line)
        self._tmux("send-keys", "-t", "t", "Enter")

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "t", *keys)

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-J", "-t", "t", "-S", "-200")

    def wait_for(self, pattern: str | re.Pattern, timeout: float = 30) -> re.Match:
        regex = re.compile(pattern, re.M) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        while True:
            text = self.screen()
            found = regex.search(text)
            if found:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"{regex.pattern!r} not on the screen:\n{text}")
            time.sleep(0.2)

    def wait_for_prompt(self, after: int, timeout: float = 30) -> None:
        """Until a line after the first `after` ones is a prompt (`# ` or `$ `)."""
        deadline = time.monotonic() + timeout
        while True:
            lines = [ln.rstrip() for ln in self.screen().splitlines() if ln.strip()]
            if len(lines) > after and PROMPT.search(lines[-1]):
                return
            if time.monotonic() > deadline:
                raise AssertionError("no prompt:\n" + "\n".join(lines))
            time.sleep(0.2)

    def exit_code(self, timeout: float = 30) -> int:
        """The `rc=N` our typed command line echoes once dflashops has ended."""
        return int(self.wait_for(r"^rc=(\d+)$", timeout).group(1))

    def close(self) -> None:
        subprocess.run([*self.tmux, "kill-server"], capture_output=True, timeout=10)


@pytest.fixture
def pane(home):
    made = Pane(home)
    made.wait_for_prompt(0)
    yield made
    made.close()


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def box(testbed):
    ct = testbed["pve1"].add_container(VMID, "ns")
    stand_in = ct.host_path("/workspace/stand-in")
    stand_in.write_text(STAND_IN_TRAINER)
    stand_in.chmod(0o755)
    try:
        yield ct
    finally:
        testbed["pve1"].remove_container(VMID)


@pytest.fixture(scope="module")
def here_tmux(tmp_path_factory):
    """TMUX_TMPDIR of the local target `here` (its runs' tmux server), killed afterwards."""
    path = tmp_path_factory.mktemp("tmux")
    yield path
    env = {**os.environ, "TMUX_TMPDIR": str(path)}
    subprocess.run(["tmux", "-L", "dflashops", "kill-server"], env=env, capture_output=True)


@pytest.fixture(scope="module")
def inv(testbed, box, here_tmux, tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("inv")
    stand_in = where / "stand-in"
    stand_in.write_text(STAND_IN_TRAINER)
    stand_in.chmod(0o755)
    here = {"kind": "local", "workspace": str(where / "ws2"), "python": str(stand_in),
            "env": {"TMUX_TMPDIR": str(here_tmux)}}  # fmt: skip
    targets = {
        "box": ("pve1", VMID, {"python": "/workspace/stand-in"}),
        "pve": "pve2",
        "local": {"kind": "local", "workspace": str(where / "ws"), "python": sys.executable},
        "here": here,
    }
    return testbed.write_inventory(where / "hosts.yaml", targets)


@pytest.fixture(scope="module")
def cli(inv, home):
    def run(*args: str, timeout: float = 120, **kw) -> Ran:
        return dflashops(*args, inventory=inv, home=home, timeout=timeout, **kw)

    return run


def logins(testbed, host: str) -> list[str]:
    """The addresses sshd of `host` accepted a login from, in order."""
    log = (testbed[host].dir / "sshd.log").read_text()
    return [
        ln.split(" from ")[1].split()[0] for ln in log.splitlines() if "Accepted publickey" in ln
    ]


def typed(inv: Path, *args: str) -> str:
    """The command line typed into the pane: dflashops, then its exit code echoed."""
    argv = [sys.executable, "-m", "dflashops.cli", "--inventory", str(inv), *args]
    return f'cd {shlex.quote(str(ROOT))} && {shlex.join(argv)}; echo "rc=$?"'


@pytest.fixture(scope="module")
def running(cli, tmp_path_factory):
    """RUN on box: the stand-in trainer printing a step every 0.2 s (1000 steps)."""
    cfg = tmp_path_factory.mktemp("cfg") / "c.yaml"
    cfg.write_text("seed: 0\n")
    launched = cli("launch", RUN, "--host", "box", "--config", str(cfg))
    assert launched.code == 0, launched.err
    yield RUN
    cli("stop", RUN, "--kill")


# ---------------------------------------------------------------- shell


@pytest.mark.parametrize(
    ("target", "hostname"),
    [("box", f"ct{VMID}"), ("pve", "pve2"), ("local", socket.gethostname())],
    ids=["pct", "ssh", "local"],
)
def test_shell_is_a_terminal_in_the_target_and_exit_comes_back(pane, inv, target, hostname):
    pane.type(typed(inv, "shell", target))
    pane.wait_for_prompt(1)
    pane.type('echo "in:$(hostname):$(tty):$TERM"')
    found = pane.wait_for(r"^in:(\S*):(\S*):(\S*)$")
    assert found.group(1) == hostname
    assert found.group(2).startswith("/dev/pts/"), found.group(0)  # a pty end to end
    assert found.group(3), "no TERM in the shell"
    pane.type("exit")
    assert pane.exit_code() == 0
    pane.type("echo back-$((6 * 7))")
    pane.wait_for(r"^back-42$")


def test_shell_passes_the_shell_exit_code_through(pane, inv):
    pane.type(typed(inv, "shell", "box"))
    pane.wait_for_prompt(1)
    pane.type("exit 7")
    assert pane.exit_code() == 7


def test_shell_goes_through_the_jump_host(testbed, pane, box, tmp_path):
    """pve1 reached only through pve2: the shell's client takes the same way in."""
    pve2 = testbed["pve2"]
    inv = testbed.write_inventory(
        tmp_path / "hosts.yaml",
        {"box": ("pve1", VMID)},
        extra_hosts={"pve2": {"address": pve2.address, "port": pve2.port}},
    )
    inv.write_text(inv.read_text().replace("  pve1:\n", "  pve1:\n    jump: pve2\n"))
    before = len(logins(testbed, "pve1"))
    pane.type(typed(inv, "shell", "box"))
    pane.wait_for_prompt(1)
    pane.type('echo "in:$(hostname)"')
    pane.wait_for(rf"^in:ct{VMID}$")
    pane.type("exit")
    assert pane.exit_code() == 0
    # ours (host key and login checked), then the OpenSSH client's: both by way of pve2
    assert logins(testbed, "pve1")[before:] == [pve2.address, pve2.address]


@pytest.mark.lxc
def test_shell_in_a_real_lxc_container(testbed, lxc_ct, pane, tmp_path):
    """pct exec is lxc-attach there, which makes a pty of its own inside the container."""
    inv = testbed.write_inventory(tmp_path / "hosts.yaml", {"lxc": lxc_ct})
    pane.type(typed(inv, "shell", "lxc"))
    pane.wait_for_prompt(1)
    pane.type('echo "in:$(hostname):$(tty)"')
    found = pane.wait_for(r"^in:(\S*):(\S*)$")
    assert found.group(1) == f"ct{lxc_ct.vmid}" and found.group(2).startswith("/dev/")
    pane.type("exit")
    assert pane.exit_code() == 0


def test_shell_in_a_stopped_container_is_one_line(testbed, make_container, tmp_path):
    ct = make_container("pve1", start=False)
    inv = testbed.write_inventory(tmp_path / "hosts.yaml", {"off": ct})
    ran = dflashops("shell", "off", inventory=inv, home=tmp_path)
    assert (ran.code, ran.out) == (3, ""), ran
    assert f"CT {ct.vmid} on pve1 is stopped" in ran.err and len(ran.err.splitlines()) == 1


# ---------------------------------------------------------------- attach


def test_attach_shows_the_run_and_detaching_leaves_it_running(pane, inv, cli, running):
    pane.type(typed(inv, "attach", running))
    pane.wait_for(r"step \d+/1000 loss")  # the trainer's console, live in its session
    first = int(pane.wait_for(r"step (\d+)/1000 loss").group(1))
    pane.wait_for(re.compile(rf"step {first + 3}/1000 loss"))  # and it moves
    pane.keys("C-b", "d")
    assert pane.exit_code() == 0
    assert "[detached (from session dflash-att=v1)]" in pane.screen()
    state = json.loads(cli("--json", "status", running).out)
    assert state["state"] == "running"
    later = json.loads(cli("--json", "status", running).out)
    assert later["step"] >= state["step"]


@pytest.mark.parametrize("target", ["box", "here"], ids=["pct", "local"])
def test_the_session_still_ends_with_the_run(pane, inv, cli, box, here_tmux, tmp_path, target):
    """attach adds a window following console.log: it must not outlive the run's launcher.
    (The pane runs inside a tmux of its own: attaching on the local target still works.)"""
    run = f"att-{target}"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("seed: 0\n")
    assert cli("launch", run, "--host", target, "--config", str(cfg), "--force").code == 0
    pane.type(typed(inv, "attach", run))
    pane.wait_for(r"step \d+/1000 loss")
    pane.keys("C-b", "d")
    assert pane.exit_code() == 0
    assert f"[detached (from session dflash-{run})]" in pane.screen()
    stopped = cli("stop", run, timeout=60)
    assert stopped.code == 0 and f"{run}: stopped at step" in stopped.out, stopped
    tmux = ["tmux", "-L", "dflashops", "list-sessions", "-F", "#{session_name}"]
    if target == "box":
        listed = box.run(tmux).stdout.decode()
    else:
        env = {**os.environ, "TMUX_TMPDIR": str(here_tmux)}
        listed = subprocess.run(tmux, env=env, capture_output=True, text=True).stdout
    assert f"dflash-{run}" not in listed


def test_attach_to_the_newest_running_run_by_default(pane, inv, running):
    pane.type(typed(inv, "attach"))
    pane.wait_for(r"step \d+/1000 loss")
    pane.keys("C-b", "d")
    assert pane.exit_code() == 0


def test_attach_and_shell_refuse_what_they_cannot_reach(testbed, cli, box, running, tmp_path):
    make_run(box.host_path("/workspace"), "done")
    cases = [
        (("attach", "done"), 4, "done: not running (finished)"),
        (("attach", "nosuch"), 4, "no run 'nosuch'"),
        (("attach", running, "--host", "nowhere"), 4, "no target 'nowhere'"),
        (("attach", running, "--node", "1"), 4, f"{running}: no node 1"),
        (("attach", running), 2, "attach needs a terminal"),
        (("shell", "nowhere"), 4, "no target 'nowhere'"),
        (("shell", "box"), 2, "shell needs a terminal"),
    ]
    for args, code, words in cases:
        ran = cli(*args)
        assert (ran.code, ran.out) == (code, ""), (args, ran)
        assert words in ran.err and len(ran.err.splitlines()) == 1, (args, ran.err)
    ghost = testbed.write_inventory(tmp_path / "hosts.yaml", {"ghost": ("pve1", 9999)})
    ran = dflashops("shell", "ghost", inventory=ghost, home=tmp_path)
    assert (ran.code, ran.out) == (4, ""), ran
    assert "ghost: CT 9999 on pve1 does not exist" in ran.err and len(ran.err.splitlines()) == 1


def test_dry_run_prints_what_would_run_on_the_host(cli, running):
    attach = cli("--dry-run", "attach", running)  # where the run is: only the host can say
    assert attach.code == 0, attach.err
    assert f"dry run: run {running}: found by reading the hosts" in attach.err, attach.err
    assert attach.out == ""
    assert "tmux -L dflashops -f /dev/null" in ATTACH and "attach-session" in ATTACH
    shell = cli("--dry-run", "shell", "box")
    assert shell.code == 0 and shell.out.startswith(f"pve1: pct exec {VMID} -- "), shell


# ---------------------------------------------------------------- host keys


def test_an_unknown_host_key_is_refused(testbed, box, tmp_path, home):
    inv = testbed.write_inventory(tmp_path / "hosts.yaml", {"box": ("pve1", VMID)}, pin_keys=False)
    pane = Pane(home)
    try:
        pane.wait_for_prompt(0)
        pane.type(typed(inv, "shell", "box"))
        assert pane.exit_code() == 3
        assert "host key not trusted" in pane.screen()
        assert "dflashops hosts trust pve1" in pane.screen()
    finally:
        pane.close()
    assert not (home / ".ssh" / "known_hosts").exists()
    assert not (home / ".config" / "dflashops" / "known_hosts").exists()
