"""The failure paths of launch and its kin on the fake Proxmox bed (real sshd, faithful pct, ns
containers), with the stand-in trainer (test_runs_local) so each case takes seconds."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.operator.cli import Ran, dflashops
from tests.operator.rundirs import STAND_IN_TRAINER, make_run, write_checkpoint
from tests.operator.sshd_faults import frozen_sshd
from workload.config import ConfigError, audit, load_config

pytestmark = pytest.mark.testbed
REPO = Path(__file__).resolve().parents[2]


def stand_in(ct) -> str:
    """The stand-in trainer inside a container, as its python."""
    path = Path(ct.host_path("/workspace/stand-in"))
    path.write_text(STAND_IN_TRAINER)
    path.chmod(0o755)
    return "/workspace/stand-in"


def test_a_stopped_container_elsewhere_does_not_block_a_launch(testbed, make_container, tmp_path):
    train = make_container("pve1")
    parked = make_container("pve2", start=False)  # a template or a parked CT, as on any node
    python = stand_in(train)
    inv = testbed.write_inventory(
        tmp_path / "hosts.yaml", {"train": train, "parked": parked},
        extra_defaults={"python": python},
    )  # fmt: skip
    cfg = tmp_path / "c.yaml"
    cfg.write_text("seed: 0\n")

    def cli(*args: str) -> Ran:
        return dflashops(*args, inventory=inv, home=tmp_path, timeout=120)

    launched = cli("launch", "parked-ok", "--host", "train", "--config", str(cfg))
    assert launched.code == 0, launched.err
    warnings = [line for line in launched.err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "parked" in warnings[0], launched.err
    assert json.loads(cli("--json", "status", "parked-ok").out)["state"] == "running"
    assert cli("stop", "parked-ok", "--kill").code == 0

    refused = cli("launch", "parked-no", "--host", "parked", "--config", str(cfg))
    assert refused.code == 3, refused.err
    assert "parked" in refused.err and len(refused.err.strip().splitlines()) == 1, refused.err


# `head -c $((6<<30)) /dev/zero | sha256sum`
ZEROS_6GIB_SHA256 = "5c32c2b28999325bc5ad39d6530bcb46fbdf1f86375a991b7269764c50b0d109"


def test_ckpts_verify_of_a_checkpoint_bigger_than_the_deadline_passes(tmp_path):
    """Hashing 6 GiB takes longer than --timeout 2: the probe's progress is the life the
    deadline counts (issue 16 item 6). The file is sparse: no disk, only hashing."""
    ws = tmp_path / "ws"
    run = make_run(ws, "big")
    step = run / "checkpoints" / "step_8"
    step.mkdir()
    with open(step / "model.safetensors", "wb") as f:
        f.truncate(6 << 30)
    (step / "MANIFEST.sha256").write_text(f"{ZEROS_6GIB_SHA256}  model.safetensors\n")
    inv = tmp_path / "hosts.yaml"
    inv.write_text(f"version: 1\ntargets:\n  here: {{kind: local, workspace: {ws}}}\n")
    ran = dflashops("--json", "--timeout", "2", "ckpts", "big", "--verify", inventory=inv,
                    home=tmp_path)  # fmt: skip
    assert ran.code == 0, ran.err
    [point] = json.loads(ran.out)["checkpoints"]
    assert point["step"] == 8 and point["verified"] is True, point


# ---------------------------------------------------------------- a local target, stand-in trainer


class Here:
    """A local target whose python is the stand-in trainer, on a tmux server of the test's
    own; `cli` runs the command line against it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ws = root / "ws"
        self.tmux = root / "tmux"
        self.tmux.mkdir()
        stub = root / "stand-in"
        stub.write_text(STAND_IN_TRAINER)
        stub.chmod(0o755)
        self.inventory = root / "hosts.yaml"
        self.write_inventory({"TMUX_TMPDIR": str(self.tmux)})
        self.config = root / "c.yaml"
        self.config.write_text("seed: 0\nlog: {wandb: {name: null}}\n")

    def write_inventory(self, env: dict[str, str]) -> None:
        self.inventory.write_text(
            "version: 1\ntargets:\n  local: {kind: local, workspace: "
            f"{self.ws}, python: {self.root / 'stand-in'}, env: {json.dumps(env)}}}\n"
        )

    def cli(self, *args: str, **kw) -> Ran:
        kw.setdefault("timeout", 120)
        return dflashops(*args, inventory=self.inventory, home=self.root, **kw)

    def launch(self, run: str, *extra: str, **kw) -> Ran:
        return self.cli("launch", run, "--host", "local", "--config", str(self.config), *extra,
                        **kw)  # fmt: skip

    def close(self) -> None:
        env = {**os.environ, "TMUX_TMPDIR": str(self.tmux)}
        subprocess.run(["tmux", "-L", "dflashops", "kill-server"], env=env, capture_output=True)


@pytest.fixture
def here(tmp_path):
    bed = Here(tmp_path)
    yield bed
    bed.close()


def one_line(ran: Ran) -> str:
    lines = ran.err.strip().splitlines()
    assert len(lines) == 1, ran.err
    return lines[0]


# ---------------------------------------------------------------- item 8: --set values


def test_a_set_value_never_adds_keys_to_run_yaml(here):
    """A newline in a --set value (inside a YAML flow value, or in a quoted string) stays in
    that value: the header that lists the --set items is one inert JSON line."""
    sets = ["x=[1, \nextra_top: 2] \n#", 'log.wandb.name="a\nextra_top: 2"']
    ran = here.launch("set8", *[a for s in sets for a in ("--set", s)])
    assert ran.code == 0, ran.err
    text = (here.ws / "runs" / "set8" / "run.yaml").read_text()
    data = yaml.safe_load(text)
    assert sorted(data) == ["log", "seed", "x"], text
    assert data["x"] == [1, {"extra_top": 2}] and data["log"]["wandb"]["name"] == "a extra_top: 2"
    assert here.cli("stop", "set8", "--kill").code == 0


@pytest.mark.parametrize("value", ["!!python/name:os.system", "&a [*a]", "!!int abc", "[1,"])
def test_an_odd_set_value_is_one_line_and_exit_2(here, value):
    ran = here.launch("odd8", "--set", f"x={value}", timeout=10)
    assert ran.code == 2, ran.err
    assert one_line(ran).startswith("dflashops: error: --set x"), ran.err
    assert not (here.ws / "runs" / "odd8").exists()


def test_the_trainer_names_the_set_an_unknown_key_came_from(here):
    """`--set optim.max_step=5` (a typo): the config loader names the --set, not a line of
    run.yaml that the user never wrote."""
    ran = here.cli("launch", "typo8", "--host", "local", "--config", "tiny",
                   "--set", "optim.max_step=5", "--set", "loss.gamma=7")  # fmt: skip
    assert ran.code == 0, ran.err  # the stand-in trainer does not read its config
    with pytest.raises(ConfigError) as refused:
        load_config(here.ws / "runs" / "typo8" / "run.yaml")
    assert str(refused.value).startswith("--set optim.max_step=5: optim.max_step: unknown key")
    assert here.cli("stop", "typo8", "--kill").code == 0


# ---------------------------------------------------------------- item 5: a probe lost at start


SLOW_START = """#!/bin/sh
# the stand-in trainer, but its first sign of life comes only after 8 s (a target loading)
case " $* " in *" workload.plan "*) exec /workspace/stand-in "$@" ;; esac
sleep 8
exec /workspace/stand-in "$@"
"""


def test_a_probe_lost_while_the_run_starts_is_tried_again(testbed, make_container, tmp_path):
    """pve1's sshd stops answering for longer than the deadline while the trainer loads: the
    probe gets no answer (NoAnswerError), is tried again, and the healthy run is kept."""
    train = make_container("pve1")
    stand_in(train)
    slow = Path(train.host_path("/workspace/slow-start"))
    slow.write_text(SLOW_START)
    slow.chmod(0o755)
    inv = testbed.write_inventory(tmp_path / "hosts.yaml", {"train": train},
                                  extra_defaults={"python": "/workspace/slow-start"})  # fmt: skip
    cfg = tmp_path / "c.yaml"
    cfg.write_text("seed: 0\n")
    argv = [sys.executable, "-m", "dflashops.cli", "--inventory", str(inv), "--timeout", "3",
            "launch", "blip", "--host", "train", "--config", str(cfg)]  # fmt: skip
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "HOME": str(tmp_path)})  # fmt: skip
    seen = []
    try:
        for raw in proc.stderr:
            seen.append(raw.decode())
            if "blip: starting on train" in seen[-1]:
                break
        with frozen_sshd(testbed["pve1"]):
            time.sleep(5)
        out, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    err = "".join(seen) + err.decode()
    assert proc.returncode == 0, err
    assert "not read" in err and "trying again" in err, err  # the lost probe, said once
    run = Path(train.host_path("/workspace/runs/blip"))
    assert json.loads((run / "state.json").read_text())["status"] == "running", err
    assert dflashops("stop", "blip", "--kill", inventory=inv, home=tmp_path).code == 0


# ---------------------------------------------------------------- item 3: a launch cut short


def kill_when(proc: subprocess.Popen, seen: Callable[[], bool], sig: int) -> None:
    """`sig` to the operator as soon as `seen()` (polled every millisecond), once."""
    deadline = time.monotonic() + 60
    while not seen():
        assert proc.poll() is None and time.monotonic() < deadline, "never got there"
        time.sleep(0.001)
    proc.send_signal(sig)
    proc.wait(timeout=60)


def status_is(path: Path, status: str) -> Callable[[], bool]:
    def seen() -> bool:
        try:
            return json.loads(path.read_text()).get("status") == status
        except (OSError, ValueError):
            return False

    return seen


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL])
@pytest.mark.parametrize("when", ["claiming", "secret written"])
def test_a_launch_cut_short_leaves_its_name_to_the_next(here, sig, when):
    """The operator killed while it claims the name, or once it wrote the secret: SIGTERM and
    SIGHUP take the claim back; after SIGKILL the next launch finds the holder gone (same
    machine, its pid dead) and sweeps the directory and the secrets file at once."""
    run_dir = here.ws / "runs" / "cut3"
    secrets = here.ws / "dflashops" / "secrets"
    env = {**os.environ, "HOME": str(here.root), "CUT_TOKEN": "s3cret"}
    argv = [sys.executable, "-m", "dflashops.cli", "--inventory", str(here.inventory), "launch",
            "cut3", "--host", "local", "--config", str(here.config), "--secret", "CUT_TOKEN"]  # fmt: skip
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=env)  # fmt: skip
    if when == "claiming":
        seen = status_is(run_dir / "state.json", "claiming")
    else:
        seen = lambda: secrets.is_dir() and any(secrets.iterdir())  # noqa: E731
    kill_when(proc, seen, sig)
    err = proc.stderr.read().decode()
    if sig == signal.SIGKILL:
        shown = json.loads(here.cli("--json", "status", "cut3").out)
        assert shown["state"] == "abandoned" and "interrupted" in shown["note"], shown
    else:
        assert proc.returncode == 130 and "interrupted" in err, err
        assert not run_dir.exists(), err
    assert not list(secrets.glob("cut3-*")) or sig == signal.SIGKILL
    again = here.launch("cut3", "--secret", "CUT_TOKEN", env={"CUT_TOKEN": "s3cret"})
    assert again.code == 0, again.err
    assert json.loads(here.cli("--json", "status", "cut3").out)["state"] == "running"
    assert not list(secrets.glob("cut3-*")), "a secrets file was left behind"
    assert here.cli("stop", "cut3", "--kill").code == 0


def test_a_claim_whose_lease_passed_is_taken_over(here):
    """A claim of another machine's operator (its pid means nothing here) is free once its
    lease has passed, not before."""
    run_dir = here.ws / "runs" / "lease3"
    run_dir.mkdir(parents=True)
    hold = {
        "verb": "launch",
        "host": "elsewhere",
        "machine": "another-boot/pid:[1]",
        "pid": 1,
        "start": 1,
        "token": "t0",
        "lease_s": 300,
        "until": time.time() + 300,
    }
    state = {"status": "claiming", "run_id": "r0", "launched": time.time(), "hold": hold}
    (run_dir / "state.json").write_text(json.dumps(state))
    held = here.launch("lease3")
    assert held.code == 2 and "is taken" in one_line(held), held.err
    state["hold"]["until"] = time.time() - 1
    (run_dir / "state.json").write_text(json.dumps(state))
    assert json.loads(here.cli("--json", "status", "lease3").out)["state"] == "abandoned"
    taken = here.launch("lease3")
    assert taken.code == 0, taken.err
    assert here.cli("stop", "lease3", "--kill").code == 0


# ---------------------------------------------------------------- item 4: resume --secret fails


def test_a_resume_that_fails_after_its_secret_leaves_nothing(here):
    """`resume --secret` fails once the secret is written (tmux is not on the target's PATH):
    the secrets file is gone, state.json is as it was, and the next `resume --secret` works."""
    assert here.launch("sec4").code == 0
    assert here.cli("stop", "sec4").code == 0
    run_dir = here.ws / "runs" / "sec4"
    secrets = here.ws / "dflashops" / "secrets"
    before = (run_dir / "state.json").read_bytes()
    bare = here.root / "bin"  # /usr/bin without tmux
    bare.mkdir()
    for tool in Path("/usr/bin").iterdir():
        if tool.name != "tmux":
            (bare / tool.name).symlink_to(tool)
    here.write_inventory({"TMUX_TMPDIR": str(here.tmux), "PATH": str(bare)})
    env = {"S4_TOKEN": "s3cret"}
    failed = here.cli("resume", "sec4", "--secret", "S4_TOKEN", env=env)
    assert failed.code == 1 and "tmux is not installed" in failed.err, failed.err
    assert not secrets.is_dir() or not list(secrets.iterdir()), list(secrets.iterdir())
    assert (run_dir / "state.json").read_bytes() == before
    assert json.loads(here.cli("--json", "status", "sec4").out)["state"] == "stopped"
    here.write_inventory({"TMUX_TMPDIR": str(here.tmux)})
    again = here.cli("resume", "sec4", "--secret", "S4_TOKEN", env=env)
    assert again.code == 0, again.err
    assert json.loads((run_dir / "env.json").read_text())["S4_TOKEN"] == "s3cret"
    assert not list(secrets.iterdir())
    assert here.cli("stop", "sec4", "--kill").code == 0


# ---------------------------------------------------------------- item 7: archive


def manifest_holds(step_dir: Path) -> bool:
    for line in (step_dir / "MANIFEST.sha256").read_text().splitlines():
        digest, name = line.split("  ", 1)
        if hashlib.sha256((step_dir / name).read_bytes()).hexdigest() != digest:
            return False
    return True


@pytest.fixture
def archive_elsewhere(here):
    """The workspace's archive/ on a filesystem of its own (a tmpfs), as a separate disk."""
    mount = here.ws / "archive"
    mount.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_archive_to_another_filesystem_keeps_what_it_does_not_prune(here, archive_elsewhere):
    make_run(here.ws, "xfs7", ckpts=(10, 20, 30))
    write_checkpoint(here.ws / "runs" / "xfs7" / "checkpoints" / "step_35", 35, complete=False)
    ran = here.cli("archive", "xfs7", "--keep-last", "2")
    assert ran.code == 0, ran.err
    moved = archive_elsewhere / "xfs7"
    kept = sorted(p.name for p in (moved / "checkpoints").iterdir())
    assert kept == ["step_20", "step_30"], kept
    assert all(manifest_holds(moved / "checkpoints" / k) for k in kept)
    assert (moved / "train_log.jsonl").read_text().count("\n") == 3
    assert not (here.ws / "runs" / "xfs7").exists()
    assert not [p for p in archive_elsewhere.iterdir() if p.name != "xfs7"]  # no temporary
    assert json.loads(here.cli("--json", "status", "xfs7", "--all").out)["state"] == "archived"


def test_a_resume_between_archives_check_and_move_wins(here):
    """archive reads the run (stopped), and is held there (its plan's output blocks on a full
    pipe) while a resume starts the run: archive's move then refuses in one line, and the
    running run keeps its directory."""
    run = make_run(here.ws, "race7", status="stopped", ckpts=tuple(range(1, 401)))
    reader, writer = os.pipe()
    fcntl.fcntl(writer, getattr(fcntl, "F_SETPIPE_SZ", 1031), 4096)
    env = {**os.environ, "HOME": str(here.root), "COLUMNS": "80"}
    argv = [sys.executable, "-m", "dflashops.cli", "--inventory", str(here.inventory),
            "archive", "race7"]  # fmt: skip
    archive = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=writer,
                               stderr=subprocess.PIPE, env=env)  # fmt: skip
    os.close(writer)
    with os.fdopen(reader, "rb") as out:
        first = out.read(16)  # the plan is being written: the run was read
        assert first, archive.stderr.read()
        resumed = here.cli("resume", "race7")
        assert resumed.code == 0, resumed.err
        rest = out.read()
    archive.wait(timeout=60)
    err = archive.stderr.read().decode()
    assert archive.returncode == 1, (first + rest).decode()[-300:] + err
    assert len(err.strip().splitlines()) == 1 and "changed by another command" in err, err
    assert run.is_dir() and not (here.ws / "archive" / "race7").exists()
    assert json.loads(here.cli("--json", "status", "race7").out)["state"] == "running"
    assert here.cli("stop", "race7", "--kill").code == 0


def test_a_run_being_changed_is_refused_at_once(here):
    """Another command holds the run's lock (here: this test): archive refuses, in one line."""
    run = make_run(here.ws, "busy7", ckpts=(10,))
    with open(run / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ran = here.cli("archive", "busy7", timeout=30)
    assert ran.code == 1 and "busy" in one_line(ran), ran.err
    assert run.is_dir()
    assert here.cli("archive", "busy7").code == 0


# ---------------------------------------------------------------- item 13: first-hour edges


def test_no_runs_names_the_workspace_it_read_and_makes_none(tmp_path):
    """A copy of the shipped demo-hosts.yaml in another folder: `local`'s relative workspace is
    beside that file; `status` says so, and a read creates no workspace there."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shipped = REPO / "demo-hosts.yaml"
    (elsewhere / "hosts.yaml").write_text(shipped.read_text())
    ran = dflashops("status", inventory=elsewhere / "hosts.yaml", cwd=tmp_path, home=tmp_path)
    assert ran.code == 0, ran.err
    ws = elsewhere / ".dflashops" / "workspace"
    assert ran.out.strip() == f"no runs in local:{ws} (not there yet)", ran.out
    assert not (elsewhere / ".dflashops").exists()


def test_the_token_store_beside_a_dataset_is_not_a_job(tmp_path):
    """Training on a datagen dataset leaves the token store beside it (<ws>/data/.tokens/):
    `status` does not list it as a job (it did, `.tokens  unknown  no state.json`)."""
    ws = tmp_path / "ws"
    (ws / "data" / ".tokens" / "abc").mkdir(parents=True)
    inv = tmp_path / "hosts.yaml"
    inv.write_text(f"version: 1\ntargets:\n  local: {{kind: local, workspace: {ws}}}\n")
    ran = dflashops("status", "--all", inventory=inv, cwd=tmp_path, home=tmp_path)
    assert ran.code == 0, ran.err
    assert ".tokens" not in ran.out and ran.out.startswith("no runs"), ran.out


def test_compare_refuses_a_metric_no_run_logged(here):
    make_run(here.ws, "cmp13")
    ran = here.cli("compare", "cmp13", "--metrics", "accuracy,loss", timeout=30)
    assert ran.code == 2, ran.err
    assert one_line(ran) == ("dflashops: error: --metrics accuracy: not in the logs of cmp13; "
                             "they have: acc, loss"), ran.err  # fmt: skip
    assert here.cli("compare", "cmp13", timeout=30).code == 0  # the default keys: no refusal


def test_words_a_cpu_only_target_and_a_new_user_understand(here):
    """A CPU-only local target: the plan and a busy target say CPU, not GPUs; the recipe
    audit names no run the user never had."""
    first = here.launch("cpu13")
    assert first.code == 0, first.err
    assert "on CPU" in first.err and "GPU reading" not in first.err, first.err
    busy = here.launch("cpu13b")
    assert busy.code == 2, busy.err
    assert "run cpu13 (" in busy.err and "runs on its CPU (no GPUs there)" in busy.err, busy.err
    assert here.cli("stop", "cpu13", "--kill").code == 0
    cfg = load_config(REPO / "templates" / "runs" / "tiny.yaml",
                      ["target.path=/t", "data.path=/d", "loss.type=kl", "loss.gamma=10",
                       "loss.weighting=dpace"])  # fmt: skip
    notes = "\n".join(item.line() for item in audit(cfg))
    assert "soft targets" in notes and not re.search(r"\bv[0-9]\b", notes), notes
