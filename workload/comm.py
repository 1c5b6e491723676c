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

from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


def _bf16(state, bucket):  # no annotations: DDP checks them, and they are strings here
    """torch's bf16_compress_hook under another name: DDP refuses that name unless the backend
    is NCCL (or XCCL), though the hook works on gloo too (the CPU test bed runs it)."""
    return default_hooks.bf16_compress_hook(state, bucket)


HOOKS = {"fp32": default_hooks.allreduce_hook, "bf16": _bf16}
BYTES = {"fp32": 4, "bf16": 2}


def resolve_grad_comm(setting: str, device_type: str, nnodes: int) -> str:
    """fp32 | bf16 from `dist.grad_comm_dtype` (auto: bf16 for GPUs over several nodes)."""
    if setting == "auto":
        return "bf16" if device_type == "cuda" and nnodes > 1 else "fp32"
    return setting


def install_grad_comm(ddp: nn.Module, dtype: str) -> None:
    """Register the hook that all-reduces `ddp`'s gradient buckets in `dtype` (fp32 | bf16)."""
    ddp.register_comm_hook(None, HOOKS[dtype])
