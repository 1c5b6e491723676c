"""The run lifecycle on the fake Proxmox bed: real sshd, a faithful pct, ns containers whose
python is this test venv's, real tmux and a real (tiny, few-step) training on CPU.

Two containers on two hosts: `train` (CT 951 on pve1) trains, `evalbox` (CT 952 on pve2)
receives checkpoints and evaluates. The tiny target is built once per cache key and pushed
into both containers with `dflashops push`.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from pathlib import Path

import pytest

from tests.operator.ckpt_copies import wait_for
from tests.operator.cli import Ran, dflashops
from tests.operator.rundirs import STAND_IN_TRAINER
from tests.operator.tiny_target import tiny_run_config

pytestmark = pytest.mark.testbed

ROOT = Path(__file__).resolve().parents[2]
TRAIN_VMID, EVAL_VMID = 951, 952
RUNNING = ("launching", "starting", "running")


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def bed(testbed):
    """Two fresh containers on two hosts, removed (with their processes) afterwards."""
    train = testbed["pve1"].add_container(TRAIN_VMID, "ns")
    evalbox = testbed["pve2"].add_container(EVAL_VMID, "ns")
    try:
        yield {"train": train, "evalbox": evalbox}
    finally:
        testbed["pve1"].remove_container(TRAIN_VMID)
        testbed["pve2"].remove_container(EVAL_VMID)


@pytest.fixture(scope="module")
def inv(testbed, bed, tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("inv")
    return testbed.write_inventory(
        where / "hosts.yaml", dict(bed), extra_defaults={"python": sys.executable}
    )


@pytest.fixture(scope="module")
def cli(inv, home):
    def run(*args: str, timeout: float = 240, **kw) -> Ran:
        return dflashops(*args, inventory=inv, home=home, timeout=timeout, **kw)

    return run


@pytest.fixture(scope="module")
def config(cli, tmp_path_factory) -> Path:
    """The tiny build in both containers, and a run config pointing at it there."""
    sections = {"optim": {"max_steps": 8, "batch_size": 4}, "log": {"log_every": 2},
                "checkpoint": {"every": 4, "keep_last": 3}}  # fmt: skip
    return tiny_run_config(cli, tmp_path_factory.mktemp("cfg"), sections, name="tiny-run.yaml")


@pytest.fixture(scope="module")
def trained(cli, config):
    """r-main (8 steps, checkpoints 4 and 8) and r-kl (kl loss, 4 steps), both to the end."""
    main = cli("launch", "r-main", "--host", "train", "--config", str(config))
    assert main.code == 0, main.err
    kl = cli(  # --force: r-main holds the target (CPU: they can share it)
        "launch", "r-kl", "--host", "train", "--config", str(config), "--force",
        "--set", "loss.type=kl", "--set", "optim.max_steps=4", "--set", "checkpoint.every=2",
    )  # fmt: skip
    assert kl.code == 0, kl.err
    follows = {}
    for run in ("r-main", "r-kl"):
        follows[run] = cli("status", run, "--follow", "--interval", "1")
        assert follows[run].code == 0, follows[run].err
    return {"launch": main, "follow": follows}


def status(cli, run: str) -> dict:
    ran = cli("--json", "status", run)
    assert ran.code == 0, ran.err
    return json.loads(ran.out)


# ---------------------------------------------------------------- launch, status, follow


@pytest.mark.slow  # shares the module's two real trainings (about a minute)
def test_launch_runs_detached_then_status_follows_it_to_the_end(cli, trained, bed):
    launched = trained["launch"]
    # finished already where 8 steps take less than the launch's own look at it
    assert re.search(r"r-main: (running|finished) on train \(tmux dflash-r-main", launched.out)
    assert "starting on train" in launched.err
    follow = trained["follow"]["r-main"]
    steps = [line.split()[2] for line in follow.out.splitlines() if line.startswith("r-main step")]
    assert steps[-1] == "8/8" and len(steps) >= 2
    assert "r-main: finished at step 8 (exit code 0)" in follow.err
    doc = status(cli, "r-main")
    assert doc["state"] == "finished" and doc["step"] == 8 and doc["total_steps"] == 8
    assert set(doc["metrics"]) >= {"loss", "acc", "streak", "dds8", "tok_s"}
    run_dir = bed["train"].host_path("/workspace/runs/r-main")
    assert (run_dir / "run.yaml").read_text().startswith("# run.yaml of run r-main")
    assert json.loads((run_dir / "state.json").read_text())["tmux"] == "dflash-r-main"
    logs = [run_dir / "console.log", *sorted((run_dir / "ranks").glob("rank_*.log"))]
    assert all(b"\r" not in p.read_bytes() for p in logs)  # lines, never a progress bar
    table = cli("status", "--all")
    assert table.code == 0, table.err
    row = next(line for line in table.out.splitlines() if line.startswith("r-main "))
    assert row.split()[1:4] == ["train", "finished", "8/8"]


@pytest.mark.slow
def test_status_hides_finished_runs_unless_all(cli, trained):
    ran = cli("--json", "status")
    doc = json.loads(ran.out)
    assert ran.code == 0 and doc["hidden"] >= 2
    assert {"r-main", "r-kl"}.isdisjoint(r["run"] for r in doc["runs"])
    shown = {r["run"]: r for r in json.loads(cli("--json", "status", "--all").out)["runs"]}
    assert shown["r-main"]["state"] == shown["r-kl"]["state"] == "finished"
    assert (shown["r-main"]["target"], shown["r-main"]["step"]) == ("train", 8)


@pytest.mark.slow
def test_duplicate_run_name_is_refused_on_any_target(cli, trained, bed):
    ran = cli("launch", "r-main", "--host", "evalbox", "--config", "tiny")
    assert ran.code == 2
    assert "run name 'r-main' is taken (train:runs/r-main (finished))" in ran.err
    assert not bed["evalbox"].host_path("/workspace/runs/r-main").exists()


def test_a_config_error_is_one_line_exit_2_before_anything_starts(cli, config, bed):
    """The memory plan reads the config in the target first: a bad value is refused there, in
    the trainer's own words, naming the --set it came from, and the launch leaves nothing
    behind."""
    ran = cli(
        "launch", "r-bad", "--host", "train", "--config", str(config), "--set", "loss.type=nonsense"
    )
    assert ran.code == 2, ran.err
    errors = [line for line in ran.err.splitlines() if line.startswith("dflashops: error:")]
    assert errors == [
        "dflashops: error: r-bad: --set loss.type=nonsense: loss.type: 'nonsense' is not one of"
        " ce, kl, blend"
    ]
    assert "Traceback" not in ran.err
    assert not bed["train"].host_path("/workspace/runs/r-bad").exists()
    assert cli("status", "r-bad").code == 4


@pytest.mark.slow
def test_logs_tail_and_follow_of_a_finished_run(cli, trained):
    tail = cli("logs", "r-main", "--tail", "2")
    assert tail.code == 0, tail.err
    lines = tail.out.splitlines()
    assert len(lines) == 2 and lines[-1].endswith("exit code 0")
    whole = cli("logs", "r-main", "--follow")
    assert whole.code == 0 and "step 8/8" in whole.out and whole.out.endswith(tail.out)


# ---------------------------------------------------------------- compare and diff


@pytest.mark.slow
def test_compare_two_runs_at_steps(cli, trained):
    ran = cli("--json", "compare", "r-main", "r-kl", "--steps", "3,4,8")
    assert ran.code == 0, ran.err
    doc = json.loads(ran.out)
    main, kl = doc["runs"]
    assert (main["run"], kl["run"]) == ("r-main", "r-kl")
    assert main["values"]["acc"]["3"]["step"] == 2  # the last record at or before step 3
    assert main["values"]["loss"]["8"]["step"] == 8
    assert kl["values"]["loss"]["4"]["step"] == 4 and kl["values"]["loss"]["8"] is None
    text = cli("compare", "r-main", "r-kl", "--steps", "3,8").out
    kl_row = next(line for line in text.splitlines() if line.startswith("r-kl ") and "@2" in line)
    assert kl_row.split()[-1] == "-"  # never reached step 8


@pytest.mark.slow
def test_diff_shows_the_differing_key_with_its_audit(cli, trained):
    ran = cli("diff", "r-main", "r-kl")
    assert ran.code == 0, ran.err
    row = next(line for line in ran.out.splitlines() if line.startswith("loss.type"))
    assert row.split()[1:4] == ["ce", "kl", "*"] and "recipe ce" in row
    doc = json.loads(cli("--json", "diff", "r-main", "r-kl").out)
    keys = {r["key"]: r for r in doc["rows"]}
    assert keys["optim.max_steps"]["values"] == {"r-main": 8, "r-kl": 4}


# ---------------------------------------------------------------- checkpoints across hosts


@pytest.mark.slow
def test_pull_ckpt_to_another_host_is_verified_and_idempotent(cli, trained, bed, testbed):
    ran = cli("--json", "pull-ckpt", "8", "--to", "evalbox", "--run", "r-main")
    assert ran.code == 0, ran.err
    doc = json.loads(ran.out)
    assert doc["copied"] and doc["from"] == "train" and doc["files"] == 4
    src = bed["train"].host_path("/workspace/runs/r-main/checkpoints/step_8")
    dst = bed["evalbox"].host_path("/workspace/ckpts/r-main/step_8")
    assert _hashes(dst) == _hashes(src)
    assert (dst.parent / "run.yaml").read_text().startswith("# run.yaml of run r-main")
    again = json.loads(cli("--json", "pull-ckpt", "8", "--to", "evalbox", "--run", "r-main").out)
    assert again["copied"] is False
    # damage the copy there: the next pull notices and copies it again
    blob = dst / "model.safetensors"
    data = bytearray(blob.read_bytes())
    data[1000] ^= 0xFF
    blob.write_bytes(bytes(data))
    healed = cli("pull-ckpt", "8", "--to", "evalbox", "--run", "r-main")
    assert healed.code == 0 and "does not verify (sha256 mismatch: model.safetensors)" in healed.err
    assert _hashes(dst) == _hashes(src)


@pytest.mark.slow
def test_pull_ckpt_corrupted_in_flight_keeps_nothing(cli, trained, bed, testbed):
    testbed["pve2"].set_faults(corrupt_exec_stdin_at=300_000)
    ran = cli("pull-ckpt", "4", "--to", "evalbox", "--run", "r-main")
    assert ran.code == 1, ran.err
    assert "does not match its MANIFEST.sha256" in ran.err or "receiving" in ran.err
    ckpts = bed["evalbox"].host_path("/workspace/ckpts/r-main")
    left = [p.name for p in ckpts.iterdir()] if ckpts.exists() else []
    assert "step_4" not in left and not [n for n in left if n.startswith(".tmp")]


@pytest.mark.slow
def test_pull_ckpt_missing_or_incomplete_step(cli, trained, bed):
    missing = cli("pull-ckpt", "5", "--to", "evalbox", "--run", "r-main")
    assert missing.code == 4 and "complete steps: 4, 8" in missing.err
    partial = bed["train"].host_path("/workspace/runs/r-kl/checkpoints/step_3")
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    refused = cli("pull-ckpt", "3", "--to", "evalbox", "--run", "r-kl")
    assert refused.code == 2 and "incomplete" in refused.err


@pytest.mark.slow
def test_eval_on_another_target_writes_the_contract_keys(cli, trained, bed):
    ran = cli(
        "--json", "eval", "r-main", "--step", "8", "--on", "evalbox",
        "--max-new-tokens", "12", "--max-prompts", "2",
    )  # fmt: skip
    assert ran.code == 0, ran.err
    doc = json.loads(ran.out)
    assert set(doc) >= {"tau", "ddtree", "per_position", "histogram", "n_prompts", "max_new_tokens"}
    assert doc["n_prompts"] == 2 and doc["max_new_tokens"] == 12 and "8" in doc["ddtree"]
    assert "prompt 2/2" in ran.err  # the evaluator's progress, streamed
    kept = bed["evalbox"].host_path("/workspace/evals/r-main/step_8.json")
    assert json.loads(kept.read_text())["tau"] == doc["tau"]
    table = cli("eval", "r-main", "--step", "8", "--on", "evalbox", "--max-new-tokens", "8",
                "--max-prompts", "1")  # fmt: skip
    assert table.code == 0 and table.out.startswith("DRAFTER") and "r-main step_8" in table.out


@pytest.mark.slow
def test_eval_says_when_the_target_model_is_missing_there(cli, trained):
    ran = cli("eval", "r-main", "--step", "8", "--on", "evalbox", "--set", "target.path=/models/x")
    assert ran.code == 4
    assert "evalbox: not there: target.path (the target model) /models/x" in ran.err
    assert len(ran.err.strip().splitlines()) == 1


# ---------------------------------------------------------------- stop and resume


@pytest.mark.slow
def test_stop_saves_a_checkpoint_and_resume_continues(cli, config, bed):
    args = ["--config", str(config), "--set", "optim.max_steps=300", "--set", "log.log_every=1"]
    started = cli("launch", "r-stop", "--host", "train", *args)
    assert started.code == 0, started.err
    refused = cli("archive", "r-stop")
    assert refused.code == 2 and "stop it first" in refused.err
    stopped = cli("stop", "r-stop")
    assert stopped.code == 0, stopped.err
    first = status(cli, "r-stop")
    assert first["state"] == "stopped" and first["exit_code"] == 0
    assert f"newest checkpoint step_{first['step']}" in stopped.out
    ckpts = json.loads(cli("--json", "ckpts", "r-stop", "--verify").out)["checkpoints"]
    # periodic checkpoints may precede it, depending on how far the run got before the stop
    assert (ckpts[-1]["step"], ckpts[-1]["complete"], ckpts[-1]["verified"]) == (
        first["step"],
        True,
        True,
    )
    assert all(c["complete"] and c["verified"] for c in ckpts)
    resumed = cli("resume", "r-stop")
    assert resumed.code == 0, resumed.err
    assert f"resuming from step_{first['step']}" in resumed.err
    stopped = cli("--json", "stop", "r-stop")
    doc = json.loads(stopped.out)
    assert doc["state"] == "stopped" and doc["checkpoint"] > first["step"]
    log = bed["train"].host_path("/workspace/runs/r-stop/train_log.jsonl").read_text()
    steps = [json.loads(line)["step"] for line in log.splitlines()]
    assert steps == list(range(1, doc["checkpoint"] + 1))  # rewound to the checkpoint, then on

    # at another size: 2 processes from the newest checkpoint, the move recorded where it lived
    assert [h["world_size"] for h in status(cli, "r-stop")["history"]] == [1]
    resumed = cli("resume", "r-stop", "--nproc", "2")
    assert resumed.code == 0, resumed.err
    moved = doc["checkpoint"]
    log_file = bed["train"].host_path("/workspace/runs/r-stop/train_log.jsonl")
    wait_for(lambda: f'"resumed_at": {moved}' in log_file.read_text(), timeout=240, every=0.5)
    assert cli("stop", "r-stop").code == 0
    lived = status(cli, "r-stop")["history"]
    assert [(h["targets"], h["nproc"], h["from_step"]) for h in lived] == [
        (["train"], [1], 0), (["train"], [2], moved)]  # fmt: skip
    shown = cli("status", "r-stop")
    assert f"lived:       train x1 from step 0; train x2 from step {moved}" in shown.out, shown.out
    diffed = cli("diff", "r-stop", "--all")
    assert diffed.code == 0 and f"train x1 from step 0; train x2 from step {moved}" in diffed.out
    line = next(json.loads(x) for x in log_file.read_text().splitlines() if "resumed_at" in x)
    assert (line["from_world_size"], line["world_size"], line["grad_accum"]) == (1, 2, 1)


@pytest.mark.slow
def test_resume_onto_another_container_moves_the_run_and_it_finishes_there(cli, config, bed):
    args = ["--config", str(config), "--set", "optim.max_steps=40", "--set", "log.log_every=1"]
    assert cli("launch", "r-move", "--host", "train", *args).code == 0
    stopped = json.loads(cli("--json", "stop", "r-move").out)
    at = stopped["checkpoint"]
    assert stopped["state"] == "stopped" and at < 40, stopped
    old = bed["train"].host_path("/workspace/runs/r-move")
    assert cli("resume", "r-move", "--host", "nowhere").code == 4  # not in the inventory
    assert old.is_dir() and not bed["evalbox"].host_path("/workspace/runs/r-move").exists()
    spoilt = old / "checkpoints" / f"step_{at}" / "config.json"  # no longer its manifest's
    kept = spoilt.read_bytes()
    spoilt.write_bytes(kept + b" ")
    failed = cli("resume", "r-move", "--host", "evalbox")
    assert failed.code == 1 and "does not match its MANIFEST.sha256" in failed.err, failed.err
    assert status(cli, "r-move")["target"] == "train"  # where it was, whole; nothing left there
    assert not bed["evalbox"].host_path("/workspace/runs/r-move").exists()
    spoilt.write_bytes(kept)

    began = time.time()  # moved and at another size in one command: 1 process -> 2 there
    moved = cli("resume", "r-move", "--host", "evalbox", "--nproc", "2")
    assert moved.code == 0, moved.err
    said = re.search(r"moved to evalbox in ([0-9.]+) s \(([^)]*)\)", moved.err)
    assert said and "kept from an earlier try" in said.group(2), moved.err  # resumed, not resent
    assert not old.exists()  # set aside, hidden: the name is unique among targets
    assert [p.name.startswith(".moved-r-move-") for p in old.parent.iterdir()
            if "r-move" in p.name] == [True]  # fmt: skip
    new = bed["evalbox"].host_path("/workspace/runs/r-move")
    assert (new / "checkpoints" / f"step_{at}" / "MANIFEST.sha256").is_file()
    ended = wait_for(lambda: (s := status(cli, "r-move"))["state"] not in RUNNING and s,
                     timeout=400, every=2)  # fmt: skip
    assert ended["state"] == "finished", cli("logs", "r-move", "--tail", "40").out

    done = status(cli, "r-move")  # found by name, no --host
    assert (done["target"], done["step"]) == ("evalbox", 40)
    assert [(h["targets"], h["nproc"], h["from_step"]) for h in done["history"]] == [
        (["train"], [1], 0), (["evalbox"], [2], at)]  # fmt: skip
    shown = cli("status", "r-move")
    assert f"lived:       train x1 from step 0; evalbox x2 from step {at}" in shown.out, shown.out
    steps = [json.loads(x)["step"] for x in (new / "train_log.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 41))  # the train_log came along, rewound to step_{at}, then on
    first = next(json.loads(x) for x in (new / "train_log.jsonl").read_text().splitlines()
                 if json.loads(x)["step"] == at + 1)  # fmt: skip
    assert (first.get("resumed_at"), first.get("from_world_size"), first.get("world_size")) == (
        at, 1, 2)  # fmt: skip
    print(
        f"move: copy and start {said.group(1)} s ({said.group(2)}); first step there "
        f"{first['time'] - began:.1f} s after `resume --host`"
    )  # the report's numbers
    compared = cli("compare", "r-move")
    assert compared.code == 0 and "r-move" in compared.out, compared.err


# ---------------------------------------------------------------- dry run


@pytest.mark.slow
def test_dry_run_prints_host_argv_and_changes_nothing(cli, trained, bed, config):
    ran = cli("--dry-run", "launch", "r-dry", "--host", "train", "--config", str(config))
    assert ran.code == 0, ran.err
    assert "r-dry: config: valid" in ran.err
    tmux = next(line for line in ran.out.splitlines() if " new-session " in line)
    assert tmux.startswith(f"pve1: pct exec {TRAIN_VMID} -- /usr/bin/env -i PATH=")
    assert "tmux -L dflashops -f /dev/null new-session -d -s dflash-r-dry" in tmux
    assert "launcher.py /workspace/runs/r-dry" in tmux
    assert not bed["train"].host_path("/workspace/runs/r-dry").exists()
    pulled = cli("--dry-run", "pull-ckpt", "4", "--to", "evalbox", "--run", "r-kl")
    assert pulled.code == 0, pulled.err  # the run is found by reading the hosts: not done
    assert "dry run: run r-kl: found by reading the hosts" in pulled.err, pulled.err
    assert not bed["evalbox"].host_path("/workspace/ckpts/r-kl").exists()


def _hashes(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


# ---------------------------------------------------------------- a real LXC container


@pytest.mark.lxc
def test_launch_in_lxc_survives_the_connection_and_stops_cleanly(lxc_ct, testbed, home, tmp_path):
    inv = testbed.write_inventory(
        tmp_path / "hosts.yaml", {"lxc": lxc_ct}, extra_defaults={"python": "/root/stand-in"}
    )

    def cli(*args: str) -> Ran:
        return dflashops(*args, inventory=inv, home=home, timeout=120)

    stub = tmp_path / "stand-in"
    stub.write_text(STAND_IN_TRAINER)
    stub.chmod(0o755)
    assert cli("push", "lxc", str(stub), "/root/stand-in").code == 0
    cfg = tmp_path / "c.yaml"
    cfg.write_text("seed: 0\n")
    launched = cli("launch", "lxc-run", "--host", "lxc", "--config", str(cfg))
    assert launched.code == 0, launched.err
    first = json.loads(cli("--json", "status", "lxc-run").out)
    assert first["state"] == "running" and first["tmux"] == "dflash-lxc-run"
    again = json.loads(cli("--json", "status", "lxc-run").out)  # another connection later
    assert again["state"] == "running" and again["step"] > first["step"]
    stopped = cli("--json", "stop", "lxc-run")
    assert stopped.code == 0, stopped.err
    doc = json.loads(stopped.out)
    assert doc["state"] == "stopped" and doc["checkpoint"] == doc["step"]
    verified = json.loads(cli("--json", "ckpts", "lxc-run", "--verify").out)["checkpoints"]
    assert [(c["step"], c["verified"]) for c in verified] == [(doc["step"], True)]
    tail = cli("logs", "lxc-run", "--tail", "3")
    assert f"stopped at step {doc['step']} on request" in tail.out
