"""Runs over several processes and several containers, on the fake Proxmox bed: real sshd, a
faithful pct, two ns containers on two hosts bridged like Proxmox CTs (static addresses, no
shared DNS), torchrun with gloo on CPU, and the real tiny trainer.

Where a GPU is needed (nvidia-smi's reading of GPUs, their memory and the processes holding
them) a stand-in `nvidia-smi` script answers in its place: no GPU can run here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.operator.cli import Ran, dflashops
from tests.operator.tiny_target import tiny_build

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

A_VMID, B_VMID = 971, 972
STEPS = 24  # long enough for `stop` to arrive mid-run
FAKE_BIN = "/root/fakebin"
FAKE_NVIDIA_SMI = """\
#!/bin/sh
# Stands in for nvidia-smi (no GPU here): 2 GPUs of $MIB MiB, and, when the file busy exists,
# a process holding GPU 0.
MIB=$(cat /root/fakebin/mib 2>/dev/null || echo 81559)
case "$*" in
  *--query-gpu*)
    echo "0, GPU-aaaa, NVIDIA A100-SXM4-80GB, $MIB, 0, 0"
    echo "1, GPU-bbbb, NVIDIA A100-SXM4-80GB, $MIB, 0, 0" ;;
  *--query-compute-apps*)
    [ -f /root/fakebin/busy ] && echo "4242, GPU-aaaa, 70000, python" ;;
  *) echo "GPU 0: NVIDIA A100-SXM4-80GB"; echo "GPU 1: NVIDIA A100-SXM4-80GB" ;;
esac
exit 0
"""


@pytest.fixture(scope="module")
def cts(testbed):
    if testbed.mode != "netns":
        pytest.skip("container networks need the test bed's netns mode")
    a = testbed["pve1"].add_container(A_VMID, "ns", network=True)
    b = testbed["pve2"].add_container(B_VMID, "ns", network=True)
    try:
        yield {"a": a, "b": b}
    finally:
        testbed["pve1"].remove_container(A_VMID)
        testbed["pve2"].remove_container(B_VMID)


def make_cli(testbed, where: Path, targets: dict):
    inv = testbed.write_inventory(
        where / "hosts.yaml", targets, extra_defaults={"python": sys.executable}
    )
    home = where / "home"
    home.mkdir()

    def run(*args: str, timeout: float = 300) -> Ran:
        return dflashops(*args, inventory=inv, home=home, timeout=timeout)

    return run


@pytest.fixture(scope="module")
def cli(testbed, cts, tmp_path_factory):
    """An inventory of the two containers, each with its address."""
    a, b = cts["a"], cts["b"]
    return make_cli(
        testbed,
        tmp_path_factory.mktemp("scale"),
        {
            "a": ("pve1", A_VMID, {"address": a.address}),
            "b": ("pve2", B_VMID, {"address": b.address}),
        },
    )


@pytest.fixture(scope="module")
def two_gpu_cli(testbed, cts, tmp_path_factory):
    """An inventory naming container a `a2`, with gpus: 2."""
    return make_cli(testbed, tmp_path_factory.mktemp("a2"), {"a2": ("pve1", A_VMID, {"gpus": 2})})


@pytest.fixture(scope="module")
def gpu_cli(testbed, cts, tmp_path_factory):
    """An inventory naming container a `agpu`, whose PATH holds the stand-in nvidia-smi."""
    gpu_path = f"{FAKE_BIN}:/usr/sbin:/usr/bin:/sbin:/bin"
    return make_cli(
        testbed, tmp_path_factory.mktemp("agpu"), {"agpu": ("pve1", A_VMID, {"path": gpu_path})}
    )


@pytest.fixture(scope="module")
def config(cli, cts, tmp_path_factory) -> Path:
    tiny = tiny_build()
    for target in ("a", "b"):
        pushed = cli("push", target, str(tiny), "/workspace/tiny")
        assert pushed.code == 0, pushed.err
    cfg = yaml.safe_load((tiny / "run.yaml").read_text())
    cfg["target"]["path"] = "/workspace/tiny/target"
    cfg["data"]["path"] = "/workspace/tiny/data.jsonl"
    cfg["optim"].update(max_steps=STEPS, batch_size=1)
    cfg["log"]["log_every"] = 1
    cfg["checkpoint"].update(every=8, keep_last=3)
    cfg["dist"] = {"timeout_s": 60}
    path = tmp_path_factory.mktemp("cfg") / "tiny-run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def status(cli, run: str) -> dict:
    ran = cli("--json", "status", run)
    assert ran.code == 0, ran.err
    return json.loads(ran.out)


def log_of(ct, run: str) -> list[dict]:
    text = ct.host_path(f"/workspace/runs/{run}/train_log.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def trainers(ct) -> list[str]:
    """Command lines of the trainer processes (torchrun agents and ranks) in a container."""
    probe = (
        "import os\n"
        "for p in os.listdir('/proc'):\n"
        "    try: c = open(f'/proc/{p}/cmdline','rb').read().replace(b'\\0', b' ')\n"
        "    except OSError: continue\n"
        "    if b'workload.train' in c and b'/proc' not in c: print(p, c.decode()[:120])\n"
    )
    return ct.run(["python3", "-c", probe]).stdout.decode().splitlines()


def consoles(cts, run: str) -> str:
    """Every node's console and rank logs, for a failure's message."""
    out = []
    for name, ct in cts.items():
        base = ct.host_path(f"/workspace/runs/{run}")
        for path in [base / "console.log", *sorted(base.glob("ranks/*.log"))]:
            if path.is_file():
                out.append(f"\n--- {name}: {path.name}\n{path.read_text()[-3000:]}")
    return "".join(out)


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(1)
    raise AssertionError(f"not within {timeout:.0f}s: {what}")


def largest_difference(a: Path, b: Path) -> float:
    """The largest difference between two checkpoints' weights (same tensors required)."""
    from safetensors.torch import load_file

    x, y = load_file(str(a)), load_file(str(b))
    assert x.keys() == y.keys()
    return max(float((x[k].double() - y[k].double()).abs().max()) for k in x)


def close(a: dict, b: dict, keys=("loss", "acc", "streak", "dds8", "grad_norm", "lr")) -> bool:
    return a["step"] == b["step"] and all(
        (a.get(k) is None and b.get(k) is None) or abs(a[k] - b[k]) <= 1e-5 for k in keys
    )


# ---------------------------------------------------------------- two nodes = one world


def test_two_containers_on_two_hosts_train_like_four_ranks_on_one(cli, cts, config):
    """2 x 2 processes over two hosts log what 4 processes on one container log, and write the
    same checkpoint; stopped and resumed across both nodes on the way."""
    one = cli("launch", "one4", "--host", "a", "--nproc", "4", "--config", str(config))
    assert one.code == 0, one.err
    assert cli("status", "one4", "--follow", "--interval", "1").code == 0
    two = cli("launch", "two2", "--host", "b,a", "--nproc", "2", "--config", str(config))
    assert two.code == 0, two.err
    assert "[c10d] The hostname of the client socket" not in two.err, two.err  # a LAN, no DNS
    assert "two2: running on a, b" in two.out or "two2: finished on a, b" in two.out, two.out
    assert verdicts(two.err, "two2", "measured between the nodes"), two.err
    doc = status(cli, "two2")
    assert [n["target"] for n in doc["nodes"]] == ["a", "b"]  # rank 0 on the address first
    stopped = cli("--json", "stop", "two2")
    assert stopped.code == 0, stopped.err + consoles(cts, "two2")
    stop_doc = json.loads(stopped.out)
    assert stop_doc["state"] in ("stopped", "finished"), stop_doc
    assert all(n["alive"] is False for n in stop_doc["nodes"])
    assert trainers(cts["a"]) == [] and trainers(cts["b"]) == []
    if stop_doc["state"] == "stopped":
        resumed = cli("resume", "two2")
        assert resumed.code == 0, resumed.err
    assert cli("status", "two2", "--follow", "--interval", "1").code == 0
    ranks = status(cli, "two2")["ranks"]
    assert sorted((r["rank"], r["target"]) for r in ranks) == [
        (0, "a"), (1, "a"), (2, "b"), (3, "b")
    ]  # fmt: skip
    single, double = log_of(cts["a"], "one4"), log_of(cts["a"], "two2")
    assert [r["step"] for r in double] == list(range(1, STEPS + 1))
    assert all(close(x, y) for x, y in zip(single, double, strict=True)), (single, double)
    weights = f"checkpoints/step_{STEPS}/model.safetensors"
    mine, theirs = (cts["a"].host_path(f"/workspace/runs/{r}/{weights}") for r in ("one4", "two2"))
    # equal to the float32 rounding of a different summation order in gloo's all-reduce across
    # hosts (measured: 6e-8, one ulp at these magnitudes)
    assert largest_difference(mine, theirs) <= 1e-6
    assert not cts["b"].host_path("/workspace/runs/two2/checkpoints").exists() or not any(
        cts["b"].host_path("/workspace/runs/two2/checkpoints").iterdir()
    )
    rank3 = cli("logs", "two2", "--rank", "3")
    assert rank3.code == 0 and rank3.out.strip(), rank3.err
    archived = cli("archive", "two2")
    assert archived.code == 0, archived.err
    for ct in cts.values():
        assert ct.host_path("/workspace/archive/two2").is_dir()
        assert not ct.host_path("/workspace/runs/two2").exists()


def verdicts(err: str, run: str, link: str) -> list[str]:
    """launch's one line on whether the second node pays: with both step times, the link,
    and the grad_accum that makes it pay when it does not (exactly one such line)."""
    found = [ln for ln in err.splitlines() if f"{run}: 2 nodes: " in ln]
    assert len(found) <= 1, found
    for line in found:
        assert " s/step against " in line and " s on one node (grad_accum 2, " in line, line
        assert f" Gb/s ({link})" in line, line
        slower = line.startswith(f"warning: {run}: ") and ": slower; grad_accum " in line
        assert slower or (line.startswith(f"{run}: ") and line.endswith(": faster")), line
        print(f"\nlaunch said: {line}")
    return found


def planned_here(config: Path, *args: str) -> dict:
    """workload.plan of `config` here, for CPU ranks as the trainer plans them."""
    target = tiny_build() / "target"
    done = subprocess.run(
        [sys.executable, "-m", "workload.plan", "--config", str(config), "--target-config",
         str(target), "--device", "cpu", "--gpu", "cpu", "--json", *args],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_dry_run_over_two_nodes_says_whether_the_second_one_pays(cli, cts, config):
    """launch --dry-run over a and b prints the plan's verdict (at the assumed link: the
    trainer measures it at start); over one node there is no such line."""
    here = ["--target-config", str(tiny_build() / "target")]  # the plan is computed here
    two = cli("--dry-run", "launch", "pays2", "--host", "a,b", "--nproc", "2", "--config",
              str(config), *here)  # fmt: skip
    assert two.code == 0 and "memory plan per rank (4 ranks" in two.err, two.err
    (line,) = verdicts(two.err, "pays2", "assumed; the trainer measures the link at start")
    t = planned_here(config, "--nproc", "2", "--nnodes", "2")["step_time"]  # as the trainer
    assert f"{t['step_s']:.3g} s/step against {t['one_node_s']:.3g} s" in line, (line, t)
    assert "25.0 Gb/s" in line  # the plan's default link
    one = cli("--dry-run", "launch", "pays1", "--host", "a", "--nproc", "2", "--config",
              str(config), *here)  # fmt: skip
    assert one.code == 0 and "memory plan per rank (2 ranks" in one.err, one.err
    assert " nodes: " not in one.err and "s/step" not in one.err, one.err
    for ct in cts.values():
        assert not ct.host_path("/workspace/runs/pays2").exists()


def test_a_node_that_dies_takes_the_run_down(cli, cts, config):
    started = cli("launch", "dies2", "--host", "a,b", "--nproc", "1", "--config", str(config),
                  "--set", "optim.max_steps=100000")  # fmt: skip
    assert started.code == 0, started.err
    busy = cli("launch", "other", "--host", "b", "--config", str(config))
    assert busy.code == 2 and "b is busy: run dies2 (running" in busy.err, busy.err
    assert not cts["b"].host_path("/workspace/runs/other").exists()
    ranks = wait_for(
        lambda: [r for r in status(cli, "dies2")["ranks"] if r["alive"]] or None,
        120, "rank heartbeats",
    )  # fmt: skip
    victim = next(r for r in ranks if r["target"] == "b")
    killed = time.monotonic()
    cts["b"].run(["kill", "-9", str(victim["pid"])])
    doc = wait_for(
        lambda: (d := status(cli, "dies2"))["state"] == "failed" and d, 60, "the run failed"
    )
    took = time.monotonic() - killed
    print(f"\nSIGKILL of rank {victim['rank']} on b: status says failed after {took:.1f}s")
    assert took < 60
    assert "failed on b" in doc["note"], doc["note"]
    wait_for(lambda: trainers(cts["a"]) == [] and trainers(cts["b"]) == [], 60,
             "no trainer process left")  # fmt: skip
    shown = cli("status", "dies2")
    assert "node 1" in shown.out and "b: failed" in shown.out, shown.out


# ---------------------------------------------------------------- one node, its GPUs


def test_a_target_with_two_gpus_runs_two_ranks_without_a_flag(two_gpu_cli, cts, config):
    cli = two_gpu_cli
    ran = cli("launch", "g2", "--host", "a2", "--config", str(config), "--set",
              "optim.max_steps=2")  # fmt: skip
    assert ran.code == 0, ran.err
    assert "g2: 2 rank(s): a2 x2" in ran.err
    assert cli("status", "g2", "--follow", "--interval", "1").code == 0
    state = json.loads(cts["a"].host_path("/workspace/runs/g2/state.json").read_text())
    assert state["world_size"] == 2


def test_gpus_held_or_too_small_are_refused_before_anything_is_made(gpu_cli, cts, config):
    cli, ct = gpu_cli, cts["a"]
    ct.run(["mkdir", "-p", FAKE_BIN])
    ct.run(["sh", "-c", f"cat > {FAKE_BIN}/nvidia-smi && chmod +x {FAKE_BIN}/nvidia-smi"],
           input=FAKE_NVIDIA_SMI.encode())  # fmt: skip
    try:
        ct.run(["touch", f"{FAKE_BIN}/busy"])
        held = cli("launch", "held", "--host", "agpu", "--config", str(config))
        assert held.code == 2 and "agpu is busy: nvidia-smi shows its GPUs in use: pid 4242" in (
            held.err
        ), held.err
        ct.run(["rm", f"{FAKE_BIN}/busy"])
        ct.run(["sh", "-c", f"echo 16 > {FAKE_BIN}/mib"])  # 16 MiB GPUs: the plan cannot fit
        small = cli("launch", "small", "--host", "agpu", "--config", str(config))
        assert small.code == 2, small.err
        last = small.err.strip().splitlines()[-1]
        assert "the memory plan needs" in last and "have 16.0 MiB" in last, last
        assert "2 rank(s): agpu x2" in small.err  # nvidia-smi's count, no flag
        for run in ("held", "small"):
            assert not ct.host_path(f"/workspace/runs/{run}").exists()
    finally:
        ct.run(["rm", "-rf", FAKE_BIN])
