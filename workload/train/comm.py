"""How DDP exchanges the drafter's gradients: in fp32 or bf16 (`dist.grad_comm_dtype`).

Every run registers one of torch's own DDP communication hooks: `allreduce_hook` (fp32, the
values DDP computes without a hook) or `bf16_compress_hook` (each bucket cast to bf16 and
divided by the world size, all-reduced, cast back into DDP's fp32 bucket: half the bytes on
the wire; the sum over ranks is rounded to bf16, about 3 significant digits). Gradient
accumulation communicates once per optimizer step (step.accumulate runs the other micro-batches
under `no_sync`), so the bytes per step do not grow with `optim.grad_accum`.

`auto` is bf16 where the link decides the step time (GPU ranks over several nodes) and fp32
elsewhere: on one node NVLink carries fp32 gradients in tens of milliseconds, and CPU runs are
where the trainer is checked against exact references.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from workload.train.distributed import Dist


def _bf16(state, bucket):  # no annotations: DDP checks them, and they are strings here
    """torch's bf16_compress_hook under another name: DDP refuses that name unless the backend
    is NCCL (or XCCL), though the hook works on gloo too (the CPU test bed runs it)."""
    return default_hooks.bf16_compress_hook(state, bucket)


HOOKS = {"fp32": default_hooks.allreduce_hook, "bf16": _bf16}


def install_grad_comm(ddp: nn.Module, dtype: str) -> None:
    """Register the hook that all-reduces `ddp`'s gradient buckets in `dtype` (fp32 | bf16)."""
    ddp.register_comm_hook(None, HOOKS[dtype])


LINK_PROBE_BYTES = 64 << 20  # about 20 ms at 25 Gb/s: seconds at most, even on 1 GbE
LINK_PROBE_ROUNDS = 3


def measure_link_gbps(d: Dist) -> float | None:
    """The link between the run's nodes, in Gb/s: rank 0 broadcasts LINK_PROBE_BYTES over the
    main group (device tensors: the path the gradients take), once to warm up, then the best
    of LINK_PROBE_ROUNDS. Every rank takes part; None when the ranks are on one node."""
    if d.nnodes == 1:
        return None
    probe = torch.zeros(LINK_PROBE_BYTES // 4, dtype=torch.float32, device=d.device)
    best = float("inf")
    for i in range(LINK_PROBE_ROUNDS + 1):
        _sync(d)
        t0 = time.perf_counter()
        dist.broadcast(probe, src=0)
        _sync(d)
        if i:
            best = min(best, time.perf_counter() - t0)
    return LINK_PROBE_BYTES * 8 / best / 1e9


def _sync(d: Dist) -> None:
    if d.device.type == "cuda":
        torch.cuda.synchronize(d.device)
    dist.barrier(group=d.control)
