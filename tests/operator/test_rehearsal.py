"""`--dry-run` is a rehearsal that touches nothing (issue 25, item 3): before or after the verb,
launch, eval, datagen and pull-ckpt open no connection to a host (a listening socket counts
the attempts), the config's typos are found here, and what needs a host is said, not failed."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.operator.cli import Ran, dflashops

ROOT = Path(__file__).resolve().parents[2]


class Listener:
    """A TCP port that counts the connections made to it (a host that must not be called)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()


@pytest.fixture
def host() -> Iterator[Listener]:
    listener = Listener()
    yield listener
    listener.stop.set()
    listener.thread.join()
    listener.sock.close()


@pytest.fixture
def inventory(tmp_path, host) -> Path:
    path = tmp_path / "hosts.yaml"
    path.write_text(
        "version: 1\nhosts:\n"
        f"  pve1: {{address: 127.0.0.1, port: {host.port}, user: root}}\n"
        "targets:\n"
        "  ct200: {host: pve1, vmid: 200, role: train, gpus: 2}\n"
        "  ct129: {host: pve1, vmid: 129, role: eval, gpus: 1}\n"
    )
    return path


def run(inventory: Path, home: Path, *args: str) -> Ran:
    return dflashops(*args, inventory=inventory, home=home, cwd=ROOT, timeout=60)


TINY = ["--config", "tiny", "--set", "target.path=/models/t", "--set", "data.path=/d/t.jsonl"]


def test_launch_rehearsed_before_or_after_the_verb_connects_nowhere(inventory, host, tmp_path):
    for args in (["--dry-run", "launch", "r1", "--host", "ct200", *TINY],
                 ["launch", "r1", "--host", "ct200", *TINY, "--dry-run"]):  # fmt: skip
        ran = run(inventory, tmp_path, *args)
        assert ran.code == 0, ran.err
        tmux = [line for line in ran.out.splitlines() if " new-session " in line]
        assert len(tmux) == 1 and tmux[0].startswith("pve1: pct exec 200 -- "), ran.out
        assert "launcher.py /workspace/runs/r1" in tmux[0]
        assert "r1: config: valid" in ran.err
        assert "dry run: not read (needs the host): pve1: pct exec 200" in ran.err
        assert "memory plan: not computed under --dry-run" in ran.err
        assert "Traceback" not in ran.err
    assert host.accepted == 0


@pytest.mark.parametrize(
    ("item", "said"),
    [
        ("data.pth=/x", "data.pth: unknown key; did you mean data.path?"),
        ("optim.lr=fast", "optim.lr: expected a number, got 'fast'"),
    ],
)
def test_a_config_typo_is_found_offline(inventory, host, tmp_path, item, said):
    ran = run(inventory, tmp_path, "launch", "r2", "--host", "ct200", *TINY, "--set", item,
              "--dry-run")  # fmt: skip
    assert ran.code == 2, ran.err
    assert ran.err.strip().splitlines()[-1] == f"dflashops: error: r2: config: --set {item}: {said}"
    assert ran.out == ""
    assert host.accepted == 0


def test_eval_pull_datagen_and_the_others_rehearsed_say_what_needs_a_host(
    inventory, host, tmp_path
):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    for args in (["eval", "r1", "--step", "10", "--on", "ct129"],
                 ["eval", "r1", "--every", "10", "--on", "ct129"],
                 ["pull-ckpt", "10", "--to", "ct129", "--run", "r1"], ["stop", "r1"],
                 ["resume", "r1"], ["archive", "r1"], ["attach", "r1"]):  # fmt: skip
        ran = run(inventory, tmp_path, *args, "--dry-run")
        assert ran.code == 0, (args, ran.err)
        assert "dry run: run r1: found by reading the hosts, which --dry-run does not do" in ran.err
    gen = run(inventory, tmp_path, "--dry-run", "datagen", "d1", "--host", "ct200", "--prompts",
              str(prompts), "--target", "/models/t")  # fmt: skip
    assert gen.code == 0, gen.err
    assert any(" new-session " in line and "/workspace/data/d1" in line
               for line in gen.out.splitlines()), gen.out  # fmt: skip
    bad = run(inventory, tmp_path, "--dry-run", "eval", "r1", "--step", "10", "--on", "ct12")
    assert bad.code == 4 and "ct12" in bad.err and "did you mean" in bad.err, bad.err
    assert host.accepted == 0


def test_trusting_a_typo_says_it_is_not_in_the_inventory(inventory, host, tmp_path):
    ran = run(inventory, tmp_path, "hosts", "trust", "pve2", "--yes")
    assert ran.code == 4, ran.err
    assert ran.err == f"dflashops: error: pve2: not a host of {inventory} (did you mean 'pve1'?)\n"
    assert host.accepted == 0


def test_the_shipped_inventory_cites_the_contract_it_ships_with():
    head = (ROOT / "demo-hosts.yaml").read_text().splitlines()[0]
    assert "docs/contracts.md" in head and "../shared" not in head
    assert (ROOT / "docs" / "contracts.md").is_file()


def test_the_memory_plan_is_computed_here_from_a_copy_of_the_target_config(
    inventory, host, tmp_path
):
    from tests.operator.tiny_target import tiny_build

    ran = run(inventory, tmp_path, "launch", "r3", "--host", "ct200", *TINY, "--dry-run",
              "--target-config", str(tiny_build() / "target"))  # fmt: skip
    assert ran.code == 0, ran.err
    assert "r3: memory plan per rank (2 ranks, sharding " in ran.err, ran.err
    alone = run(inventory, tmp_path, "launch", "r3", "--host", "ct200", *TINY,
                "--target-config", "/nowhere")  # fmt: skip
    assert alone.code == 2 and "--target-config goes with --dry-run" in alone.err, alone.err
    assert host.accepted == 0


def test_the_rehearsal_plans_for_the_gpus_the_inventory_says(tmp_path, host):
    """Issue 34, item 3: the inventory says ct200 and ct201 hold 8 H200 each; the offline
    plan of the 27B template is made for those GPUs (the plan alone says 74.64 GiB per rank),
    never for the CPU, with a step time, over one container and over two."""
    inv = tmp_path / "hosts.yaml"
    gpus = "gpus: 8, gpu_model: NVIDIA H200, gpu_memory_gib: 139.8"
    inv.write_text(
        "version: 1\nhosts:\n"
        f"  pve1: {{address: 127.0.0.1, port: {host.port}, user: root}}\n"
        "targets:\n"
        f"  ct200: {{host: pve1, vmid: 200, role: train, address: 10.1.2.200, {gpus}}}\n"
        f"  ct201: {{host: pve1, vmid: 201, role: train, address: 10.1.2.201, {gpus}}}\n"
    )
    args = ["--dry-run", "launch", "v1", "--config", "qwen36-27b", "--set",
            "data.path=/workspace/data/nemo"]  # fmt: skip
    one = run(inv, tmp_path, *args, "--host", "ct200",
              "--target-config", "templates/targets/qwen36-27b-config.json")  # fmt: skip
    assert one.code == 0, one.err
    assert ("v1: memory plan per rank (8 ranks, sharding zero1): 74.6 GiB of 139.8 GiB: fits"
            in one.err), one.err  # fmt: skip
    assert "  step time 1.27 s (" in one.err and "8 x h200" in one.err, one.err
    assert "on CPU" not in one.err
    two = run(inv, tmp_path, *args, "--host", "ct200,ct201")  # the template's own copy
    assert two.code == 0, two.err
    assert "templates/targets/qwen36-27b-config.json (the template's copy" in two.err, two.err
    assert "(16 ranks, sharding hybrid): 74.6 GiB of 139.8 GiB: fits" in two.err, two.err
    verdict = next(line for line in two.err.splitlines() if "2 nodes: " in line)
    assert float(verdict.split("2 nodes: ")[1].split(" s/step")[0]) < 10, verdict
    assert host.accepted == 0
