"""The trainer over several processes (gloo on CPU, the tiny dense target): ZeRO-1 against a
replicated optimizer, sharded checkpoints and resume (on shared storage and on node-local
disks, at another world size), checkpoints written in the background, every rank's own files,
stopping through rank 0 alone, and a peer that dies."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.workload.test_distributed import free_port
from tests.workload.test_train import (
    SMALL,
    TEMPLATE,
    build_settings,
    config,
    read_log,
    read_state,
)
from workload.common import rank_files
from workload.drafter import checkpoint as ckpt
from workload.train import loop as T
from workload.train import save_restore

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node")
LOGGED = ("loss", "acc", "streak", "dds8", "grad_norm", "lr", "epoch", "noise")


def trainer_cmd(
    build: Path, run_dir: Path, *args: str, nproc: int | None = 2, launcher: list[str] | None = None
) -> list[str]:
    sets = [a for item in (*build_settings(build), *SMALL) for a in ("--set", item)]
    if launcher is None:
        launcher = [*TORCHRUN, str(nproc)] if nproc else [sys.executable]
    return [*launcher, "-m", "workload.train", "--config", str(TEMPLATE), "--run-dir",
            str(run_dir), *sets, *args]  # fmt: skip


def trainer_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
            **extra}  # fmt: skip


def train_cli(build: Path, run_dir: Path, *args: str, nproc: int | None = 2, env=None):
    done = subprocess.run(trainer_cmd(build, run_dir, *args, nproc=nproc), capture_output=True,
                          text=True, env=trainer_env(**(env or {})), cwd=REPO, timeout=600)  # fmt: skip
    return done


def train_on_nodes(build: Path, run_dirs: list[Path], *args: str) -> list[str]:
    """One torchrun per node (a static rendezvous on loopback, one rank each), each with its
    own run directory, as on node-local disks: rank K runs in run_dirs[K], which the operator
    made beforehand. Returns each node's console (rank 0's is the first)."""
    port, procs = free_port(), []
    for node, run_dir in enumerate(run_dirs):
        run_dir.mkdir(parents=True, exist_ok=True)
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(run_dirs)),
                    "--node_rank", str(node), "--nproc_per_node", "1", "--master_addr",
                    "127.0.0.1", "--master_port", str(port)]  # fmt: skip
        cmd = trainer_cmd(build, run_dir, *args, launcher=launcher)
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=trainer_env(), cwd=REPO))  # fmt: skip
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, run_dir, out in zip(procs, run_dirs, outs, strict=True):
        assert p.returncode == 0, f"{run_dir}: exit {p.returncode}\n{out}"
    return outs


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt.step_dir(run_dir, step) / "model.safetensors"))


def largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def assert_same_log(a: list[dict], b: list[dict], rel: float) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        for key in LOGGED:
            assert ra[key] == pytest.approx(rb[key], rel=rel, abs=rel), (ra["step"], key)


def wait_for(predicate, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before: {proc.stdout.read()}")
        assert time.time() < deadline, "timed out"
        time.sleep(0.2)


def heartbeat(run_dir: Path, rank: int) -> dict:
    try:
        return json.loads(rank_files.heartbeat_path(run_dir, rank).read_text())
    except (OSError, ValueError):
        return {}


# ---------------------------------------------------------------- ZeRO-1 and sharded checkpoints


STEPS = "optim.max_steps=6"


@pytest.fixture(scope="module")
def straight_runs(tiny_dense, tmp_path_factory) -> dict[str, Path]:
    """2 ranks on one node, 6 steps straight, under zero1 and under none: {sharding: run dir}."""
    runs = {}
    for sharding in ("zero1", "none"):
        runs[sharding] = tmp_path_factory.mktemp("straight") / sharding
        done = train_cli(tiny_dense, runs[sharding], "--set", STEPS, "--set",
                         f"dist.sharding={sharding}")  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
    return runs


@pytest.mark.slow
def test_zero1_equals_none_and_sharded_checkpoints_resume_exactly(
    tiny_dense, straight_runs, tmp_path
):
    """2 ranks: zero1 logs and weights equal a replicated optimizer's; zero1 stopped at step 3
    and resumed (under zero1, and under none) equals the straight zero1 run; a checkpoint
    holds one optimizer file per rank, in its manifest."""
    zero, plain, split = straight_runs["zero1"], straight_runs["none"], tmp_path / "split"
    done = train_cli(tiny_dense, split, "--set", STEPS, "--set", "dist.sharding=zero1",
                     "--stop-after", "3")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert_same_log(read_log(zero), read_log(plain), rel=1e-5)
    assert largest_difference(weights(zero, 6), weights(plain, 6)) <= 1e-5

    step3 = ckpt.step_dir(split, 3)
    state = save_restore.load_training_state(step3)
    assert (state["sharding"], state["world_size"]) == ("zero1", 2) and "optimizer" not in state
    assert state["optimizer_shards"] == ["optimizer/rank_0.pt", "optimizer/rank_1.pt"]
    listed = {line.split("  ")[1] for line in (step3 / ckpt.MANIFEST).read_text().splitlines()}
    assert {"optimizer/rank_0.pt", "optimizer/rank_1.pt", "model.safetensors", "config.json",
            "dflash.py", "training_state.pt"} == listed  # fmt: skip
    shards = [torch.load(step3 / f, weights_only=False) for f in state["optimizer_shards"]]
    held = [set(s["state"]) for s in shards]
    assert held[0] and held[1] and not held[0] & held[1]  # each rank its own parameters

    other = tmp_path / "other"  # the same checkpoint, resumed under the other sharding
    shutil.copytree(split, other)
    for run_dir, sharding in ((split, "zero1"), (other, "none")):
        done = train_cli(tiny_dense, run_dir, "--set", STEPS, "--set",
                         f"dist.sharding={sharding}", "--resume")  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        assert_same_log(read_log(zero), read_log(run_dir), rel=1e-6)
        assert largest_difference(weights(zero, 6), weights(run_dir, 6)) == 0.0, sharding
    assert "loaded into none" in done.stdout


# Resumed at another world size, a run takes the same rows a step in the same order (the data
# position is global and grad_accum keeps the global batch), so it differs from the straight
# run only by each rank's random streams: the anchors drawn and the noise. The tolerance is what
# that costs: the straight 2-rank run against the same run on 1 rank at grad_accum 2 (the same
# batches, other draws), measured at 0.0236 (relative, worst logged step) on the tiny target;
# the resumed runs must stay within twice that.
DRAW_TOLERANCE = 0.05


@pytest.mark.slow
def test_a_run_resumed_at_another_world_size_keeps_its_batch_and_data(
    tiny_dense, straight_runs, tmp_path
):
    """2 ranks stopped at step 3 and resumed on 1 (grad_accum 1 -> 2), and 1 rank at grad_accum
    2 stopped at step 3 and resumed on 2 (2 -> 1): each finishes with the straight 2-rank run's
    data position at every logged step (no row repeated or skipped) and its loss within the
    random draws' tolerance; the first log line after the move records it; the 2-rank
    checkpoint's optimizer states are read by the 1 rank whole (zero1 into none)."""
    straight = read_log(straight_runs["zero1"])
    cases = {"2-to-1": (2, None, []), "1-to-2": (None, 2, ["--set", "optim.grad_accum=2"])}
    for case, (first, then, extra) in cases.items():
        run_dir = tmp_path / case
        done = train_cli(tiny_dense, run_dir, "--set", STEPS, "--set", "dist.sharding=zero1",
                         *extra, "--stop-after", "3", nproc=first)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        done = train_cli(tiny_dense, run_dir, "--set", STEPS, "--set", "dist.sharding=zero1",
                         *extra, "--resume", nproc=then)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        ranks = (first or 1, then or 1)
        accum = (1, 2) if first else (2, 1)
        assert (f"resume: step_3 was written by {ranks[0]} rank(s), this run has {ranks[1]}: "
                f"optim.grad_accum {accum[0]} -> {accum[1]} keeps the global batch of 4 rows "
                "a step") in done.stdout  # fmt: skip
        log = read_log(run_dir)
        assert [r["step"] for r in log] == [r["step"] for r in straight]
        after = [r for r in log if r["step"] > 3]
        assert {k: after[0][k] for k in ("resumed_at", "from_world_size", "world_size",
                                         "grad_accum", "rows_per_step")} == {
            "resumed_at": 3, "from_world_size": ranks[0], "world_size": ranks[1],
            "grad_accum": accum[1], "rows_per_step": 4}  # fmt: skip
        assert all("resumed_at" not in r for r in log if r is not after[0])
        for mine, theirs in zip(log, straight, strict=True):
            assert mine["epoch"] == theirs["epoch"], (case, mine["step"])  # the same rows seen
        for mine, theirs in zip(after, straight[-len(after) :], strict=True):
            assert mine["loss"] == pytest.approx(theirs["loss"], rel=DRAW_TOLERANCE), case


@pytest.mark.slow
def test_resume_on_node_local_disks_equals_a_straight_run(tiny_dense, straight_runs, tmp_path):
    """Two nodes, one rank each, each with its own run directory (node-local disks: only rank
    0's holds checkpoints). Stopped at step 3 under zero1 and resumed on both, rank 1 gets the
    weights and its state from rank 0 (its optimizer shard under zero1, the whole optimizer
    under none), and the run equals the straight one (log within 1e-6, weights identical).
    (A replicated run resumed under none sends rank 1 the same files as zero1 into none, and
    sharding's own resume is test_zero1_equals_none_and_sharded_checkpoints_resume_exactly's.)"""
    nodes = [tmp_path / "zero1" / "node0", tmp_path / "zero1" / "node1"]
    train_on_nodes(tiny_dense, nodes, "--set", STEPS, "--set", "dist.sharding=zero1",
                   "--stop-after", "3")  # fmt: skip
    assert ckpt.latest_complete(nodes[0]) == ckpt.step_dir(nodes[0], 3)
    assert not ckpt.checkpoints_dir(nodes[1]).exists()
    shutil.copytree(tmp_path / "zero1", tmp_path / "zero1-into-none")

    for case, saved, resumed in (("zero1", "zero1", "zero1"),
                                 ("zero1-into-none", "zero1", "none")):  # fmt: skip
        nodes = [tmp_path / case / "node0", tmp_path / case / "node1"]
        console = train_on_nodes(tiny_dense, nodes, "--set", STEPS, "--set",
                                 f"dist.sharding={resumed}", "--resume")[0]  # fmt: skip
        assert "resume: step_3 is not on the disk of rank(s) 1: rank 0 sends them the " in console
        assert f"resume: restored {ckpt.step_dir(nodes[0], 3)} (step 3)" in console
        straight = straight_runs[saved]
        assert_same_log(read_log(straight), read_log(nodes[0]), rel=1e-6)
        assert largest_difference(weights(straight, 6), weights(nodes[0], 6)) == 0.0, case
        assert not ckpt.checkpoints_dir(nodes[1]).exists()  # written where rank 0 runs
        assert heartbeat(nodes[1], 1)["status"] == "finished"


# ---------------------------------------------------------------- checkpoints in the background


@pytest.mark.slow
def test_a_checkpoint_slower_than_the_timeout_does_not_stall_the_ranks(tiny_dense, tmp_path):
    """Each checkpoint write sleeps 15 s in rank 0's writer, the process-group timeout is 10 s:
    both ranks train on meanwhile, the next save waits without a collective timing out, and
    every checkpoint is complete."""
    run_dir = tmp_path / "run"
    done = train_cli(tiny_dense, run_dir, "--set", "dist.timeout_s=10",
                     env={save_restore.CHECKPOINT_DELAY_ENV: "15"})  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    # steps went on while step_4 was being written
    assert (
        out.index("checkpoint: step_4 saving")
        < out.index("step 6/8")
        < out.index("checkpoint: step_4 written")
    )
    assert [c.step for c in ckpt.list_checkpoints(run_dir)] == [4, 8]
    assert all(ckpt.verify(c.path) for c in ckpt.list_checkpoints(run_dir))
    assert read_state(run_dir)["status"] == "finished"


def test_a_failed_background_write_fails_the_run(tiny_dense, tmp_path, monkeypatch):
    """The writer thread's error is not lost: the run ends with exit code 1, status failed."""
    real = ckpt.write_manifest

    def full_disk(directory: Path) -> None:
        if directory.name.startswith(".tmp-step_4-"):
            raise OSError(28, "No space left on device")
        real(directory)

    monkeypatch.setattr(ckpt, "write_manifest", full_disk)
    run_dir = tmp_path / "run"
    if not T.dist.is_initialized():
        T.dist.init_process_group("gloo", store=T.dist.HashStore(), rank=0, world_size=1)
    with pytest.raises(
        save_restore.CheckpointWriteError, match="step_4: writing failed.*No space left"
    ):
        T.train(config(tiny_dense), run_dir)
    state = read_state(run_dir)
    assert (state["status"], state["exit_code"]) == ("failed", 1)
    assert heartbeat(run_dir, 0)["status"] == "failed"
    assert [c.step for c in ckpt.list_checkpoints(run_dir)] == []  # nothing half-written


# ---------------------------------------------------------------- stopping, files, dying peers


@pytest.mark.slow
def test_sigterm_to_rank_0_alone_stops_every_rank_with_a_checkpoint(tiny_dense, tmp_path):
    """...and every rank keeps its own files: rank 1's output in ranks/rank_1.log (not on the
    console), a heartbeat per rank; the collectives pinned to the node address's interface."""
    run_dir = tmp_path / "run"
    cmd = trainer_cmd(tiny_dense, run_dir, "--set", "optim.max_steps=1000", "--set",
                      "checkpoint.every=1000")  # fmt: skip
    env = trainer_env(DFLASHOPS_NODE_ADDR="127.0.0.1")
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    wait_for(lambda: heartbeat(run_dir, 1).get("step", 0) >= 2, 300, proc)
    os.kill(read_state(run_dir)["pid"], signal.SIGTERM)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out
    state = read_state(run_dir)
    assert (state["status"], state["exit_code"]) == ("stopped", 0)
    assert state["pid_start"] > 0
    latest = ckpt.latest_complete(run_dir)
    assert latest is not None and ckpt.step_of(latest) == state["last_step"] < 1000
    beats = [heartbeat(run_dir, r) for r in (0, 1)]
    for rank, beat in enumerate(beats):
        assert beat["rank"] == rank and beat["local_rank"] == rank and beat["world_size"] == 2
        assert (beat["status"], beat["exit_code"]) == ("stopped", 0)
        assert beat["node_addr"] == "127.0.0.1" and beat["hostname"]
        assert beat["pid_start"] > 0 and beat["step"] >= 2
    assert beats[0]["pid"] == state["pid"] != beats[1]["pid"]
    rank1 = rank_files.log_path(run_dir, 1).read_text()
    assert rank1.startswith("--- rank 1, pid ") and "rank 1/2: pid" in rank1
    assert "rank 0/2: pid" in out and "rank 1/2" not in out  # each where it belongs
    assert "collectives on lo" in rank1
    assert not rank_files.log_path(run_dir, 0).exists()
    assert "stopping after this step" in out


@pytest.mark.slow
def test_a_rank_whose_peer_was_killed_exits_nonzero_quickly(tiny_dense, tmp_path):
    """Two ranks started as torchrun would (no agent to clean up); rank 1 gets SIGKILL: rank 0
    exits non-zero within 60 s (gloo sees the closed connection), status failed."""
    from tests.workload.test_distributed import free_port

    run_dir = tmp_path / "run"
    cmd = trainer_cmd(tiny_dense, run_dir, "--set", "optim.max_steps=1000", "--set",
                      "checkpoint.every=1000", nproc=None)  # fmt: skip
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = trainer_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                          LOCAL_RANK=str(rank), WORLD_SIZE="2")  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))  # fmt: skip
    try:
        wait_for(lambda: heartbeat(run_dir, 1).get("step", 0) >= 2, 300, procs[0])
        procs[1].kill()
        killed = time.time()
        out = procs[0].communicate(timeout=120)[0]
        took = time.time() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    print(f"\nrank 0 exited {procs[0].returncode} {took:.1f} s after its peer was killed")
    assert procs[0].returncode not in (0, None) and took < 60, out[-3000:]
    state = read_state(run_dir)
    assert (state["status"], state["exit_code"]) == ("failed", 1)
    assert (heartbeat(run_dir, 0)["status"], heartbeat(run_dir, 0)["exit_code"]) == ("failed", 1)
    alive = [p.pid for p in procs if Path(f"/proc/{p.pid}").exists()]
    assert alive == []


def test_a_node_address_no_interface_holds_is_one_line_and_exit_2(tiny_dense, tmp_path):
    env = {"DFLASHOPS_NODE_ADDR": "203.0.113.254", "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}  # fmt: skip
    done = train_cli(tiny_dense, tmp_path / "run", nproc=None, env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: DFLASHOPS_NODE_ADDR=203.0.113.254: no network interface of this node has that "
        "IPv4 address; set it to this node's address, or set GLOO_SOCKET_IFNAME and "
        "NCCL_SOCKET_IFNAME"
    ]
