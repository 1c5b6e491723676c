"""Tables a user reads in a normal terminal, through the real command line on a `local` target
with a long name: run and target names are never cut at 80 or 120 columns, a narrow terminal
gets one block per row, plain output says how the best value is marked, `status --follow` lines
carry the ETA, and `hosts` shows each GPU with the run that holds it.

The only stand-in is nvidia-smi (there is no GPU here): a script on PATH answering the two
queries the run probe makes. The run directories are laid out as the trainer writes them, and
the processes holding the GPUs are real processes (their pid and start time are checked)."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.operator.cli import Ran, dflashops
from tests.operator.rundirs import make_run, write_checkpoint

TARGET = "trainbox-h100-80gb-west-rack07-n3"
A = "demo-20261201-101010"
B = "demo-20261201-101010-kl"  # differs from A by a suffix only


@pytest.fixture
def ws(tmp_path) -> Path:
    return tmp_path / "ws"


@pytest.fixture
def cli(tmp_path, ws):
    inv = tmp_path / "hosts.yaml"
    inv.write_text(
        f"version: 1\ntargets:\n  {TARGET}: {{kind: local, workspace: {ws}, python: python3}}\n"
    )

    def run(*args: str, columns: int, env: dict | None = None, **kw) -> Ran:
        return dflashops(*args, inventory=inv, env={"COLUMNS": str(columns), **(env or {})}, **kw)

    return run


def records(scale: float, steps=range(10, 310, 10), started: float | None = None) -> list[dict]:
    t0 = time.time() - 400 if started is None else started
    return [{"step": s, "time": t0 + s, "loss": scale * 5 / s, "acc": s / 400 / scale,
             "streak": s / 100, "dds8": s / 80, "tok_s": 12345.0, "lr": 3e-4,
             "grad_norm": 1.25} for s in steps]  # fmt: skip


def finished_run(ws: Path, name: str, scale: float, **kw) -> Path:
    """A run of 300 steps that finished."""
    run = make_run(ws, name, records(scale), **kw)
    state = json.loads((run / "state.json").read_text())
    (run / "state.json").write_text(json.dumps({**state, "total_steps": 300}))
    return run


@pytest.fixture
def two_runs(ws):
    finished_run(ws, A, 1.0, ckpts=(100, 200))
    finished_run(ws, B, 0.9)
    for name, loss in ((A, "ce"), (B, "kl")):  # a long value that tells the runs apart
        data = f"/workspace/data/conversations/{name}/regenerated-by-the-target-model.jsonl"
        config = f"loss: {{type: {loss}}}\noptim: {{max_steps: 30}}\ndata: {{path: {data}}}\n"
        (ws / "runs" / name / "run.yaml").write_text(config)
    write_checkpoint(ws / "runs" / A / "checkpoints" / "step_300", 300, complete=False)


def whole(name: str, text: str) -> int:
    """How many times `name` appears as a whole word (not as a part of a longer name)."""
    return len(re.findall(rf"(?<![\w.-]){re.escape(name)}(?![\w.-])", text))


def rows_of(name: str, out: str) -> list[str]:
    return [line for line in out.splitlines() if line.split()[:1] == [name]]


VIEWS = [
    (("status", "--all"), 80),
    (("status", "--all"), 120),
    (("status", A), 120),
    (("compare", A, B), 80),
    (("status", A, "--vs", B), 80),
    (("status", A, "--vs", B), 120),
    (("diff", A, B, "--all"), 80),
]


IDS = [f"{' '.join(a).replace(B, 'B').replace(A, 'A')} at {c}" for a, c in VIEWS]


@pytest.mark.parametrize(("args", "columns"), VIEWS, ids=IDS)
def test_run_and_target_names_are_never_cut(cli, two_runs, args, columns):
    ran = cli(*args, columns=columns)
    assert ran.code == 0, ran.err
    assert "…" not in ran.out and "..." not in ran.out, ran.out
    for name in (A, B) if B in args else (A,):
        assert whole(name, ran.out) >= 1, ran.out
    if args[0] == "status" or args[0] == "ckpts":
        assert whole(TARGET, ran.out) >= 1, ran.out
    for line in ran.out.splitlines():  # every table row with a name in it fits the width
        if f"{A}  " in line or f"{B}  " in line or f"{TARGET}  " in line:
            assert len(line.rstrip()) <= columns, (line, ran.out)


def test_status_all_at_80_columns_tells_the_two_runs_apart(cli, two_runs):
    ran = cli("status", "--all", columns=80)
    assert ran.code == 0, ran.err
    for name in (A, B):
        [row] = rows_of(name, ran.out)
        assert TARGET in row.split() and "finished" in row.split() and "300/300" in row.split()
    # the lesser columns made room, and the table says which
    assert "(not shown at 80 columns: " in ran.out and "--json has all" in ran.out
    wide = cli("status", "--all", columns=220)
    assert "not shown" not in wide.out and "TOK/S" in wide.out


def test_compare_at_80_columns_keeps_the_names_and_the_last_step(cli, two_runs):
    ran = cli("compare", A, B, "--metrics", "acc,loss", columns=80)
    assert ran.code == 0, ran.err
    for name in (A, B):
        rows = rows_of(name, ran.out)
        assert len(rows) == 2, ran.out  # one row per metric
    header = next(line for line in ran.out.splitlines() if line.startswith("acc "))
    assert header.split()[-2:] == ["step", "300"], header


def test_status_vs_headers_are_whole_at_120_columns(cli, two_runs):
    ran = cli("status", A, "--vs", B, columns=120)
    assert ran.code == 0, ran.err
    header = next(line for line in ran.out.splitlines() if line.startswith("STEP"))
    assert header.split() == ["STEP", "RUN", "LOSS", "ACC", "STREAK", "DDS8"], header
    assert f"{A} ({TARGET}) vs {B} ({TARGET})" in ran.out
    a_row = next(line for line in ran.out.splitlines() if line.split()[:2] == ["300", A])
    b_row = next(line for line in ran.out.splitlines() if line.split()[:2] == ["300", B])
    assert a_row.split()[2:4] == ["0.0167", "0.750"] and b_row.split()[2:4] == ["0.0150", "0.833"]


def test_a_narrow_terminal_gets_one_block_per_row(cli, two_runs):
    ran = cli("status", "--all", columns=50)
    assert ran.code == 0, ran.err
    lines = ran.out.splitlines()
    for name, loss in ((A, "0.0167"), (B, "0.0150")):
        at = lines.index(name)  # the name on its own line, whole
        block = lines[at + 1 : at + 12]
        assert f"  target:   {TARGET}" in block and "  state:    finished" in block, block
        assert f"  loss:     {loss}" in block and "  step:     300/300" in block, block
    compared = cli("compare", A, B, "--metrics", "acc", columns=36)
    lines = compared.out.splitlines()
    assert "acc" in lines and A in lines and B in lines, compared.out
    assert "  step 300: 0.833* (+11%)" in lines, compared.out
    diffed = cli("diff", A, B, columns=50)
    lines = diffed.out.splitlines()
    at = lines.index("loss.type")
    assert lines[at + 1].split() == [f"{A}:", "ce"] and lines[at + 2].split() == [f"{B}:", "kl"]


def test_the_legend_says_how_the_best_is_marked(cli, two_runs, tmp_path):
    """Plain output cannot show bold: the best gets a * and the legend says so; a terminal
    shows it in bold, and the legend says that."""
    ran = cli("compare", A, B, "--metrics", "acc,loss", "--steps", "300", columns=120)
    assert ran.code == 0, ran.err
    assert "bold" not in ran.out and "\x1b[" not in ran.out
    assert ran.out.rstrip().endswith("*: the best"), ran.out
    assert rows_of(B, ran.out)[0].split()[1] == "0.833*"  # acc: higher is better
    assert rows_of(B, ran.out)[1].split()[1] == "0.0150*"  # loss: lower is better
    assert "*" not in " ".join(rows_of(A, ran.out))
    later = cli("compare", A, B, "--metrics", "acc", "--steps", "295", columns=120)
    assert rows_of(B, later.out)[0].split()[1:] == ["0.806*", "@290", "(+11%)"], later.out
    on_terminal = on_a_terminal(tmp_path / "hosts.yaml", "compare", A, B, "--metrics", "acc")
    assert "\x1b[1m0.833" in on_terminal and "0.833*" not in on_terminal, on_terminal
    assert "bold: the best" in on_terminal


def test_the_live_view_on_a_narrow_terminal_keeps_the_names_whole(two_runs, tmp_path, cli):
    shown = on_a_terminal(tmp_path / "hosts.yaml", "status", A, "--follow", "--vs", B, columns=60)
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", shown)
    assert set(re.findall(r"demo-[\w.-]*", text)) == {A, B}, text
    assert whole(B, text) >= 3 and TARGET in text.split(), text  # the title, the blocks, rows


def on_a_terminal(inv: Path, *args: str, columns: int = 120) -> str:
    """What the command prints on a terminal (a pty) `columns` wide."""
    env = {**os.environ, "COLUMNS": str(columns), "LINES": "200", "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    main, child = pty.openpty()
    argv = [sys.executable, "-m", "dflashops.cli", "--inventory", str(inv), *args]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=child, stderr=child, env=env)
    os.close(child)
    chunks = []
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the child side closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main)
    assert proc.wait(timeout=60) == 0
    return b"".join(chunks).decode()


def test_follow_lines_carry_the_eta(cli, ws):
    """A running run (its trainer's pid is a live process): the newest line of `status --follow`
    has the ETA; the run then finishes and the follow returns."""
    trainer = subprocess.Popen(["sleep", "120"])
    try:
        now = time.time()
        run = make_run(ws, A, records(1.0, range(1, 50), started=now - 100), status="running")
        state = {"status": "running", "pid": trainer.pid, "pid_start": start_ticks(trainer.pid),
                 "started": now - 100, "total_steps": 1000}  # fmt: skip
        (run / "state.json").write_text(json.dumps(state))

        def finish() -> None:
            done = {**state, "status": "finished", "exit_code": 0, "finished": time.time()}
            (run / "state.json").write_text(json.dumps(done))

        timer = threading.Timer(3.0, finish)
        timer.start()
        ran = cli("status", A, "--follow", "--interval", "1", columns=120, timeout=60)
        timer.join()
    finally:
        trainer.kill()
        trainer.wait()
    assert ran.code == 0, ran.err
    newest = next(line for line in ran.out.splitlines() if "step 49/1000" in line)
    # one step a second over the last records: 951 steps to go
    assert re.search(r"  eta 15m5\ds$", newest), newest
    assert "eta" not in ran.out.replace(newest, "")  # older lines do not claim an ETA


def start_ticks(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


# ---------------------------------------------------------------- hosts: GPUs

STAND_IN_NVIDIA_SMI = """\
#!/bin/sh
# Stands in for nvidia-smi (no GPU here): four GPUs; the pid in ./holder runs on GPU 0, a
# stranger's notebook on GPU 2.
here=$(dirname "$0")
case "$*" in
  *--query-gpu*)
    echo "0, GPU-aaaa, NVIDIA H100 80GB HBM3, 81559, 61234, 97"
    echo "1, GPU-bbbb, NVIDIA H100 80GB HBM3, 81559, 60001, 95"
    echo "2, GPU-cccc, NVIDIA H100 80GB HBM3, 81559, 1200, 3"
    echo "3, GPU-dddd, NVIDIA H100 80GB HBM3, 81559, 0, 0" ;;
  *--query-compute-apps*)
    echo "$(cat "$here/holder"), GPU-aaaa, 61000, python"
    echo "4242, GPU-cccc, 1190, jupyter" ;;
  *) for i in 0 1 2 3; do echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-$i)"; done ;;
esac
"""


@pytest.fixture
def gpu_run(ws, tmp_path):
    """A running run of two ranks on GPUs 0 and 1 (two live processes), and nvidia-smi's
    stand-in on PATH."""
    ranks = [subprocess.Popen(["sleep", "120"]) for _ in range(2)]
    fakebin = tmp_path / "bin"
    fakebin.mkdir()
    (fakebin / "nvidia-smi").write_text(STAND_IN_NVIDIA_SMI)
    (fakebin / "nvidia-smi").chmod(0o755)
    (fakebin / "holder").write_text(str(ranks[0].pid))
    now = time.time()
    run = make_run(ws, B, records(1.0, range(1, 50), started=now - 100), status="running")
    pid, start = ranks[0].pid, start_ticks(ranks[0].pid)
    state = {"status": "running", "pid": pid, "pid_start": start, "started": now - 100}
    (run / "state.json").write_text(json.dumps(state))
    (run / "ranks").mkdir()
    for rank, proc in enumerate(ranks):
        beat = {"rank": rank, "local_rank": rank, "world_size": 2, "pid": proc.pid,
                "pid_start": start_ticks(proc.pid), "status": "running"}  # fmt: skip
        (run / "ranks" / f"rank_{rank}.json").write_text(json.dumps(beat))
    yield {"PATH": f"{fakebin}:{os.environ['PATH']}"}
    for proc in ranks:
        proc.kill()
        proc.wait()


def test_hosts_shows_each_gpu_its_memory_use_and_the_run_holding_it(cli, gpu_run, tmp_path):
    ran = cli("hosts", columns=120, env=gpu_run)
    assert ran.code == 0, ran.err
    lines = ran.out.splitlines()
    header = next(line for line in lines if line.startswith("TARGET") and "GPU " in line)
    assert header.split() == ["TARGET", "GPU", "MEMORY", "USED", "UTIL", "HELD", "BY", "MODEL"]
    rows = {line.split()[1]: line for line in lines if line.split()[:1] == [TARGET]
            and line.split()[1].isdigit()}  # fmt: skip
    assert set(rows) == {"0", "1", "2", "3"}, ran.out
    assert "59.8 of 79.6 GiB" in rows["0"] and " 97% " in rows["0"] and whole(B, rows["0"]) == 1
    assert whole(B, rows["1"]) == 1  # rank 1's local rank: nvidia-smi shows no pid for it
    assert "1.2 of 79.6 GiB" in rows["2"] and "pid 4242 (jupyter)" in rows["2"]
    assert rows["3"].split()[2:7] == ["0.0", "of", "79.6", "GiB", "0%"] and " - " in rows["3"]
    assert "NVIDIA H100 80GB HBM3" in rows["3"]
    # what the inventory does not say about the GPUs (issue 34): the entry that says it
    entry = "gpus: 4, gpu_model: NVIDIA H100 80GB HBM3, gpu_memory_gib: 79.6"
    assert (f"{TARGET}: nvidia-smi shows 4 x NVIDIA H100 80GB HBM3 (79.6 GiB); say so in "
            f"{tmp_path / 'hosts.yaml'}, targets.{TARGET}: {{{entry}}}") in ran.err, ran.err  # fmt: skip
    narrow = cli("hosts", columns=80, env=gpu_run)
    assert all(len(line.rstrip()) <= 80 for line in narrow.out.splitlines() if TARGET in line)
    assert whole(B, narrow.out) == 2, narrow.out
    doc = json.loads(cli("--json", "hosts", columns=80, env=gpu_run).out)
    [row] = doc["targets"]
    gpus = {g["index"]: g for g in row["devices"]}
    assert gpus[0]["runs"] == [B] and gpus[0]["memory_used_mib"] == 61234
    assert gpus[2]["runs"] == [] and gpus[2]["processes"][0]["pid"] == 4242
