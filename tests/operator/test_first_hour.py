"""What a new user reaches for first, through the real command line: `--version`, a plot from
the default install, tab completion of run and target names (bounded when a target hangs),
and one wording for a run that is not there."""

from __future__ import annotations

import json
import re
import socket
import sys
import time
from datetime import date
from importlib.metadata import requires, version
from pathlib import Path

import pytest

from tests.operator.cli import Ran, dflashops
from tests.operator.rundirs import make_run

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def ws(tmp_path) -> Path:
    return tmp_path / "ws"


@pytest.fixture
def silent_port():
    """A TCP port that accepts connections and never says a word (a hung sshd)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield sock.getsockname()[1]


def local_entry(ws: Path, tmp_path: Path) -> dict:
    tmux = tmp_path / "tmux"
    tmux.mkdir(exist_ok=True)
    return {"kind": "local", "workspace": str(ws), "python": sys.executable,
            "env": {"TMUX_TMPDIR": str(tmux)}}  # fmt: skip


def write_inventory(path: Path, targets: dict) -> Path:
    path.write_text("version: 1\ntargets:\n" + "".join(
        f"  {name}: {json.dumps(spec)}\n" for name, spec in targets.items()))  # fmt: skip
    return path


@pytest.fixture
def inventory(tmp_path, ws) -> Path:
    return write_inventory(tmp_path / "hosts.yaml", {"local": local_entry(ws, tmp_path)})


@pytest.fixture
def hung_inventory(tmp_path, ws, silent_port) -> Path:
    """`local`, and `hung`: an sshd that never answers."""
    hung = {"kind": "ssh", "address": "127.0.0.1", "port": silent_port}
    return write_inventory(
        tmp_path / "hosts.yaml", {"local": local_entry(ws, tmp_path), "hung": hung}
    )


@pytest.fixture
def cli(inventory, tmp_path):
    def run(*args: str, **kw) -> Ran:
        return dflashops(*args, inventory=inventory, home=tmp_path, **kw)

    return run


# ---------------------------------------------------------------- --version


def test_version_prints_the_package_version(cli):
    declared = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    ran = cli("--version")
    assert (ran.code, ran.out, ran.err) == (0, f"dflashops {declared}\n", "")
    assert version("dflashops") == declared


# ---------------------------------------------------------------- compare --plot


def curve(steps: range, loss, acc) -> list[dict]:
    now = time.time()
    return [{"step": s, "time": now - 1000 + s, "loss": loss(s), "acc": acc(s)} for s in steps]


def svg_texts(path: Path) -> list[str]:
    """The text matplotlib drew (its SVG keeps each string as a comment over the glyphs)."""
    return [t.strip() for t in re.findall(r"<!-- (.*?) -->", path.read_text(), re.S)]


def test_matplotlib_comes_with_the_operator():
    assert any(re.match(r"matplotlib\b", r) for r in requires("dflashops") or [])


def test_plot_has_a_title_and_a_log_scale_for_a_loss_over_decades(cli, ws, tmp_path):
    make_run(ws, "dec-a", curve(range(10, 1001, 10), lambda s: 50.0 / s, lambda s: s / 2000))
    make_run(ws, "dec-b", curve(range(10, 501, 10), lambda s: 40.0 / s, lambda s: s / 1500),
             where="archive")  # fmt: skip
    out = tmp_path / "curves.svg"
    ran = cli("compare", "dec-a", "dec-b", "--metrics", "loss,acc", "--plot", str(out))
    assert ran.code == 0, ran.err
    assert f"wrote {out}" in ran.err
    texts = svg_texts(out)
    assert f"dec-a, dec-b on local · {date.today().isoformat()}" in texts
    assert any("10^{-1}" in t for t in texts), texts  # log ticks on the loss panel
    assert "loss" in texts and "acc" in texts and "step" in texts
    assert "no run logged streak" not in texts
    ran = cli("compare", "dec-a", "dec-b", "--plot", str(out))  # the default keys have streak
    assert ran.code == 0 and "no run logged streak" in svg_texts(out), ran.err
    ran = cli("compare", "dec-a", "dec-b", "--metrics", "loss,streak", "--plot", str(out))
    assert ran.code == 2 and "--metrics streak: not in the logs" in ran.err, ran.err


def test_plot_stays_linear_when_the_loss_does_not_span_decades(cli, ws, tmp_path):
    make_run(ws, "flat", curve(range(10, 101, 10), lambda s: 2.0 - s / 200, lambda s: 0.5))
    out = tmp_path / "flat.svg"
    ran = cli("compare", "flat", "flat", "--metrics", "loss", "--plot", str(out))
    assert ran.code == 0, ran.err
    texts = svg_texts(out)
    assert not any("10^{" in t for t in texts), texts
    assert any(t.startswith("flat on local") for t in texts)


def test_plot_png_from_the_default_install(cli, ws, tmp_path):
    make_run(ws, "p1")
    make_run(ws, "p2")
    out = tmp_path / "curves.png"
    ran = cli("compare", "p1", "p2", "--plot", str(out))
    assert ran.code == 0, ran.err
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


def test_a_plot_file_that_cannot_be_written_is_refused_first(cli, ws, tmp_path):
    make_run(ws, "p1")
    for path, says in [(tmp_path / "x.txt", "name a .png, .svg, .pdf or .jpg file"),
                       (tmp_path / "nodir" / "x.png", "no directory")]:  # fmt: skip
        ran = cli("compare", "p1", "p1", "--plot", str(path))
        assert ran.code == 2 and ran.out == "", ran.err
        assert ran.err.startswith(f"dflashops: error: --plot {path}: {says}"), ran.err


def test_help_loads_neither_matplotlib_nor_torch():
    ran = dflashops("--help", env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert ran.code == 0
    loaded = {line.split("|")[-1].strip().split(".")[0] for line in ran.err.splitlines()}
    assert "dflashops" in loaded and "typer" in loaded
    assert not loaded & {"matplotlib", "torch", "numpy"}


# ---------------------------------------------------------------- shell completion


def complete(inventory: Path, line: str, home: Path) -> tuple[list[str], Ran, float]:
    """What bash completion offers for `line` (the last word is the one being completed),
    through typer's protocol, as the script from --install-completion asks for it."""
    words = line.split(" ")
    env = {"COMP_WORDS": line, "COMP_CWORD": str(len(words) - 1),
           "_DFLASHOPS_COMPLETE": "complete_bash", "DFLASHOPS_INVENTORY": str(inventory)}  # fmt: skip
    start = time.monotonic()
    ran = dflashops(home=home, env=env, timeout=30)
    return ran.out.split(), ran, time.monotonic() - start


def test_completion_of_run_names_for_every_command_that_takes_one(inventory, ws, tmp_path):
    for name in ("alpha-1", "alpha-2", "beta"):
        make_run(ws, name)
    make_run(ws, "alpha-old", where="archive")
    lines = ["status al", "status alpha-1 --vs al", "logs al", "stop al", "resume al",
             "archive al", "compare alpha-1 al", "diff al", "ckpts al", "eval al",
             "pull-ckpt 10 --to local --run al", "evals al"]  # fmt: skip
    for line in lines:
        got, ran, _ = complete(inventory, f"dflashops {line}", tmp_path)
        assert (ran.code, ran.err) == (0, ""), (line, ran.err)
        want = ["alpha-1", "alpha-2", "alpha-old"]
        if line.startswith("compare alpha-1"):  # a run already compared is not offered again
            want.remove("alpha-1")
        assert got == want, line
    got, _, _ = complete(inventory, "dflashops status ", tmp_path)
    assert got == ["alpha-1", "alpha-2", "alpha-old", "beta"]
    got, _, _ = complete(inventory, "dflashops launch al", tmp_path)
    assert got == []  # launch names a new run


def test_completion_of_target_names_from_the_inventory(tmp_path, ws, silent_port):
    inv = write_inventory(tmp_path / "hosts.yaml", {
        "local": local_entry(ws, tmp_path),
        "lonely": {"kind": "ssh", "address": "127.0.0.1", "port": silent_port},
        "gpubox": {"kind": "ssh", "address": "127.0.0.1", "port": silent_port},
    })  # fmt: skip
    cases = {"exec lo": ["local", "lonely"], "setup g": ["gpubox"], "push l": ["local", "lonely"],
             "run-script lon": ["lonely"], "launch r1 --host g": ["gpubox"],
             "launch r1 --host local,lo": ["local,lonely"], "eval r1 --on lo": ["local", "lonely"],
             "pull-ckpt 10 --to gp": ["gpubox"], "logs r1 --host lon": ["lonely"]}  # fmt: skip
    for line, want in cases.items():
        got, ran, seconds = complete(inv, f"dflashops {line}", tmp_path)
        assert (ran.code, ran.err, got) == (0, "", want), line
        assert seconds < 2.5, (line, seconds)  # the inventory only: no target is read


def test_completion_is_bounded_and_silent_when_a_target_hangs(tmp_path, ws, hung_inventory):
    make_run(ws, "quick-1")
    got, ran, seconds = complete(hung_inventory, "dflashops logs qu", tmp_path)
    assert (ran.code, ran.err, got) == (0, "", ["quick-1"])
    assert seconds < 4.5, seconds  # 3 s at most waiting on targets, plus starting python


def test_completion_with_a_broken_inventory_offers_nothing_and_says_nothing(tmp_path):
    inv = tmp_path / "hosts.yaml"
    inv.write_text("version: 1\ntargets:\n  local: {kind: local, vmid: x\n")
    for line in ("dflashops status ", "dflashops exec l"):
        got, ran, _ = complete(inv, line, tmp_path)
        assert (ran.code, got, ran.err) == (0, [], ""), line


@pytest.mark.testbed
def test_completion_reads_run_names_from_a_container(testbed, fresh_ct, tmp_path, ws):
    make_run(fresh_ct.host_path("/workspace"), "bed-run-1")
    make_run(fresh_ct.host_path("/workspace"), "bed-run-2", where="archive")
    make_run(ws, "bed-local")
    inv = testbed.write_inventory(
        tmp_path / "hosts.yaml", {"ct": fresh_ct, "local": local_entry(ws, tmp_path)}
    )
    got, ran, seconds = complete(inv, "dflashops status bed-", tmp_path)
    assert (ran.code, ran.err) == (0, "")
    assert got == ["bed-local", "bed-run-1", "bed-run-2"]
    print(f"completion over the test bed: {seconds:.2f} s")


# ---------------------------------------------------------------- no such run


NOT_FOUND = "dflashops: error: no run 'v9' on the targets read (runs: v3, v4, v5)\n"


def test_one_wording_for_a_run_that_is_not_there(cli, ws):
    make_run(ws, "v3", where="archive")
    make_run(ws, "v4")
    make_run(ws, "v5", ckpts=(10,))
    commands = [("status", "v9"), ("status", "v4", "--vs", "v9"), ("logs", "v9"), ("stop", "v9"),
                ("resume", "v9"), ("archive", "v9"), ("compare", "v4", "v9"), ("diff", "v9", "v4"),
                ("ckpts", "v9"), ("eval", "v9", "--step", "10", "--on", "local"),
                ("pull-ckpt", "10", "--to", "local", "--run", "v9"), ("evals", "v9")]  # fmt: skip
    for args in commands:
        ran = cli(*args)
        assert (ran.code, ran.err) == (4, NOT_FOUND), args
    none_yet = cli("evals", "v4")  # a run that is there, never evaluated
    assert (none_yet.code, none_yet.out, none_yet.err) == (0, "no stored eval results of v4\n", "")
    near = cli("logs", "v44")
    assert near.code == 4
    assert near.err == ("dflashops: error: no run 'v44' on the targets read (did you mean 'v4'?) "
                        "(runs: v3, v4, v5)\n")  # fmt: skip
    both = cli("compare", "v8", "v4", "v9")
    assert (
        both.err == "dflashops: error: no run 'v8', 'v9' on the targets read (runs: v3, v4, v5)\n"
    )


def test_no_such_run_when_a_target_could_not_be_read(tmp_path, ws, hung_inventory):
    make_run(ws, "v4")
    for args in (("logs", "v9"), ("compare", "v4", "v9")):
        ran = dflashops("--timeout", "1", *args, inventory=hung_inventory, home=tmp_path)
        assert ran.code == 3, ran.err
        assert ran.err.startswith(
            "dflashops: error: no run 'v9' on the targets read (runs: v4); not read: hung ("
        ), ran.err


# ---------------------------------------------------------------- a port that is no sshd


@pytest.fixture
def closing_port():
    """A TCP port that accepts connections and closes each at once (sshd past MaxStartups,
    a TCP wrapper refusing us)."""
    import threading

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)

    def serve() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    yield sock.getsockname()[1]
    sock.close()


@pytest.mark.parametrize("port", ["silent_port", "closing_port"])
def test_a_port_that_sends_no_ssh_banner_is_said_to(tmp_path, ws, port, request):
    """What happened, not a guess: the connection was taken and then either nothing came
    within the connect timeout, or it was closed before the server's first line."""
    number = request.getfixturevalue(port)
    hung = {"kind": "ssh", "address": "127.0.0.1", "port": number, "connect_timeout": 2}
    inv = write_inventory(tmp_path / "hosts.yaml", {"hung": hung})
    began = time.monotonic()
    ran = dflashops("exec", "hung", "--", "true", inventory=inv, home=tmp_path)
    took = time.monotonic() - began
    assert ran.code == 3 and len(ran.err.strip().splitlines()) == 1, ran
    said = ran.err.removeprefix(f"dflashops: error: hung (root@127.0.0.1:{number}): ")
    if port == "silent_port":
        assert said.startswith(f"no answer in 2 s: no SSH banner from 127.0.0.1:{number}"), said
        assert took >= 2, took
    else:
        assert said.startswith(
            f"the connection was closed before an SSH banner from 127.0.0.1:{number}"
        ), said
        assert "no answer" not in said


# ---------------------------------------------------------------- noise in the start-up lines

C10D_NOISE = (
    "[W1202 09:39:19.215350417 socket.cpp:207] [c10d] The hostname of the client socket "
    "cannot be retrieved. err=-3\n"
)


def test_c10d_saying_a_peer_has_no_name_is_not_shown_as_what_the_run_said_last(ws):
    """Nodes on a LAN without DNS: c10d warns at every connection (seen in every multi-node
    launch's start-up lines). The console the operator reads for what a run said leaves that
    exact line out, and nothing else."""
    import subprocess

    from dflashops.remote import source as remote_source

    run = make_run(ws, "quiet")
    said = ["rank 0/4: pid 191 on ct971, device cpu", "target: /workspace/tiny/target"]
    text = C10D_NOISE + f"{said[0]}\n" + C10D_NOISE + C10D_NOISE.replace("err=-3", "err=-2")
    text += f"{said[1]}\n" + C10D_NOISE + "W: the hostname of the client socket is fine\n"
    (run / "console.log").write_text(text)
    request = {"ws": str(ws), "names": ["quiet"], "records": "none", "console": 8192}
    argv = ["python3", "-c", remote_source("runs_probe.py")]
    out = subprocess.run(argv, input=json.dumps(request).encode(), capture_output=True, check=True)
    tail = json.loads(out.stdout)["runs"][0]["console"]["tail"]
    assert tail.splitlines() == [*said, "W: the hostname of the client socket is fine"]
