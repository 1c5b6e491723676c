"""How a run's `dist:` settings resolve for its ranks and nodes (no torch): the optimizer's
sharding and the gradients' all-reduce dtype. The trainer (train/build_run.py) applies them,
the planner (plan/) prices them; both read them here."""

from __future__ import annotations

GRAD_BYTES = {"fp32": 4, "bf16": 2}  # per gradient element on the wire


def resolve_sharding(setting: str, world: int, nnodes: int = 1) -> str:
    """`auto`: hybrid when the ranks span several nodes, zero1 with several ranks on one node
    (a lone rank has nothing to shard); hybrid on one node is zero1."""
    if setting == "auto":
        setting = "hybrid" if nnodes > 1 else "zero1" if world > 1 else "none"
    if setting == "hybrid" and nnodes == 1:
        return "zero1"
    return setting


def shard_ranks(sharding: str, world: int, nnodes: int) -> int:
    """Over how many ranks the AdamW moments are sharded."""
    if sharding == "zero1":
        return world
    return max(1, world // nnodes) if sharding == "hybrid" else 1


def resolve_grad_comm(setting: str, device_type: str, nnodes: int) -> str:
    """fp32 | bf16 from `dist.grad_comm_dtype` (auto: bf16 for GPUs over several nodes)."""
    if setting == "auto":
        return "bf16" if device_type == "cuda" and nnodes > 1 else "fp32"
    return setting
