"""Continuous evaluation on the fake Proxmox bed: a tiny run trained in one container (`train`,
CT 975 on pve1) and followed from another (`evalbox`, CT 976 on pve2), the two on a bridge with
static addresses (no DNS), as Proxmox CTs are. `launch --eval-on evalbox --eval-every 10` starts
the follower with the run; its checkpoints come over the checkpoint server of the training
container, each evaluated once with the sim engine.

One run, in order: the operator killed while the run trains, `evals` listing the follower; the
follower stopped, the run left to end and its checkpoint server to go (its linger shortened to
20 s by DFLASHOPS_CKPT_LINGER_S); the evaluation lock held by someone else, then the follower
resumed: it gets a new server, waits for the lock, then catches up without repeating a step; a
second `eval --every` of the ended run evaluates nothing.

Then `watch`'s W&B alert: a second run logs to W&B in offline mode (the hub cannot be reached
from here); the alert is asked of its trainer, which sends it once with `wandb.run.alert`. An
offline run keeps what it would send in its transaction log (run-ID.wandb), read back here
(tests/wandb_files.py): the alert record is there once, a resume of the run included. A run that
does not log to W&B gets no request; a stopped run's alert says its trainer is gone.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.operator.cli import Ran, dflashops, finished, start
from tests.operator.tiny_target import tiny_run_config
from tests.wandb_files import alerts

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

TRAIN_VMID, EVAL_VMID = 975, 976
RUN, WB_RUN = "c-follow", "c-wandb"
STEPS = (10, 20, 30, 40)
DELAY_S = "5"  # each checkpoint written 5 s late: the run trains while the follower works
WRONG_TOKEN = """
import sys, urllib.error, urllib.request
url = f"http://{sys.argv[1]}:{sys.argv[2]}/list"
request = urllib.request.Request(url, headers={"Authorization": "Bearer guess"})
try:
    print(urllib.request.urlopen(request, timeout=10).status)
except urllib.error.HTTPError as exc:
    print(exc.code)
"""
SMALL = ["--eval-max-new-tokens", "8", "--eval-max-prompts", "2"]
LINGER = {"DFLASHOPS_CKPT_LINGER_S": "20"}  # the server waits 20 s, not 10 min, once the run ends


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
def inv(testbed, bed, tmp_path_factory) -> Path:
    train, evalbox = bed["train"], bed["evalbox"]
    slow = {"DFLASHOPS_TEST_CHECKPOINT_DELAY_S": DELAY_S}
    targets = {
        "train": ("pve1", TRAIN_VMID, {"address": train.address, "env": slow}),
        "evalbox": ("pve2", EVAL_VMID, {"address": evalbox.address}),
    }
    where = tmp_path_factory.mktemp("inv")
    return testbed.write_inventory(
        where / "hosts.yaml", targets, extra_defaults={"python": sys.executable}
    )


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def cli(inv, home):
    def run(*args: str, timeout: float = 300) -> Ran:
        return dflashops(*args, inventory=inv, home=home, timeout=timeout, env=LINGER)

    return run


@pytest.fixture(scope="module")
def config(cli, tmp_path_factory) -> Path:
    """40 steps, a checkpoint every 10 (all four kept); the tiny target in both containers."""
    sections = {"data": {"max_length": 128}, "optim": {"max_steps": 40, "batch_size": 2},
                "log": {"log_every": 10}, "checkpoint": {"every": 10, "keep_last": 4}}  # fmt: skip
    return tiny_run_config(cli, tmp_path_factory.mktemp("cfg"), sections)


def follow_dirs(bed) -> list[Path]:
    return sorted(bed["evalbox"].host_path(f"/workspace/evals/{RUN}/follow").glob("*"))


def state_of(job: Path) -> dict:
    try:
        return json.loads((job / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def wait_for(what: str, check, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout:.0f} s: {what}")


def results(bed) -> dict[int, Path]:
    base = bed["evalbox"].host_path(f"/workspace/evals/{RUN}")
    return {int(p.stem.removeprefix("step_")): p for p in base.glob("step_*.json")}


def follows(cli) -> list[dict]:
    ran = cli("--json", "evals", RUN)
    assert ran.code == 0, ran.err
    return json.loads(ran.out)["follows"]


def landed(bed, step: int) -> float:
    """When checkpoint `step` became complete on the training target (its manifest written)."""
    path = f"/workspace/runs/{RUN}/checkpoints/step_{step}/MANIFEST.sha256"
    return bed["train"].host_path(path).stat().st_mtime


@pytest.fixture(scope="module")
def followed(cli, inv, home, config, bed) -> dict:
    """The run launched with its continuous eval (--follow), the operator killed once the
    follower runs and step 10 is scored, `evals` read; then, once step 20 is, the follower
    stopped, the run left to end and its checkpoint server to go."""
    proc = start("launch", RUN, "--host", "train", "--config", str(config), "--eval-on",
                 "evalbox", "--eval-every", "10", *SMALL, "--follow", inventory=inv, home=home,
                 env=LINGER)  # fmt: skip
    try:
        job = wait_for("the follower running", lambda: [
            j for j in follow_dirs(bed) if state_of(j).get("status") == "running"])[0]  # fmt: skip
        wait_for("step 10 scored", lambda: 10 in results(bed))
    finally:
        proc.send_signal(signal.SIGKILL)  # the operator gone, as a closed laptop
        finished(proc)
    (live,) = wait_for("the follower's state saying so",
                       lambda: [f for f in follows(cli) if f["last_scored"]], 30)  # fmt: skip
    text = cli("evals", RUN).out
    wait_for("step 20 scored", lambda: 20 in (state_of(job).get("done") or []))
    lag = {s: results(bed)[s].stat().st_mtime - landed(bed, s) for s in (10, 20)}
    print(json.dumps(state_of(job)))
    print((job / "console.log").read_text())
    name = f"follow-{RUN}-{job.name}"
    port = state_of(job)["server"]["port"]
    asked = cli("exec", "evalbox", "--", "python3", "-c", WRONG_TOKEN, bed["train"].address,
                str(port))  # fmt: skip
    stopped = cli("stop", name)
    assert stopped.code == 0, stopped.err
    wait_for("the follower stopped", lambda: state_of(job).get("status") == "stopped", 60)
    (held,) = follows(cli)
    server = bed["train"].host_path(f"/workspace/evals/{RUN}/serve/{job.name}")
    wait_for("the server told goodbye by its stopped follower",
             lambda: state_of(server).get("status") == "finished", 30)  # fmt: skip
    ran = cli("status", RUN, "--follow", "--interval", "1")
    assert ran.code == 0, ran.err
    wait_for("the checkpoint server gone", lambda: state_of(server).get("status") == "finished",
             80)  # fmt: skip
    return {"job": job, "name": name, "lag": lag, "before": sorted(results(bed)), "live": live,
            "text": text, "held": held, "asked": asked}  # fmt: skip


def test_killing_the_operator_changes_nothing_and_stop_keeps_what_was_scored(cli, followed, bed):
    job = followed["job"]
    state = state_of(job)
    assert 10 in state["done"] and state["done"] == sorted(state["done"])
    assert followed["before"] == state["done"]  # nothing scored while it was stopped
    inside = {s: json.loads(results(bed)[s].read_text())["timing"]["total_s"] for s in (10, 20)}
    asked = followed["asked"]
    assert asked.out.strip() == "403", asked.err  # the server answers no one without the token
    lag = ", ".join(f"step {s} {t:.1f} s (its evaluator {inside[s]:.1f} s of it)"
                    for s, t in followed["lag"].items())  # fmt: skip
    print(f"lag from a checkpoint landing to its result stored: {lag}")


def test_evals_lists_the_follower_with_its_state_and_steps(followed):
    live, held = followed["live"], followed["held"]
    assert (live["run"], live["target"], live["every"], live["state"]) == (RUN, "evalbox", 10,
                                                                          "running")  # fmt: skip
    assert live["last_scored"] >= 10 and live["next"] > live["last_scored"], live
    assert live["next"] % 10 == 0
    assert "continuous evals" in followed["text"]
    row = next(line for line in followed["text"].splitlines() if live["name"] in line)
    assert row.split()[3:5] == ["10", "running"], followed["text"]
    assert held["state"] == "stopped" and held["next"] is None
    assert held["last_scored"] == max(followed["before"]) and held["done"] == followed["before"]


def test_resumed_after_its_server_ended_it_waits_for_the_lock_then_catches_up_once_each(
    cli, followed, bed
):
    job = followed["job"]
    lock = bed["evalbox"].host_path("/workspace/evals/.evaluating")
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another evaluation holds this target
        resumed = cli("resume", followed["name"])
        assert resumed.code == 0, resumed.err
        assert f"the checkpoint server of {RUN} had ended; started again" in resumed.err
        log = job / "console.log"
        wait_for("the follower waiting for the lock", lambda: "waiting for it to end" in
                 log.read_text(), 60)  # fmt: skip
        time.sleep(2)
        assert sorted(results(bed)) == followed["before"]  # nothing evaluated meanwhile
    finally:
        os.close(fd)
    wait_for("the follower finished", lambda: state_of(job).get("status") == "finished", 240)
    state = state_of(job)
    assert state["done"] == list(STEPS) and sorted(results(bed)) == list(STEPS)
    text = log.read_text()
    for step in STEPS:
        assert text.count(f"step {step}: evaluated in") == 1, text
    doc = json.loads(cli("--json", "evals", RUN).out)
    assert [(r["step"], r["target"]) for r in doc["evals"]] == [(s, "evalbox") for s in STEPS]
    assert all(r["tau"] >= 1 for r in doc["evals"])
    shown = cli("status", RUN)
    assert shown.code == 0, shown.err
    assert f"at step 40 (on evalbox; 4 result(s): dflashops evals {RUN})" in shown.out
    job_status = cli("status", followed["name"])
    assert job_status.code == 0 and "10, 20, 30, 40" in job_status.out, job_status.out
    assert "step 40 " in job_status.out and "-> its result stored" in job_status.out
    print(job_status.out)
    plan = json.loads((job / "job.json").read_text())
    assert (
        plan["serve_id"].startswith(job.name + "-r") and state_of(job)["server"] == plan["server"]
    )
    serve = bed["train"].host_path(f"/workspace/evals/{RUN}/serve")
    first, again = serve / job.name, serve / plan["serve_id"]
    wait_for("the new server said bye", lambda: state_of(again).get("status") == "finished", 30)
    (ended,) = follows(cli)
    assert (ended["state"], ended["last_scored"], ended["next"]) == ("ended", 40, None)
    for box in ("evalbox", "train"):  # the token files deleted once the job is done
        secrets = bed[box].host_path("/workspace/dflashops/secrets")
        assert not list(secrets.glob(f"ckpt-{RUN}-*")), box
    for path in [*job.iterdir(), *first.iterdir(), *again.iterdir()]:  # never in a log or a file
        assert not re.search(r"\b[0-9a-f]{64}\b", path.read_text(errors="replace")), path


def test_a_second_follower_of_the_ended_run_evaluates_nothing(cli, followed, bed):
    stamps = {s: p.stat().st_mtime for s, p in results(bed).items()}
    ran = cli("eval", RUN, "--every", "10", "--on", "evalbox", "--max-new-tokens", "8")
    assert ran.code == 0, ran.err
    assert "continuous eval follow-" in ran.out
    again = [j for j in follow_dirs(bed) if j != followed["job"]]
    assert len(again) == 1
    wait_for("the second follower finished",
             lambda: state_of(again[0]).get("status") == "finished", 60)  # fmt: skip
    assert state_of(again[0]).get("done") in (None, [])
    assert {s: p.stat().st_mtime for s, p in results(bed).items()} == stamps


def test_bad_usage_is_one_line_and_a_dry_run_starts_nothing(cli, followed, bed):
    before = follow_dirs(bed)
    dry = cli("--dry-run", "eval", RUN, "--every", "10", "--on", "evalbox")
    assert dry.code == 0, dry.err  # the run is found by reading the hosts: not done
    assert f"dry run: run {RUN}: found by reading the hosts" in dry.err, dry.err
    assert follow_dirs(bed) == before
    both = cli("eval", RUN, "--every", "10", "--step", "10", "--on", "evalbox")
    assert both.code == 2 and "--every and --step" in both.err
    zero = cli("eval", RUN, "--every", "0", "--on", "evalbox")
    assert zero.code == 2 and "--every 0" in zero.err
    half = cli("launch", "c-other", "--host", "train", "--eval-every", "10")
    assert half.code == 2 and "go together" in half.err


# ---------------------------------------------------------------- watch's W&B alert


@pytest.fixture(scope="module")
def wandb_run(cli, bed, followed, tmp_path_factory) -> Path:
    """A long run logging to W&B offline (lr falls from step 1: no warmup), running."""
    sections = {"data": {"max_length": 128}, "optim": {"max_steps": 100000, "batch_size": 2,
                                                       "warmup_ratio": 0.0},
                "log": {"log_every": 2, "wandb": {"project": "dflashops-test", "mode": "offline"}},
                "checkpoint": {"every": 100000, "keep_last": 1}}  # fmt: skip
    config = tiny_run_config(cli, tmp_path_factory.mktemp("wbcfg"), sections, targets=("train",))
    ran = cli("launch", WB_RUN, "--host", "train", "--config", str(config))
    assert ran.code == 0, ran.err
    run_dir = bed["train"].host_path(f"/workspace/runs/{WB_RUN}")
    log = run_dir / "train_log.jsonl"
    wait_for("two log lines", lambda: log.exists() and len(log.read_text().splitlines()) >= 2, 240)
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


def test_a_run_without_wandb_gets_no_alert_request(cli, followed, bed):
    ran = cli("watch", RUN, "--metric", "lr", "--stall", "1", "--once")
    assert ran.code == 0, ran.err
    assert ran.out.startswith(f"alert: {RUN}: lr has not risen") and "W&B" not in ran.out
    assert not bed["train"].host_path(f"/workspace/runs/{RUN}/alerts").exists()
