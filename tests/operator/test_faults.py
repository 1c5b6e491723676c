"""Failure paths of issue 24 on the `local` target: real tmux, real processes, the real command
line. The evaluator is a stand-in interpreter (no torch here) that writes a result and exits."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.operator.cli import Ran, dflashops
from tests.operator.rundirs import make_run
from tests.operator.test_failure_paths import Here, one_line

RUN = "f-run"
STAND_IN_EVALUATOR = """\
#!/usr/bin/python3
import json, sys
if "workload.eval" in sys.argv:
    out = sys.argv[sys.argv.index("--out") + 1]
    json.dump({"step": 0, "tau": 1.5}, open(out, "w"))
"""


@pytest.fixture
def ws(tmp_path) -> Path:
    return tmp_path / "ws"


@pytest.fixture
def tmux_dir(tmp_path):
    """A private tmux server for the test (TMUX_TMPDIR), killed afterwards."""
    path = tmp_path / "tmux"
    path.mkdir()
    yield path
    env = {**os.environ, "TMUX_TMPDIR": str(path)}
    for server in (["-L", "dflashops"], []):
        subprocess.run(["tmux", *server, "kill-server"], env=env, capture_output=True)


@pytest.fixture
def inventory(tmp_path, ws, tmux_dir) -> Path:
    python = tmp_path / "evalpy"
    python.write_text(STAND_IN_EVALUATOR)
    python.chmod(0o755)
    path = tmp_path / "hosts.yaml"
    env = json.dumps({"TMUX_TMPDIR": str(tmux_dir)})
    path.write_text(
        "version: 1\ntargets:\n"
        f"  local: {{kind: local, workspace: {ws}, python: {python}, env: {env}}}\n"
    )
    return path


@pytest.fixture
def cli(inventory):
    def run(*args: str, **kw) -> Ran:
        env = {"DFLASHOPS_CKPT_LINGER_S": "30", **kw.pop("env", {})}
        return dflashops(*args, inventory=inventory, env=env, **kw)

    return run


def wait_for(what: str, check, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.3)
    raise AssertionError(f"not within {timeout:.0f} s: {what}")


def ended_run(ws: Path, tmp_path: Path) -> Path:
    """A finished training run with two complete checkpoints, and what its eval names."""
    run = make_run(ws, RUN, ckpts=(10, 20))
    model = tmp_path / "target-model"
    model.mkdir()
    (run / "run.yaml").write_text(f"target: {{path: {model}}}\noptim: {{max_steps: 20}}\n")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    return run


def follow_state(ws: Path) -> dict:
    jobs = list((ws / "evals" / RUN / "follow").glob("*/state.json"))
    return json.loads(jobs[0].read_text()) if jobs else {}


def test_a_continuous_eval_on_the_runs_own_target_scores_and_leaves_no_token(cli, ws, tmp_path):
    """Item 2 (the server's and the follower's tokens one path) and item 9 (token files kept)."""
    ended_run(ws, tmp_path)
    ran = cli("eval", RUN, "--every", "10", "--on", "local",
              "--prompts", str(tmp_path / "prompts.jsonl"))  # fmt: skip
    assert ran.code == 0, ran.err
    wait_for("the follower finished", lambda: follow_state(ws).get("status") == "finished")
    assert follow_state(ws).get("done") == [10, 20]
    assert sorted(p.name for p in (ws / "evals" / RUN).glob("step_*.json")) == [
        "step_10.json",
        "step_20.json",
    ]
    secrets = ws / "dflashops" / "secrets"
    wait_for("no token file left", lambda: not list(secrets.glob("ckpt-*")), 30)
    serve = next((ws / "evals" / RUN / "serve").glob("*"))
    assert (serve / "console.log").stat().st_mode & 0o777 == 0o600


# ---------------------------------------------------------------- item 7: real causes


@pytest.fixture
def here(tmp_path):
    bed = Here(tmp_path)
    yield bed
    bed.close()


@pytest.fixture
def small_archive_disk(here):
    """The workspace's archive/ on a 1 MiB filesystem of its own: too small for the run."""
    mount = here.ws / "archive"
    mount.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_an_archive_onto_a_full_disk_names_the_full_disk(here, small_archive_disk):
    run = make_run(here.ws, "full7", ckpts=(10,))
    (run / "checkpoints" / "step_10" / "big.bin").write_bytes(os.urandom(3 << 20))
    ran = here.cli("archive", "full7")
    assert ran.code == 1, ran.out
    line = one_line(ran)
    assert "No space left on device" in line and "not there" not in line, line
    assert (run / "checkpoints" / "step_10" / "big.bin").stat().st_size == 3 << 20
    assert not list(small_archive_disk.iterdir())  # no temporary left on the full disk
    assert json.loads(here.cli("--json", "status", "full7").out)["state"] == "finished"
