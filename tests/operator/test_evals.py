"""Eval jobs on the fake Proxmox bed: a tiny run trained in one container (`train`, CT 971 on
pve1), its checkpoints evaluated in another (`evalbox`, CT 972 on pve2) by `eval` as a detached
tmux job, listed by `evals`, tabled by `compare --tau` and drawn by `compare --plot`.

No published drafter can be had offline: the reference is the run's own step-2 checkpoint saved
by z-lab's own class (the `dflash` package's DFlashDraftModel), so it is in their format.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.operator.cli import Ran, dflashops
from tests.operator.tiny_target import ROOT, tiny_run_config

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

TRAIN_VMID, EVAL_VMID = 971, 972
RUN = "e-sweep"
SMALL = ["--max-new-tokens", "8", "--max-prompts", "2"]


@pytest.fixture(scope="module")
def bed(testbed):
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
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def cli(inv, home):
    def run(*args: str, timeout: float = 300) -> Ran:
        return dflashops(*args, inventory=inv, home=home, timeout=timeout)

    return run


@pytest.fixture(scope="module")
def trained(cli, tmp_path_factory) -> str:
    """e-sweep: 6 steps, complete checkpoints at 2, 4 and 6; the tiny target in both."""
    sections = {"optim": {"max_steps": 6, "batch_size": 4}, "log": {"log_every": 2},
                "checkpoint": {"every": 2, "keep_last": 3}}  # fmt: skip
    path = tiny_run_config(cli, tmp_path_factory.mktemp("cfg"), sections)
    launched = cli("launch", RUN, "--host", "train", "--config", str(path))
    assert launched.code == 0, launched.err
    followed = cli("status", RUN, "--follow", "--interval", "1")
    assert followed.code == 0, followed.err
    return RUN


def stored(cli, run: str = RUN) -> dict:
    ran = cli("--json", "evals", run)
    assert ran.code == 0, ran.err
    return json.loads(ran.out)


def png_height(path: Path) -> int:
    return struct.unpack(">II", path.read_bytes()[16:24])[1]


def test_a_sweep_stores_three_results_listed_tabled_and_drawn(cli, trained, bed, tmp_path):
    started = time.monotonic()
    ran = cli("eval", RUN, "--steps", "2,4,6", "--on", "evalbox", *SMALL, "--follow")
    seconds = time.monotonic() - started
    assert ran.code == 0, ran.err
    assert "eval job" in ran.err and "prompt 2/2" in ran.err  # the job's progress, followed
    assert "by simulation: no vLLM environment on evalbox" in ran.err  # --engine auto
    assert [line.split()[0] for line in ran.out.splitlines()[2:5]] == ["2", "4", "6"]
    for step in (2, 4, 6):
        kept = bed["evalbox"].host_path(f"/workspace/evals/{RUN}/step_{step}.json")
        assert json.loads(kept.read_text())["n_prompts"] == 2
    doc = stored(cli)
    assert [(r["run"], r["step"], r["target"]) for r in doc["evals"]] == [
        (RUN, 2, "evalbox"), (RUN, 4, "evalbox"), (RUN, 6, "evalbox"),
    ]  # fmt: skip
    assert all(r["tau"] >= 1 and "8" in r["ddtree"] for r in doc["evals"])
    inside = ", ".join(f"{r['timing']['total_s']:.1f}s" for r in doc["evals"])
    print(f"three-step sweep: {seconds:.1f}s in all; each step's evaluator: {inside}")
    listing = cli("evals")
    assert listing.code == 0, listing.err
    assert listing.out.startswith("prompts: prompts (sha256 ")  # one prompt set
    header = listing.out.splitlines()[1].split()
    assert header[:5] == ["RUN", "STEP", "TARGET", "PROMPTS", "TAU"] and "REF" in header
    rows = [line.split() for line in listing.out.splitlines() if line.startswith(RUN)]
    assert [r[1] for r in rows] == ["2", "4", "6"]

    tau = json.loads(cli("--json", "compare", RUN, "--tau").out)["tau"]
    assert tau["steps"] == [2, 4, 6]
    values = tau["runs"][0]["values"]["tau"]
    assert [values[s]["value"] for s in ("2", "4", "6")] == [r["tau"] for r in doc["evals"]]
    table = cli("compare", RUN, "--tau")
    assert table.code == 0 and "tau: from stored evaluations" in table.out

    with_tau, without = tmp_path / "with.png", tmp_path / "without.png"
    assert cli("compare", RUN, "--metrics", "loss", "--plot", str(with_tau)).code == 0
    bed["evalbox"].host_path(f"/workspace/evals/{RUN}").rename(
        bed["evalbox"].host_path("/workspace/evals-aside")
    )
    try:
        assert cli("compare", RUN, "--metrics", "loss", "--plot", str(without)).code == 0
    finally:
        bed["evalbox"].host_path("/workspace/evals-aside").rename(
            bed["evalbox"].host_path(f"/workspace/evals/{RUN}")
        )
    assert png_height(with_tau) > png_height(without)  # a second panel: tau against step


def test_the_tau_panel_draws_each_evaluated_step(tmp_path):
    from dflashops import plot
    from dflashops.runs.reading.view import RunView

    records = [{"step": s, "loss": 1.0 / s} for s in (2, 4, 6)]
    view = RunView(RUN, "evalbox", "runs", "/x", "finished", 0.0, {"log": {"records": records}})
    evals = [
        {"run": RUN, "step": s, "tau": 1 + s / 10, "ddtree": {"8": 2 + s / 10, "16": 3.0},
         "reference": {"tau": 1.5}, "mtime": 0}
        for s in (2, 4, 6)
    ]  # fmt: skip
    fig = plot.draw([view], ["loss"], [2, 4, 6], tmp_path / "p.png", evals=evals)
    panel = fig.axes[-1]
    assert panel.get_ylabel() == "tau (eval)"
    lines = {line.get_label(): list(line.get_ydata()) for line in panel.get_lines()}
    assert lines[f"{RUN} tau chain"] == [1.2, 1.4, 1.6]
    assert lines[f"{RUN} DDTree 16"] == [3.0, 3.0, 3.0]
    assert lines[f"{RUN} reference"] == [1.5, 1.5, 1.5]


def test_an_eval_job_survives_the_operator_going_away(cli, trained, inv, home, bed):
    for step in (2, 4):
        bed["evalbox"].host_path(f"/workspace/evals/{RUN}/step_{step}.json").unlink(missing_ok=True)
    argv = [sys.executable, "-m", "dflashops.cli", "--inventory", str(inv)]
    argv += ["eval", RUN, "--steps", "2,4", "--on", "evalbox", "--max-new-tokens", "10",
             "--max-prompts", "2", "--follow"]  # fmt: skip
    env = {**os.environ, "HOME": str(home)}
    env.pop("DFLASHOPS_INVENTORY", None)
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=env)  # fmt: skip
    try:
        for line in proc.stderr:  # the job started: the operator goes away at once
            if b"eval job" in line and b"started" in line:
                break
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    jobs = stored(cli)["jobs"]
    newest = max(jobs, key=lambda j: j["launched"])
    assert newest["alive"] and newest["steps"] == [2, 4]
    deadline = time.monotonic() + 300
    while stored(cli)["jobs"] and max(stored(cli)["jobs"], key=lambda j: j["launched"])["alive"]:
        assert time.monotonic() < deadline, "the eval job never ended"
        time.sleep(2)
    results = {r["step"]: r for r in stored(cli)["evals"]}
    assert results[2]["max_new_tokens"] == results[4]["max_new_tokens"] == 10
    job_dir = bed["evalbox"].host_path(newest["dir"])
    assert (job_dir / "exit_code").read_text().strip() == "0"
    again = cli("eval", RUN, "--follow", "--on", "evalbox")  # attach afterwards: its results
    assert again.code == 0, again.err
    assert [line.split()[0] for line in again.out.splitlines()[2:4]] == ["2", "4"]


SAVE_AS_ZLAB = """
import copy, sys
import dflash.model as zlab
from workload.drafter.model import DFlashDrafter
ours = DFlashDrafter.from_pretrained(sys.argv[1])
theirs = zlab.DFlashDraftModel(copy.deepcopy(ours.config))
theirs.load_state_dict(ours.state_dict())
theirs.save_pretrained(sys.argv[2])
"""


def test_a_reference_is_evaluated_beside_and_the_gap_shown(cli, trained, bed):
    pulled = cli("pull-ckpt", "2", "--to", "evalbox", "--run", RUN)
    assert pulled.code == 0, pulled.err
    reference = "/workspace/zlab-ref"
    step_2 = bed["evalbox"].host_path(f"/workspace/ckpts/{RUN}/step_2")
    where = bed["evalbox"].host_path(reference)
    saved = subprocess.run([sys.executable, "-c", SAVE_AS_ZLAB, str(step_2), str(where)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert saved.returncode == 0, saved.stderr
    assert not (where / "MANIFEST.sha256").exists()  # z-lab's drafters come without one
    ran = cli("eval", RUN, "--step", "6", "--on", "evalbox", "--reference", reference, *SMALL)
    assert ran.code == 0, ran.err
    rows = {line.split()[0]: line.split() for line in ran.out.splitlines() if line.strip()}
    assert {"reference", "gap"} <= set(rows)
    ours = json.loads(bed["evalbox"].host_path(f"/workspace/evals/{RUN}/step_6.json").read_text())
    ref = ours["reference"]
    assert ref["checkpoint"] == reference and ref["n_prompts"] == 2
    gap_row = rows["gap"]
    assert gap_row[4] == f"{ours['tau'] - ref['tau']:+.2f}"  # "gap (ours - ref)" then TAU
    listed = {r["step"]: r for r in stored(cli)["evals"]}
    assert listed[6]["reference"]["tau"] == ref["tau"]
    text = cli("evals", RUN).out
    row = next(line for line in text.splitlines() if line.split()[:2] == [RUN, "6"])
    assert f"({ours['tau'] - ref['tau']:+.2f})" in row


def test_a_real_loop_check_and_an_extra_budget_are_kept_and_shown(cli, trained, bed):
    ran = cli("eval", RUN, "--step", "4", "--on", "evalbox", "--check-real", "1",
              "--budgets", "3", *SMALL)  # fmt: skip
    assert ran.code == 0, ran.err
    kept = json.loads(bed["evalbox"].host_path(f"/workspace/evals/{RUN}/step_4.json").read_text())
    check = kept["check_real"]
    assert check["prompts"] == 1 and 3 in kept["budgets"] and "3" in check["ddtree"]
    assert kept["real_loop_rounds_checked"] == check["rounds_checked"] > 0
    assert "DDTREE 3" in ran.out.splitlines()[0]  # the extra budget's column
    rows = {line.split()[0]: line.split() for line in ran.out.splitlines() if line.strip()}
    chain, tree = rows["chain"], ran.out.split("DDTree 3", 1)[1].split()
    trees = check["ddtree"].values()
    chain_rounds = [check[k] - sum(t[k] for t in trees) for k in ("rounds_equal", "rounds_checked")]
    assert chain[1] == "{}/{}".format(*chain_rounds)
    assert chain[2:4] == [f"{check['real_tau']:.2f}", f"{check['simulated_tau']:.2f}"]
    assert chain[6] == ("-" if check["speedup"] is None else f"{check['speedup']:.2f}x")
    three = check["ddtree"]["3"]
    assert tree[0] == f"{three['rounds_equal']}/{three['rounds_checked']}"
    assert f"({check['rounds_equal']}/{check['rounds_checked']} in all)" in ran.out

    listed = {r["step"]: r for r in stored(cli)["evals"]}[4]
    assert listed["check_real"]["rounds_checked"] == listed["real_loop_rounds_checked"]
    assert "3" in listed["ddtree"] and "details" not in listed["check_real"]
    text = cli("evals", RUN).out
    assert "REAL ROUNDS" in text.splitlines()[1] and "DDTREE 3" in text.splitlines()[1]
    row = next(line for line in text.splitlines() if line.split()[:2] == [RUN, "4"])
    assert f"{check['rounds_equal']}/{check['rounds_checked']}" in row.split()


def test_bad_eval_requests_are_one_line(cli, trained):
    bad = cli("eval", RUN, "--steps", "2,x", "--on", "evalbox")
    assert bad.code == 2 and "--steps 2,x: expected comma-separated integers" in bad.err
    both = cli("eval", RUN, "--step", "2", "--steps", "4", "--on", "evalbox")
    assert both.code == 2 and len(both.err.strip().splitlines()) == 1
    missing = cli("eval", RUN, "--steps", "2,5", "--on", "evalbox", *SMALL)
    assert missing.code == 4 and "complete steps: 2, 4, 6" in missing.err
    budgets = cli("eval", RUN, "--step", "2", "--on", "evalbox", "--budgets", "0,8")
    assert budgets.code == 2 and budgets.err.strip().endswith("--budgets 0,8: budgets are >= 1")
    nojob = cli("eval", RUN, "--follow", "--on", "train")
    assert nojob.code == 4 and f"{RUN}: no eval job on train" in nojob.err
    assert "Traceback" not in bad.err + both.err + missing.err + budgets.err + nojob.err


def test_an_eval_whose_settings_differ_from_training_is_refused_unless_forced(cli, trained):
    """Train-to-serve parity before each step: one line per mismatch, naming both sides."""
    other = ("--set", "drafter.block_size=4")  # the run config against the checkpoint's 8
    ran = cli("eval", RUN, "--step", "4", "--on", "evalbox", *SMALL, *other)
    assert ran.code == 2, ran.err
    said = [x for x in ran.err.splitlines() if x.startswith("dflashops: error: ")]
    assert said[0].startswith("dflashops: error: evalbox: parity: block size: the drafter drafts 8")
    assert "the run config says 4" in said[0] and "Traceback" not in ran.err
    assert "evalbox: (--force evaluates anyway" in ran.err
    forced = cli("--json", "eval", RUN, "--step", "4", "--on", "evalbox", *SMALL, *other,
                 "--force")  # fmt: skip
    assert forced.code == 0, forced.err
    assert "block size" in json.loads(forced.out)["parity"]["mismatches"][0]


def test_a_failed_job_is_said_by_evals_and_by_follow(cli, trained):
    started = cli("eval", RUN, "--steps", "2,4", "--on", "evalbox", "--max-new-tokens", "0",
                  "--detach")  # fmt: skip
    assert started.code == 0, started.err
    assert f"follow it: dflashops eval {RUN} --follow --on evalbox" in started.out
    followed = cli("eval", RUN, "--follow", "--on", "evalbox")  # to its end
    assert followed.code == 2, followed.err
    assert followed.err.splitlines()[-1].startswith("dflashops: error: evalbox: --max-new-tokens")
    listing = cli("evals", RUN)
    assert listing.code == 0, listing.err
    assert "failed (exit 2): eval job" in listing.out and "console.log" in listing.out


def test_eval_with_vllm_serves_the_checkpoint_in_the_targets_engine(
    trained, bed, inv, home, tmp_path, vllm_python
):
    """The one engine start of the operator's tests (~1 min): the eval target's vLLM (the
    inventory's engines.vllm) serves step 6 as the tiny target's DFlash speculator."""
    doc = yaml.safe_load(inv.read_text())
    doc["targets"]["evalbox"]["engines"] = {"vllm": vllm_python}
    with_engine = tmp_path / "hosts.yaml"
    with_engine.write_text(yaml.safe_dump(doc, sort_keys=False))

    def cli(*args: str) -> Ran:
        return dflashops(*args, inventory=with_engine, home=home, timeout=900)

    if not bed["evalbox"].host_path(f"/workspace/evals/{RUN}/step_2.json").is_file():
        assert cli("eval", RUN, "--step", "2", "--on", "evalbox", *SMALL).code == 0  # simulated
    ran = cli("eval", RUN, "--step", "6", "--on", "evalbox", "--engine", "vllm", *SMALL)
    assert ran.code == 0, ran.err[-3000:]
    kept = json.loads(bed["evalbox"].host_path(f"/workspace/evals/{RUN}/step_6.json").read_text())
    assert kept["engine"]["name"] == "vllm" and kept["fingerprint"]["engine"]["name"] == "vllm"
    assert kept["n_prompts"] == 2 and kept["greedy"]["prompts"] == 2
    version = kept["engine"]["version"]
    assert f"vllm {version}: tau from its per-step accepted counts" in ran.out
    assert f"equals greedy on {kept['greedy']['equal']}/2" in ran.out
    listed = {r["step"]: r for r in json.loads(cli("--json", "evals", RUN).out)["evals"]}
    assert listed[6]["engine"]["name"] == "vllm" and listed[6]["tokens_per_s"]["spec"] > 0
    assert "engine" in listed[6]["settings"]["differs"]  # against step 2's, simulated
    row = next(line for line in cli("evals", RUN).out.splitlines()
               if line.split()[:2] == [RUN, "6"])  # fmt: skip
    assert f"vllm {version}" in row and "≠" in row
