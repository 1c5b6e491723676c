"""A continuous eval seen in `evals`, caught up after its run and its checkpoint server ended, and
`watch`'s W&B alert, on the fake Proxmox bed: a tiny run trained in one container (`train`, CT
981 on pve1) and followed from another (`evalbox`, CT 982 on pve2), on a bridge with static
addresses.

- The follower is listed by `evals` (running, its newest step scored, the step it waits for),
  stopped, the run left to end and its checkpoint server to go (its linger shortened to 20 s by
  DFLASHOPS_CKPT_LINGER_S); resumed, it gets a new server and scores each missing step once.
- A second run logs to W&B in offline mode (the hub cannot be reached from here): `watch`'s
  alert is asked of its trainer, which sends it once with `wandb.run.alert`. An offline run
  keeps what it would send in its transaction log (run-ID.wandb), read back here
  (wandb_files.py): the alert record is there once, a resume of the run included. A run that
  does not log to W&B gets no request; a stopped run's alert says its trainer is gone.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.operator.cli import Ran, dflashops
from tests.operator.tiny_target import tiny_run_config
from tests.wandb_files import alerts

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

TRAIN_VMID, EVAL_VMID = 981, 982
RUN, WB_RUN = "c-catchup", "c-wandb"
STEPS = (10, 20, 30, 40)
LINGER_S = "20"
SMALL = ["--eval-max-new-tokens", "8", "--eval-max-prompts", "2"]


@pytest.fixture(scope="module")
def bed(testbed):
    if testbed.mode != "netns":
        pytest.skip("container networks need the test bed's netns mode")
    train = testbed["pve1"].add_container(TRAIN_VMID, "ns", network=True)
    evalbox = testbed["pve2"].add_container(EVAL_VMID, "ns", network=True)
    try:
        yield {"train": train, "evalbox": evalbox}
    finally:
        testbed["pve1"].remove_container(TRAIN_VMID)
        testbed["pve2"].remove_container(EVAL_VMID)


@pytest.fixture(scope="module")
def cli(testbed, bed, tmp_path_factory):
    train, evalbox = bed["train"], bed["evalbox"]
    slow = {"DFLASHOPS_TEST_CHECKPOINT_DELAY_S": "5"}
    targets = {
        "train": ("pve1", TRAIN_VMID, {"address": train.address, "env": slow}),
        "evalbox": ("pve2", EVAL_VMID, {"address": evalbox.address}),
    }
    inv = testbed.write_inventory(tmp_path_factory.mktemp("inv") / "hosts.yaml", targets,
                                  extra_defaults={"python": sys.executable})  # fmt: skip
    home = tmp_path_factory.mktemp("home")

    def run(*args: str, timeout: float = 300) -> Ran:
        return dflashops(*args, inventory=inv, home=home, timeout=timeout,
                         env={"DFLASHOPS_CKPT_LINGER_S": LINGER_S})  # fmt: skip

    return run


def wait_for(what: str, check, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout:.0f} s: {what}")


def state_of(path: Path) -> dict:
    try:
        return json.loads((path / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def results(bed) -> list[int]:
    base = bed["evalbox"].host_path(f"/workspace/evals/{RUN}")
    return sorted(int(p.stem.removeprefix("step_")) for p in base.glob("step_*.json"))


def follows(cli) -> list[dict]:
    ran = cli("--json", "evals", RUN)
    assert ran.code == 0, ran.err
    return json.loads(ran.out)["follows"]


@pytest.fixture(scope="module")
def stopped(cli, bed, tmp_path_factory) -> dict:
    """The run launched with its follower; `evals` read while it follows, then the follower
    stopped once step 10 is scored, the run left to end and the checkpoint server to go."""
    sections = {"data": {"max_length": 128}, "optim": {"max_steps": 40, "batch_size": 2},
                "log": {"log_every": 10}, "checkpoint": {"every": 10, "keep_last": 4}}  # fmt: skip
    config = tiny_run_config(cli, tmp_path_factory.mktemp("cfg"), sections)
    ran = cli("launch", RUN, "--host", "train", "--config", str(config), "--eval-on", "evalbox",
              "--eval-every", "10", *SMALL)  # fmt: skip
    assert ran.code == 0, ran.err
    wait_for("step 10 scored", lambda: 10 in results(bed), 240)
    (live,) = wait_for("the follower's state saying so",
                       lambda: [f for f in follows(cli) if f["last_scored"]], 30)  # fmt: skip
    job = bed["evalbox"].host_path(f"/workspace/evals/{RUN}/follow/{live['name'][-20:]}")
    text = cli("evals", RUN).out
    assert cli("stop", live["name"]).code == 0
    wait_for("the follower stopped", lambda: state_of(job).get("status") == "stopped", 60)
    (held,) = follows(cli)
    scored = results(bed)
    assert cli("status", RUN, "--follow", "--interval", "1").code == 0
    server = bed["train"].host_path(f"/workspace/evals/{RUN}/serve/{job.name}")
    wait_for("the checkpoint server gone", lambda: state_of(server).get("status") == "finished",
             int(LINGER_S) + 60)  # fmt: skip
    return {"live": live, "text": text, "held": held, "job": job, "scored": scored}


def test_evals_lists_the_follower_with_its_state_and_steps(stopped):
    live, held = stopped["live"], stopped["held"]
    assert (live["run"], live["target"], live["every"], live["state"]) == (RUN, "evalbox", 10,
                                                                          "running")  # fmt: skip
    assert live["last_scored"] >= 10 and live["next"] > live["last_scored"], live
    assert live["next"] % 10 == 0
    assert "continuous evals" in stopped["text"]
    row = next(line for line in stopped["text"].splitlines() if live["name"] in line)
    assert row.split()[3:5] == ["10", "running"], stopped["text"]
    assert held["state"] == "stopped" and held["next"] is None
    assert held["last_scored"] == max(stopped["scored"]) and held["done"] == stopped["scored"]


def test_resumed_after_its_server_ended_it_scores_each_missing_step_once(cli, stopped, bed):
    job = stopped["job"]
    assert stopped["scored"] != list(STEPS)  # something left to catch up on
    resumed = cli("resume", stopped["live"]["name"])
    assert resumed.code == 0, resumed.err
    assert "the checkpoint server of c-catchup had ended; started again" in resumed.err
    wait_for("the follower finished", lambda: state_of(job).get("status") == "finished", 300)
    assert state_of(job)["done"] == list(STEPS) and results(bed) == list(STEPS)
    log = (job / "console.log").read_text()
    for step in STEPS:
        assert log.count(f"step {step}: evaluated in") == 1, log
    plan = json.loads((job / "job.json").read_text())
    assert plan["serve_id"].startswith(job.name + "-r")
    assert state_of(job)["server"] == plan["server"]
    again = bed["train"].host_path(f"/workspace/evals/{RUN}/serve/{plan['serve_id']}")
    wait_for("the new server said bye", lambda: state_of(again).get("status") == "finished", 30)
    (ended,) = follows(cli)
    assert (ended["state"], ended["last_scored"], ended["next"]) == ("ended", 40, None)


# ---------------------------------------------------------------- watch's W&B alert


@pytest.fixture(scope="module")
def wandb_run(cli, bed, stopped, tmp_path_factory) -> Path:
    """A long run logging to W&B offline (lr falls from step 1: no warmup), running."""
    sections = {"data": {"max_length": 128}, "optim": {"max_steps": 100000, "batch_size": 2,
                                                       "warmup_ratio": 0.0},
                "log": {"log_every": 2, "wandb": {"project": "dflashops-test", "mode": "offline"}},
                "checkpoint": {"every": 100000, "keep_last": 1}}  # fmt: skip
    config = tiny_run_config(cli, tmp_path_factory.mktemp("wbcfg"), sections, targets=("train",))
    ran = cli("launch", WB_RUN, "--host", "train", "--config", str(config))
    assert ran.code == 0, ran.err
    run_dir = bed["train"].host_path(f"/workspace/runs/{WB_RUN}")
    wait_for("two log lines", lambda: len((run_dir / "train_log.jsonl").read_text().splitlines())
             >= 2 if (run_dir / "train_log.jsonl").exists() else False, 240)  # fmt: skip
    return run_dir


def test_watch_asks_the_trainer_and_the_alert_is_sent_to_wandb_once(cli, wandb_run):
    ran = cli("--json", "watch", WB_RUN, "--metric", "lr", "--stall", "1", "--once")
    assert ran.code == 0, ran.err
    (alert,) = json.loads(ran.out)["alerts"]
    assert alert["rule"] == "stall" and alert["wandb"].startswith("W&B alert: asked of the trainer")
    sent = wait_for("the request sent", lambda: list((wandb_run / "alerts").glob("*.sent")), 120)
    assert not list((wandb_run / "alerts").glob("*.json"))
    title = f"stall lr step {alert['step']}: {WB_RUN}"
    assert json.loads(sent[0].read_text())["title"] == title
    assert cli("stop", WB_RUN).code == 0
    assert cli("status", WB_RUN, "--follow", "--interval", "1").code == 0
    (found,) = [a for a in alerts(wandb_run) if a["title"] == title]
    assert found["level"] == "WARN" and alert["message"] in found["text"]
    assert f"wandb: alert sent: {title}" in (wandb_run / "console.log").read_text()

    resumed = cli("resume", WB_RUN)
    assert resumed.code == 0, resumed.err
    log = wandb_run / "train_log.jsonl"
    steps = len(log.read_text().splitlines())
    wait_for("the resumed run logging", lambda: len(log.read_text().splitlines()) > steps, 240)
    assert cli("stop", WB_RUN).code == 0
    assert cli("status", WB_RUN, "--follow", "--interval", "1").code == 0
    assert len(list(wandb_run.glob("wandb/offline-run-*"))) == 2  # the resume logged on
    assert [a["title"] for a in alerts(wandb_run)].count(title) == 1  # never sent again

    gone = cli("watch", WB_RUN, "--metric", "lr", "--stall", "1", "--once")
    assert gone.code == 0, gone.err
    assert f"no W&B alert: {WB_RUN} is stopped (its trainer is gone" in gone.out
    assert len(list((wandb_run / "alerts").iterdir())) == 1  # no request for it


def test_a_run_without_wandb_gets_no_alert_request(cli, stopped, bed):
    ran = cli("watch", RUN, "--metric", "lr", "--stall", "1", "--once")
    assert ran.code == 0, ran.err
    assert ran.out.startswith(f"alert: {RUN}: lr has not risen") and "W&B" not in ran.out
    assert not bed["train"].host_path(f"/workspace/runs/{RUN}/alerts").exists()
