"""`launch --host any`, queued launches and sweeps on the fake Proxmox bed: two free containers on two hosts, a
stopped one and one on a host that cannot be reached, with the stand-in trainer
(tests/operator/rundirs.py) in place of a real training: where a run goes is the point here,
not what it trains."""

from __future__ import annotations

import json
import time

import pytest

from tests.operator.cli import dflashops, finished, start
from tests.operator.rundirs import STAND_IN_TRAINER

pytestmark = [pytest.mark.testbed]

A_VMID, B_VMID, C_VMID, GHOST_VMID = 981, 982, 983, 984
STAND_IN = "/root/stand-in"
SMALL = "/root/small"  # where it exists, the stand-in's memory plan does not fit (16 MiB GPUs)
PLANNED = '"gpu_memory": None, "fits": None, "notes": []'
assert PLANNED in STAND_IN_TRAINER
TRAINER = STAND_IN_TRAINER.replace(
    PLANNED,
    '"gpu_memory": 16 << 20 if os.path.exists("/root/small") else None, '
    '"fits": False if os.path.exists("/root/small") else None, "notes": []',
)


@pytest.fixture(scope="module")
def bed(testbed):
    """a (pve1), b (pve2): up, with the stand-in trainer; c (pve1): stopped."""
    cts = {
        "a": testbed["pve1"].add_container(A_VMID, "ns"),
        "b": testbed["pve2"].add_container(B_VMID, "ns"),
        "c": testbed["pve1"].add_container(C_VMID, "ns"),
    }
    try:
        for ct in cts.values():
            ct.run(["sh", "-c", f"cat > {STAND_IN} && chmod +x {STAND_IN}"],
                   input=TRAINER.encode())  # fmt: skip
        cts["c"].stop()
        yield cts
    finally:
        testbed["pve1"].remove_container(A_VMID)
        testbed["pve2"].remove_container(B_VMID)
        testbed["pve1"].remove_container(C_VMID)


@pytest.fixture(scope="module")
def cli(testbed, bed, tmp_path_factory):
    where = tmp_path_factory.mktemp("anywhere")
    inv = testbed.write_inventory(
        where / "hosts.yaml",
        {
            "c": ("pve1", C_VMID),
            "a": ("pve1", A_VMID),
            "b": ("pve2", B_VMID),
            "g": ("ghost", GHOST_VMID),
            "e": ("pve2", B_VMID, {"role": "eval", "workspace": "/srv/evals"}),  # never chosen
        },
        extra_defaults={"python": STAND_IN},
        extra_hosts={"ghost": {"address": testbed.unused_address(), "connect_timeout": 3}},
    )
    home = where / "home"
    home.mkdir()
    config = where / "c.yaml"
    config.write_text("seed: 0\n")

    def run(*args: str, timeout: float = 120, env: dict[str, str] | None = None):
        return dflashops(*args, inventory=inv, home=home, timeout=timeout, env=env)

    run.inventory, run.home, run.config = inv, home, str(config)
    return run


def where_runs(cli, run: str) -> str:
    ran = cli("--json", "status", run)
    assert ran.code == 0, ran.err
    return json.loads(ran.out)["target"]


def stop(cli, *runs: str) -> None:
    for run in runs:
        assert cli("stop", run).code == 0, run


def test_any_takes_the_free_container_and_says_why_it_passed_the_others(cli, bed):
    busy = cli("launch", "busy", "--host", "a", "--config", cli.config)
    assert busy.code == 0, busy.err
    chosen = cli("-v", "launch", "free", "--host", "any", "--config", cli.config)
    assert chosen.code == 0, chosen.err
    assert "free: --host any:train: chose b" in chosen.err, chosen.err
    assert "passed over a: busy: run busy (running" in chosen.err, chosen.err
    assert "passed over c: stopped" in chosen.err, chosen.err
    assert "passed over g: unreachable (" in chosen.err, chosen.err
    assert "passed over e" not in chosen.err  # role eval: not a candidate
    assert where_runs(cli, "free") == "b"
    # Both up containers busy: nothing is made, and each reason is said without -v.
    full = cli("launch", "more", "--host", "any", "--config", cli.config)
    assert full.code == 2, full.err
    assert "no target of role train is free" in full.err
    assert "passed over b: busy: run free (running" in full.err, full.err
    assert not bed["a"].host_path("/workspace/runs/more").exists()
    assert not bed["b"].host_path("/workspace/runs/more").exists()
    stop(cli, "busy", "free")


def test_two_launches_at_once_onto_one_free_container_never_share_it(cli, bed):
    hold = cli("launch", "hold", "--host", "b", "--config", cli.config)
    assert hold.code == 0, hold.err
    procs = {run: start("launch", run, "--host", "any", "--config", cli.config,
                        inventory=cli.inventory, home=cli.home) for run in ("race1", "race2")}  # fmt: skip
    done = {run: finished(proc) for run, proc in procs.items()}
    won = [run for run, (code, _, _) in done.items() if code == 0]
    assert len(won) == 1, done
    lost = next(run for run in done if run not in won)
    code, _, err = done[lost]
    assert code == 2 and "passed over a: " in err, err
    assert not bed["a"].host_path(f"/workspace/runs/{lost}").exists()
    stop(cli, "hold", won[0])


def test_a_sweep_over_two_free_containers_runs_both_and_is_read_by_its_name(cli, bed):
    ran = cli("launch", "sw", "--host", "any", "--config", cli.config, "--sweep", "seed=1,2")
    assert ran.code == 0, ran.err
    assert {where_runs(cli, "sw-seed1"), where_runs(cli, "sw-seed2")} == {"a", "b"}
    listed = cli("--json", "status", "sw")
    assert listed.code == 0, listed.err
    assert sorted(r["run"] for r in json.loads(listed.out)["runs"]) == ["sw-seed1", "sw-seed2"]
    time.sleep(1)  # a few steps logged
    compared = cli("--json", "compare", "sw", "--metrics", "loss")
    assert compared.code == 0, compared.err
    assert [r["run"] for r in json.loads(compared.out)["runs"]] == ["sw-seed1", "sw-seed2"]
    diffed = cli("--json", "diff", "sw")
    assert diffed.code == 0, diffed.err
    rows = json.loads(diffed.out)["rows"]
    assert rows[0]["key"] == "seed" and rows[0]["values"] == {"sw-seed1": 1, "sw-seed2": 2}
    home = where_runs(cli, "sw-seed1")
    state = json.loads(bed[home].host_path("/workspace/runs/sw-seed1/state.json").read_text())
    assert state["sweep"] == {"name": "sw", "keys": ["seed"], "values": {"seed": "1"}}
    # One container freed, a sweep of two: the one that can start starts, the other is said
    # with its reason, and the exit code (1) says that not all started.
    stop(cli, "sw-seed2")
    part = cli("launch", "sx", "--host", "any", "--config", cli.config, "--sweep", "seed=3,4")
    assert part.code == 1, part.err
    assert "sx-seed3: running on" in part.out, part.out
    assert "sx: 1 of 2 run(s) started; not started: sx-seed4" in part.err, part.err
    assert "sx-seed4: no target of role train is free" in part.err, part.err
    stop(cli, "sw-seed1", "sx-seed3")


def test_a_container_whose_plan_does_not_fit_is_passed_over_with_the_numbers(cli, bed):
    bed["a"].run(["touch", SMALL])
    try:
        ran = cli("launch", "fits", "--host", "any", "--config", cli.config)
    finally:
        bed["a"].run(["rm", "-f", SMALL])
    assert ran.code == 0, ran.err
    assert "fits: --host any:train: chose b" in ran.err, ran.err
    assert "passed over a" not in ran.err  # said with -v only, when one was chosen
    assert where_runs(cli, "fits") == "b"
    assert not bed["a"].host_path("/workspace/runs/fits").exists()  # taken back there
    stop(cli, "fits")
    bed["a"].run(["touch", SMALL])
    bed["b"].run(["touch", SMALL])
    try:
        none = cli("launch", "fits2", "--host", "any", "--config", cli.config)
    finally:
        bed["a"].run(["rm", "-f", SMALL])
        bed["b"].run(["rm", "-f", SMALL])
    assert none.code == 2, none.err
    assert "passed over a: plan needs 1.0 MiB per rank of 16.0 MiB" in none.err, none.err


def test_sweep_and_any_refuse_bad_input_in_one_line(cli):
    cases = {
        ("--sweep", "optim.lr"): "--sweep optim.lr: expected KEY=A,B[,...]",
        ("--sweep", "seed=1,1"): "--sweep seed=1,1: a value is given twice",
        ("--sweep", "tag=a/b,a+b"): "two runs of sweep 'sw2' would get one name",
        ("--host", "any:serve"): "--host any:serve: 'serve' is not a role",
        ("--host", "any", "--force"): "--host any takes free targets only",
    }
    for args, said in cases.items():
        host = [] if "--host" in args else ["--host", "any"]
        ran = cli("launch", "sw2", *host, "--config", cli.config, *args)
        assert ran.code == 2 and said in ran.err, (args, ran.err)
        assert len(ran.err.strip().splitlines()) == 1, ran.err


def state_of(cli, run: str) -> dict:
    ran = cli("--json", "status", run)
    assert ran.code == 0, ran.err
    return json.loads(ran.out)


def until_state(cli, run: str, state: str, timeout: float = 40) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        found = state_of(cli, run)
        if found["state"] == state or time.monotonic() > deadline:
            return found
        time.sleep(1)


def session_there(ct, run: str) -> bool:
    return ct.run(["tmux", "-L", "dflashops", "has-session", "-t", f"=dflash-{run}"],
                  check=False).returncode == 0  # fmt: skip


def test_queue_waits_for_a_busy_container_and_starts_the_run_when_it_frees(cli, bed):
    for run, host in (("qh1", "a"), ("qh2", "b")):
        assert cli("launch", run, "--host", host, "--config", cli.config).code == 0
    began = time.monotonic()
    queued = cli("-v", "launch", "qw", "--host", "any", "--queue", "--config", cli.config)
    assert queued.code == 0, queued.err
    assert time.monotonic() - began < 30  # returns without waiting for a target to free
    assert "qw: queued on " in queued.out, queued.out
    assert "passed over c: stopped" in queued.err and "passed over g: unreachable" in queued.err
    found = state_of(cli, "qw")
    home = found["target"]
    holder = {"a": "qh1", "b": "qh2"}[home]
    assert found["state"] == "queued", found
    assert f"run {holder} (running" in found["note"], found
    listed = cli("status", "--all")
    assert "qw" in listed.out and "queued" in listed.out, listed.out
    # A plain launch cannot jump the queue, nor a second launch of the name.
    again = cli("launch", "qw", "--host", "any", "--queue", "--config", cli.config)
    assert again.code == 2 and "run name 'qw' is taken" in again.err, again.err
    stop(cli, holder)
    started = until_state(cli, "qw", "running")
    assert started["state"] == "running" and started["target"] == home, started
    assert "the target is free: the run starts" in cli("logs", "qw").out
    stop(cli, "qw", {"a": "qh2", "b": "qh1"}[home])


def test_stop_of_a_queued_launch_leaves_nothing_behind(cli, bed):
    assert cli("launch", "qs-hold", "--host", "a", "--config", cli.config).code == 0
    ran = cli("launch", "qs", "--host", "a", "--queue", "--secret", "QS_TOKEN",
              "--config", cli.config, env={"QS_TOKEN": "s3cret"})  # fmt: skip
    assert ran.code == 0, ran.err
    secrets = bed["a"].host_path("/workspace/dflashops/secrets")
    assert [p for p in secrets.iterdir() if p.name.startswith("qs-")], "its secrets wait there"
    assert session_there(bed["a"], "qs")
    for verb in ("resume", "archive"):  # neither takes a launch that never started
        refused = cli(verb, "qs")
        assert refused.code == 2 and "qs is a launch queued on a" in refused.err, refused.err
    cancelled = cli("stop", "qs")
    assert cancelled.code == 0, cancelled.err
    assert "qs: queued launch cancelled; nothing of it is left on a" in cancelled.out
    assert not bed["a"].host_path("/workspace/runs/qs").exists()
    assert not [p for p in secrets.iterdir() if p.name.startswith("qs-")]
    assert not session_there(bed["a"], "qs")
    assert "no run 'qs' on the targets read" in cli("status", "qs").err
    # Its holder ends: nothing starts in its place.
    stop(cli, "qs-hold")
    time.sleep(3)
    assert not bed["a"].host_path("/workspace/runs/qs").exists()


def test_two_queued_launches_and_a_plain_one_race_for_a_freed_container(cli, bed):
    for run, host in (("qr-a", "a"), ("qr-b", "b")):
        assert cli("launch", run, "--host", host, "--config", cli.config).code == 0
    for run in ("qr1", "qr2"):
        ran = cli("launch", run, "--host", "a", "--queue", "--config", cli.config)
        assert ran.code == 0, ran.err
    second = state_of(cli, "qr2")
    assert second["state"] == "queued" and "qr1" in second["note"], second
    stop(cli, "qr-a")
    plain = start("launch", "qr-x", "--host", "any", "--config", cli.config,
                  inventory=cli.inventory, home=cli.home)  # fmt: skip
    code, _, err = finished(plain)
    assert code == 2, err
    assert "passed over a: busy: " in err and "qr1" in err, err
    first = until_state(cli, "qr1", "running")
    assert first["state"] == "running" and first["target"] == "a", first
    waiting = until_state(cli, "qr2", "queued")
    assert waiting["state"] == "queued" and "run qr1 (running) holds it" in waiting["note"], waiting
    assert not bed["a"].host_path("/workspace/runs/qr-x").exists()
    # Queued launches start in the order they were made.
    stop(cli, "qr1")
    assert until_state(cli, "qr2", "running")["state"] == "running"
    stop(cli, "qr2", "qr-b")


def test_queue_refuses_what_it_cannot_wait_for_in_one_line(cli):
    cases = {
        ("--host", "a,b", "--queue"): "--queue waits for one target: --host a,b names 2",
        ("--host", "a", "--queue", "--force"): "--queue waits for a free target, --force",
        ("--host", "a", "--queue", "--eval-on", "e", "--eval-every", "5"): "--queue: --eval-on",
    }
    for args, said in cases.items():
        ran = cli("launch", "qbad", "--config", cli.config, *args)
        assert ran.code == 2 and said in ran.err, (args, ran.err)
        assert len(ran.err.strip().splitlines()) == 1, ran.err


def test_a_queued_sweep_spreads_over_the_busy_containers(cli, bed):
    for run, host in (("qsw-a", "a"), ("qsw-b", "b")):
        assert cli("launch", run, "--host", host, "--config", cli.config).code == 0
    ran = cli("launch", "qsw", "--host", "any", "--queue", "--config", cli.config,
              "--sweep", "seed=5,6")  # fmt: skip
    assert ran.code == 0, ran.err
    runs = {run: state_of(cli, run) for run in ("qsw-seed5", "qsw-seed6")}
    assert {r["state"] for r in runs.values()} == {"queued"}, runs
    assert {r["target"] for r in runs.values()} == {"a", "b"}, runs  # the fewest queued first
    listed = cli("--json", "status", "qsw")
    assert sorted(r["run"] for r in json.loads(listed.out)["runs"]) == ["qsw-seed5", "qsw-seed6"]
    stop(cli, "qsw-seed5", "qsw-seed6", "qsw-a", "qsw-b")
    for ct in ("a", "b"):
        assert not [p for p in bed[ct].host_path("/workspace/runs").iterdir()
                    if p.name.startswith("qsw-seed")]  # fmt: skip


def test_named_queued_launches_at_once_and_a_resume_keep_to_the_queue(cli, bed):
    # Two `--host a --queue` at once onto a free a: one takes it, the other queues behind it.
    procs = {run: start("launch", run, "--host", "a", "--queue", "--config", cli.config,
                        inventory=cli.inventory, home=cli.home) for run in ("qn1", "qn2")}  # fmt: skip
    done = {run: finished(proc) for run, proc in procs.items()}
    assert all(code == 0 for code, _, _ in done.values()), done
    states = {run: until_state(cli, run, "running", timeout=10)["state"] for run in done}
    assert sorted(states.values()) == ["queued", "running"], states
    ran = next(run for run, state in states.items() if state == "running")
    waits = next(run for run in states if run != ran)
    # Stopped, then resumed at once: the queued launch went first, so the resume is refused.
    stop(cli, ran)
    again = cli("resume", ran)
    assert again.code == 2, again.err
    assert f"a is busy: run {waits} " in again.err, again.err
    assert until_state(cli, waits, "running")["target"] == "a"
    stop(cli, waits)
