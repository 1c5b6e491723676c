"""What rank 0 hands the other ranks when they resume from a checkpoint their disks lack: states
sent in pieces, weights broadcast in pieces, and work on one rank that takes longer than the
process-group timeout without any rank timing out (real gloo processes on CPU)."""

from __future__ import annotations

from tests.workload.test_distributed import on_ranks

_HAND_OUT = """
import time, torch
from workload.train import distributed as D
from workload.config import DistConfig
D.PIECE_BYTES = 64  # 16 float32s: every tensor below goes in several pieces
D.POLL_S = 0.5
d = D.init_distributed(DistConfig(timeout_s=3))  # every wait below must stay under 3 s

def make(r):
    time.sleep(4)  # reading rank r's shard: longer than the timeout
    return {"rank": r, "state": {5: {"step": torch.tensor(7.0), "exp_avg": torch.arange(100.0) * r}},
            "rng": torch.arange(30, dtype=torch.uint8), "none": torch.empty(0),
            "half": torch.full((3, 50), r, dtype=torch.bfloat16), "groups": [{"lr": 0.1}]}

got = D.hand_out(make if d.main else None, [1, 2], d)
if got is None:
    print("got None")
else:
    ok = (torch.equal(got["state"][5]["exp_avg"], torch.arange(100.0) * d.rank)
          and float(got["state"][5]["step"]) == 7.0 and got["state"][5]["step"].shape == ()
          and torch.equal(got["rng"], torch.arange(30, dtype=torch.uint8))
          and got["none"].shape == (0,) and got["half"].dtype == torch.bfloat16
          and got["half"].eq(d.rank).all().item() and got["groups"] == [{"lr": 0.1}])
    print("got", got["rank"], ok)

slow = lambda: time.sleep(4) or "slept"  # one rank works longer than the timeout
print("polled", D.run_polled(slow if d.rank == 1 else (lambda: d.rank), d, "testing"))

w = [torch.arange(40.0).view(4, 10) * (d.rank == 0) + d.rank, torch.full((5,), d.rank)]
D.broadcast_tensors(w, d)
print("weights", torch.equal(w[0], torch.arange(40.0).view(4, 10)), w[1].tolist())

def broken(r):
    if r == 2:
        raise OSError("shard unreadable")
    return {"x": torch.ones(3)}

try:
    D.hand_out(broken if d.main else None, [1, 2], d)
except (OSError, D.PeerFailed) as exc:
    print("hand_out failed:", type(exc).__name__, exc)

def fails():
    raise ValueError("bad file")

try:
    D.run_polled(fails if d.rank == 2 else None, d, "reading step_3")
except (ValueError, D.PeerFailed) as exc:
    print("run_polled failed:", type(exc).__name__, exc)
"""


def test_rank_0_hands_out_states_in_pieces_and_no_rank_waits_past_the_timeout():
    """Rank 0 takes 4 s to make each of ranks 1 and 2's states, rank 1 works 4 s alone, under
    a 3 s process-group timeout: every rank gets exactly its own state (several pieces a
    tensor), the weights broadcast in pieces are rank 0's, nothing times out; a failure on
    one rank fails every rank, each saying where."""
    out = on_ranks(_HAND_OUT, world=3, timeout=180)
    assert [p.returncode for p in out] == [0, 0, 0], [p.stderr for p in out]
    lines = [p.stdout.splitlines() for p in out]
    assert lines[0][:3] == ["got None", "polled 0", "weights True [0, 0, 0, 0, 0]"]
    assert lines[1][:3] == ["got 1 True", "polled slept", "weights True [0, 0, 0, 0, 0]"]
    assert lines[2][:3] == ["got 2 True", "polled 2", "weights True [0, 0, 0, 0, 0]"]
    assert lines[0][3] == "hand_out failed: OSError shard unreadable"
    for rank in (1, 2):
        assert lines[rank][3] == (
            "hand_out failed: PeerFailed rank 0 failed to read what it hands out (see its output)"
        )
    assert lines[2][4] == "run_polled failed: ValueError bad file"
    for rank in (0, 1):
        assert lines[rank][4] == (
            "run_polled failed: PeerFailed another rank failed while reading step_3 "
            "(see its output)"
        )
