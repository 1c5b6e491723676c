"""The step-time half of the plan: compute and communication of one optimizer step, and
whether a second node makes it pay (`python -m workload.plan --gpu h200 --link-gbps 25`).

Compute is counted in matmul FLOPs from the configs (target forward, the teacher's lm_head,
drafter forward + backward, the draft lm_head forward + input gradient; a checkpointed drafter
runs its forward twice) at `mfu` of the GPU's dense bf16 peak. Communication is the payload
each rank hands to collectives per optimizer step (what a count of all_reduce/broadcast bytes
sees): DDP's gradient all-reduce once per step (grad_accum micro-batches under no_sync) in
`dist.grad_comm_dtype`, and ZeRO's fp32 parameter broadcast over its group (every rank under
zero1, the node under hybrid). Its time on the wire: a ring all-reduce moves 2(n-1)/n of the
payload through each rank's link, a broadcast (n-1)/n; across nodes the node's NIC at
`link_gbps` carries it, within one the GPU interconnect. No overlap with the backward is
assumed (an upper bound: DDP overlaps its all-reduce with the backward).

The verdict compares the same global batch: 2 nodes at grad_accum a against 1 node at 2a.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from workload.common.parallel_rules import GRAD_BYTES, resolve_sharding

# dense bf16 TFLOPS (no sparsity) and GPU-to-GPU bandwidth within a node (GB/s, one direction)
GPUS: dict[str, tuple[float, float]] = {
    "h200": (989.0, 450.0),
    "h100": (989.0, 450.0),
    "a100": (312.0, 300.0),
    "l40s": (362.0, 32.0),
    "a6000": (155.0, 32.0),
    "rtx4090": (165.0, 32.0),
    "cpu": (0.05, 10.0),  # a few cores' fp32 and memory copies: for CPU runs' plans only
}
DEFAULT_MFU = 0.5
DEFAULT_LINK_GBPS = 25.0
NOTE = (
    "step time: matmul FLOPs at the stated fraction of the GPU's bf16 peak, collectives "
    "on the wire without overlap (ring factors; an upper bound)"
)


@dataclass
class Comm:
    """Bytes one rank hands to collectives per optimizer step, within and across nodes."""

    intra: int = 0
    inter: int = 0
    grads: int = 0  # of which the gradient all-reduce
    params: int = 0  # and ZeRO's parameter broadcast


@dataclass
class StepTime:
    gpu: str
    mfu: float
    link_gbps: float
    flops: float  # per rank per optimizer step
    compute_s: float
    comm_s: float  # this run's communication (as planned: world and nodes)
    step_s: float
    one_node_s: float | None = None  # the same global batch on one node (None: one node)
    pays: bool | None = None
    accum_to_pay: int | None = None  # the smallest grad_accum at which 2 nodes beat 1
    link_measured: bool = False  # link_gbps measured between the run's nodes (else assumed)
    grad_accum: int = 1  # this run's (the one-node comparison runs nnodes times as many)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def comm_bytes(params: int, world: int, nnodes: int, sharding: str, grad_dtype: str) -> Comm:
    """Payload per rank per optimizer step (see the module doc)."""
    c = Comm()
    if world == 1:
        return c
    c.grads = params * GRAD_BYTES[grad_dtype]
    c.params = params * 4 if sharding in ("zero1", "hybrid") else 0
    across = nnodes > 1
    if across:
        c.inter += c.grads
    else:
        c.intra += c.grads
    if sharding == "zero1" and across:
        c.inter += c.params
    else:
        c.intra += c.params
    return c


def comm_seconds(c: Comm, world: int, nnodes: int, sharding: str, intra_gbs: float,
                 link_gbps: float) -> float:  # fmt: skip
    """Wire time of one step's collectives (ring factors; no overlap)."""
    if world == 1:
        return 0.0
    per_node = max(1, world // nnodes)
    link = link_gbps * 1e9 / 8
    ring = 2 * (world - 1) / world
    grads = c.grads * ring / (link if nnodes > 1 else intra_gbs * 1e9)
    group = world if sharding == "zero1" else per_node
    bcast = 0.0
    if c.params and group > 1:
        share = (group - 1) / group
        if sharding == "zero1" and nnodes > 1:  # the other nodes' shards come over the NIC
            bcast = c.params * (nnodes - 1) / nnodes / link
        else:
            bcast = c.params * share / (intra_gbs * 1e9)
    return grads + bcast


def step_flops(s, counts: dict[str, int]) -> float:
    """Matmul FLOPs of one micro-batch on one rank. `s`: plan.Shape; `counts`: target_body
    (non-embedding target parameters), target_full_layers, target_q_dim, drafter_block
    (q, o, MLP weights per layer, summed), drafter_kv (k, v weights, summed), fc."""
    c, q = s.context, s.queries
    attn_t = 2 * s.rows * s.seq * s.seq * counts["target_q_dim"] * counts["target_full_layers"]
    target = 2 * counts["target_body"] * c + attn_t + 2 * c * s.hidden * s.vocab
    per_key = 4 * s.q_dim
    keys = 0.0
    for kind in s.drafter_layers:
        seen = (
            s.seq / 2 if kind != "sliding_attention" or not s.window else min(s.window, s.seq / 2)
        )
        keys += q * (seen + s.block) * per_key
    forward = 2 * q * counts["drafter_block"] + 2 * (q + c) * counts["drafter_kv"]
    forward += 2 * c * counts["fc"] + keys
    drafter = forward * (4 if s.checkpointed else 3)
    slots = s.rows * s.anchors * (s.block - 1)
    head = 4 * slots * s.hidden * s.vocab
    return target + drafter + head


def step_time(s, counts: dict[str, int], *, params: int, world: int, nnodes: int, sharding: str,
              grad_dtype: str, accum: int, gpu: str = "h200", peak_tflops: float | None = None,
              mfu: float = DEFAULT_MFU, link_gbps: float = DEFAULT_LINK_GBPS,
              link_measured: bool = False) -> StepTime:  # fmt: skip
    """The plan's step time and, with several nodes, the one-node comparison."""
    peak, intra = GPUS[gpu]
    peak = peak_tflops if peak_tflops is not None else peak
    per_micro = step_flops(s, counts)
    micro_s = per_micro / (peak * 1e12 * mfu)

    def seconds(world_: int, nnodes_: int, accum_: int) -> float:
        mode = resolve_sharding(sharding, world_, nnodes_)
        c = comm_bytes(params, world_, nnodes_, mode, grad_dtype)
        return accum_ * micro_s + comm_seconds(c, world_, nnodes_, mode, intra, link_gbps)

    mode = sharding
    c = comm_bytes(params, world, nnodes, mode, grad_dtype)
    comm_s = comm_seconds(c, world, nnodes, mode, intra, link_gbps)
    out = StepTime(gpu, mfu, link_gbps, per_micro * accum, accum * micro_s, comm_s,
                   accum * micro_s + comm_s, link_measured=link_measured,
                   grad_accum=accum)  # fmt: skip
    if nnodes > 1:
        per_node = world // nnodes
        out.one_node_s = seconds(per_node, 1, accum * nnodes)
        out.pays = out.step_s < out.one_node_s
        for a in range(1, 257):
            if seconds(world, nnodes, a) < seconds(per_node, 1, a * nnodes):
                out.accum_to_pay = a
                break
    return out


def lines(t: StepTime, c: Comm, nnodes: int, accum: int) -> list[str]:
    out = [
        f"step time ({t.gpu}, {t.mfu:.0%} of peak, link {t.link_gbps:.1f} Gb/s): compute "
        f"{t.compute_s:.3g} s ({t.flops / 1e12:.3g} TFLOP per rank), communication "
        f"{t.comm_s:.3g} s, step {t.step_s:.3g} s",
        f"  communication per rank per step: within a node {c.intra / 1e9:.3f} GB, across "
        f"nodes {c.inter / 1e9:.3f} GB",
    ]
    if t.one_node_s is not None:
        word = "faster" if t.pays else "SLOWER"
        out.append(
            f"  {nnodes} nodes: {t.step_s:.3g} s a step against {t.one_node_s:.3g} s on one node "
            f"for the same rows (grad_accum {accum * nnodes}): {word}"
        )
        if not t.pays:
            fix = (f"grad_accum {t.accum_to_pay} would make it pay" if t.accum_to_pay
                   else "no grad_accum up to 256 makes it pay")  # fmt: skip
            out.append(f"  warning: the second node makes training slower; {fix}")
    return out


def verdict(t: StepTime, nnodes: int) -> str | None:
    """One line: does the second node pay, at which link, and the grad_accum that makes it
    (None on one node). dflashops/runs/training/launch.py words the same line from plan.json."""
    if t.one_node_s is None:
        return None
    link = "measured between the nodes" if t.link_measured else "assumed"
    head = (f"{nnodes} nodes: {t.step_s:.3g} s/step against {t.one_node_s:.3g} s on one node "
            f"(grad_accum {t.grad_accum * nnodes}, the same rows) at {t.link_gbps:.1f} Gb/s "
            f"({link})")  # fmt: skip
    if t.pays:
        return f"{head}: faster"
    fix = (f"grad_accum {t.accum_to_pay} makes it pay" if t.accum_to_pay
           else "no grad_accum up to 256 makes it pay: train on one node")  # fmt: skip
    return f"{head}: slower; {fix}"
