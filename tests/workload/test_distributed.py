"""Process groups, the node's interface, optimizer shards and every rank's own files: the pieces
of a multi-rank run, each on real processes (gloo on CPU) and real network namespaces."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from workload.common import rank_files as R
from workload.train import distributed as D

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# as the trainer does: a gloo group left to the interpreter's exit can abort the process
# ("terminate called without an active exception", exit -6) after the script succeeded
_FINISH = """
import torch.distributed as _dist
if _dist.is_initialized():
    _dist.destroy_process_group()
"""


def on_ranks(script: str, *args: str, world: int = 2, timeout: float = 120,
             env: dict | None = None, env_of=None) -> list[subprocess.CompletedProcess]:  # fmt: skip
    """Run `script` as `world` gloo ranks (torchrun's environment, no agent); their results.
    `env_of(rank)`: more environment for one rank (e.g. its node, GROUP_RANK)."""
    port = free_port()
    procs = []
    for rank in range(world):
        full = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1", **(env or {}),
                **(env_of(rank) if env_of else {})}  # fmt: skip
        cmd = [sys.executable, "-c", textwrap.dedent(script) + _FINISH, *args]
        procs.append(subprocess.Popen(cmd, env=full, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))  # fmt: skip
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


# ---------------------------------------------------------------- the node's interface


def test_the_interface_of_an_address_is_found():
    assert D.interface_of("127.0.0.1") == "lo"
    assert D.interface_of("203.0.113.254") is None  # TEST-NET-3: on no interface here


def test_node_address_pins_gloo_and_nccl_to_its_interface():
    env = {D.NODE_ADDR_ENV: "127.0.0.1"}
    assert D.pin_interface(env) == "lo"
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo"
    # what the operator set stays
    env = {D.NODE_ADDR_ENV: "127.0.0.1", "GLOO_SOCKET_IFNAME": "eth9"}
    D.pin_interface(env)
    assert env == {D.NODE_ADDR_ENV: "127.0.0.1", "GLOO_SOCKET_IFNAME": "eth9",
                   "NCCL_SOCKET_IFNAME": "lo"}  # fmt: skip
    assert D.pin_interface({}) is None


@pytest.mark.parametrize("address", ["203.0.113.254", "node-7", "10.0.0"])
def test_an_address_no_interface_holds_is_one_line(address):
    env = {D.NODE_ADDR_ENV: address}
    with pytest.raises(D.DistSetupError) as info:
        D.pin_interface(env)
    message = str(info.value)
    assert "\n" not in message and f"DFLASHOPS_NODE_ADDR={address}" in message
    assert "GLOO_SOCKET_IFNAME" not in env


@pytest.fixture
def netns():
    """A network namespace of our own (needs root and `ip`)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for a network namespace")
    name = f"dfo-dist-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    yield name
    subprocess.run(["ip", "netns", "del", name], check=False)


def test_addresses_on_a_veth_in_a_namespace_are_found(netns):
    """A container's view: eth0 holding the node address (primary, secondary, alias)."""

    def ip(*args: str) -> None:
        subprocess.run(["ip", "-n", netns, *args], check=True)

    ip("link", "add", "eth0", "type", "veth", "peer", "name", "peer0")
    ip("addr", "add", "192.0.2.10/24", "dev", "eth0")
    ip("addr", "add", "192.0.2.11/24", "dev", "eth0")  # secondary
    ip("addr", "add", "198.51.100.7/24", "dev", "eth0", "label", "eth0:1")
    ip("link", "set", "eth0", "up")
    probe = ("from workload.train import distributed as D; import sys; "
             "print([D.interface_of(a) for a in sys.argv[1:]])")  # fmt: skip
    cmd = ["ip", "netns", "exec", netns, sys.executable, "-c", probe,
           "192.0.2.10", "192.0.2.11", "198.51.100.7", "127.0.0.1", "192.0.2.2"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ,
                          "PYTHONPATH": str(REPO)}, check=True)  # fmt: skip
    # lo is down in a new namespace, and 192.0.2.2 belongs to the machine outside it
    assert done.stdout.strip() == "['eth0', 'eth0', 'eth0:1', None, None]"


# ---------------------------------------------------------------- control traffic


_SEND = """
import torch
from workload.train import distributed as D
d = D.init_distributed()
assert d.control is None and d.world == 2
state = {"state": {3: {"step": torch.tensor(5.0), "exp_avg": torch.arange(6.0).view(2, 3)}},
         "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95)}],
         "half": torch.ones(4, dtype=torch.bfloat16) * d.rank}
if d.rank == 1:
    D.send_state(state, 0, d)
else:
    got = D.recv_state(1, d)
    assert got["param_groups"] == [{"lr": 0.1, "betas": (0.9, 0.95)}]
    assert torch.equal(got["state"][3]["exp_avg"], torch.arange(6.0).view(2, 3))
    assert got["state"][3]["step"].shape == () and float(got["state"][3]["step"]) == 5.0
    assert got["half"].dtype == torch.bfloat16 and got["half"].tolist() == [1.0] * 4
print("gathered", D.gather_to_main({"rank": d.rank}, d))
print("any", D.any_rank(d.rank == 1, d), D.any_rank(False, d), D.broadcast_int(7 - d.rank, d))
"""


def test_state_and_control_values_cross_between_ranks():
    out = on_ranks(_SEND)
    assert [p.returncode for p in out] == [0, 0], [p.stderr for p in out]
    assert out[0].stdout.splitlines() == ["gathered [{'rank': 0}, {'rank': 1}]", "any True False 7"]
    assert out[1].stdout.splitlines() == ["gathered None", "any True False 7"]


# ---------------------------------------------------------------- optimizer shards


_SHARDS = """
import copy, torch
from torch import nn
from workload.train import distributed as D
from workload.train import sharding as S
from workload.config import OptimConfig
d = D.init_distributed()
o = OptimConfig(lr=1e-2, weight_decay=0.1)

def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(4, 4))

def steps(m, opt, n, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in m.parameters():  # the same gradients on every rank (as after DDP's all-reduce)
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        opt.zero_grad(set_to_none=True)

plain, zero = model(), model()
p_opt = S.build_optimizer(list(plain.parameters()), o, "none", d.device)
z_opt = S.build_optimizer(list(zero.parameters()), o, "zero1", d.device)
assert S.indices_held(z_opt, list(zero.parameters())) != list(range(6))  # really sharded
steps(plain, p_opt, 3, 1); steps(zero, z_opt, 3, 1)
for a, b in zip(plain.parameters(), zero.parameters()):
    assert torch.equal(a, b)

# shards gathered on rank 0 merge into the whole state of the plain optimizer
mine = S.local_state(z_opt, list(zero.parameters()))
shards = D.gather_to_main(mine, d)
whole = copy.deepcopy(S.from_state_dict(p_opt.state_dict()))  # not the live tensors
if d.main:
    merged = S.merge(shards)
    assert sorted(merged["state"]) == sorted(whole["state"]) == list(range(6))
    for i, st in whole["state"].items():
        assert all(torch.equal(st[k], merged["state"][i][k]) for k in st)
    assert merged["param_groups"] == whole["param_groups"]

# resume both ways: the whole state into ZeRO, every shard into a plain optimizer
z2, p2 = model(), model()
with torch.no_grad():
    for a, b, c in zip(z2.parameters(), p2.parameters(), plain.parameters()):
        a.copy_(c); b.copy_(c)
z2_opt = S.build_optimizer(list(z2.parameters()), OptimConfig(lr=5.0), "zero1", d.device)
p2_opt = S.build_optimizer(list(p2.parameters()), OptimConfig(lr=5.0), "none", d.device)
S.load_state(z2_opt, list(z2.parameters()), whole)
everything = S.merge(D.gather_to_main(mine, d) or [])
box = [everything]
torch.distributed.broadcast_object_list(box, src=0)
S.load_state(p2_opt, list(p2.parameters()), box[0])
assert z2_opt.param_groups[0]["lr"] == p2_opt.param_groups[0]["lr"] == 1e-2
steps(plain, p_opt, 2, 2); steps(z2, z2_opt, 2, 2); steps(p2, p2_opt, 2, 2)
for a, b, c in zip(plain.parameters(), z2.parameters(), p2.parameters()):
    assert torch.equal(a, b) and torch.equal(a, c)
print("ok")
"""


def test_zero1_shards_equal_the_plain_optimizer_and_load_either_way():
    out = on_ranks(_SHARDS)
    assert [p.stdout.strip() for p in out] == ["ok", "ok"], [p.stderr[-2000:] for p in out]


# ---------------------------------------------------------------- a rank's own files


def test_process_start_ticks_name_the_process():
    me = R.process_start_ticks()
    assert me == R.process_start_ticks(os.getpid()) > 0
    child = subprocess.Popen(["sleep", "5"])
    try:
        assert R.process_start_ticks(child.pid) >= me
    finally:
        child.kill()
        child.wait()


def test_heartbeat_fields(tmp_path, monkeypatch):
    monkeypatch.setenv(R.NODE_ADDR_ENV, "192.0.2.10")
    beat = R.Heartbeat(tmp_path, 3, 1, 4)
    beat.update(status="running", step=7)
    got = json.loads(R.heartbeat_path(tmp_path, 3).read_text())
    assert got == {"rank": 3, "local_rank": 1, "world_size": 4, "pid": os.getpid(),
                   "pid_start": R.process_start_ticks(), "hostname": socket.gethostname(),
                   "node_addr": "192.0.2.10", "step": 7, "time": got["time"],
                   "status": "running", "exit_code": None}  # fmt: skip
    assert abs(got["time"] - time.time()) < 60
    assert R.heartbeat_path(tmp_path, 3) == tmp_path / "ranks" / "rank_3.json"


_REDIRECT = """
import os, sys
from pathlib import Path
from workload.common import rank_files as R
R.redirect_output(Path(sys.argv[1]), int(sys.argv[2]))
print("to stdout", flush=True)
os.write(2, b"to fd 2\\n")
os.system("echo from a child")
"""


@pytest.mark.parametrize("rank", [0, 1])
def test_other_ranks_output_goes_to_their_log(tmp_path, rank):
    done = subprocess.run([sys.executable, "-c", _REDIRECT, str(tmp_path), str(rank)],
                          capture_output=True, text=True, env={**os.environ,
                          "PYTHONPATH": str(REPO)}, check=True)  # fmt: skip
    log = R.log_path(tmp_path, rank)
    if rank == 0:  # the console keeps rank 0's output
        assert done.stdout == "to stdout\nfrom a child\n" and done.stderr == "to fd 2\n"
        assert not log.exists()
    else:
        assert done.stdout == done.stderr == ""
        lines = log.read_text().splitlines()
        assert lines[0].startswith("--- rank 1, pid ")
        assert lines[1:] == ["to stdout", "to fd 2", "from a child"]
