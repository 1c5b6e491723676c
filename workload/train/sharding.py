"""The drafter's optimizer, replicated (`dist.sharding: none`) or with its AdamW states sharded
over the ranks (`zero1`: torch's ZeroRedundancyOptimizer), or over the ranks of each node and
replicated across nodes (`hybrid`), and its state in checkpoints.

Under hybrid every node updates all parameters from the same all-reduced gradients (AdamW is
elementwise: each node computes the same values), so the updated parameters are broadcast
within the node only and nothing but the gradients crosses the node boundary; a rank keeps
1/ranks-per-node of the moments instead of 1/world.

A checkpoint holds optimizer state keyed by the parameter's index in `drafter.parameters()`:
the whole state (none: `optimizer.state_dict()`, as before) or one file per rank holding that
rank's parameters (zero1). Any of these loads into either kind of optimizer of the same
parameters, so a run can resume under the other sharding.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from workload.common.layout import OPTIMIZER_DIR, rank_name
from workload.config import OptimConfig

SHARDED = ("zero1", "hybrid")


def build_optimizer(
    params: Sequence[nn.Parameter], o: OptimConfig, sharding: str, device: torch.device,
    group: Any = None,
) -> torch.optim.Optimizer:  # fmt: skip
    """AdamW with the config's hyper-parameters (fused on CUDA), sharded for zero1 (over the
    default group) and hybrid (over `group`, this rank's node)."""
    kwargs: dict[str, Any] = dict(
        lr=o.lr, betas=(o.betas[0], o.betas[1]), weight_decay=o.weight_decay,
        fused=device.type == "cuda",
    )  # fmt: skip
    if sharding in SHARDED:
        return ZeroRedundancyOptimizer(list(params), optimizer_class=torch.optim.AdamW,
                                       process_group=group, **kwargs)  # fmt: skip
    return torch.optim.AdamW(params, **kwargs)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's states (ZeRO's local one, or the optimizer)."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def _flat(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def hyper_parameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's settings (lr, betas, ...) without its parameters."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def local_state(optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter]) -> dict[str, Any]:
    """This rank's optimizer states, copied to the CPU and keyed by the parameter's index in
    `params`: {"state": {index: {...}}, "param_groups": [settings]}."""
    local = local_optimizer(optimizer)
    index = {id(p): i for i, p in enumerate(params)}
    state = {}
    for p in _flat(local):
        if p in local.state:
            state[index[id(p)]] = {k: _cpu_copy(v) for k, v in local.state[p].items()}
    return {"state": state, "param_groups": hyper_parameters(optimizer)}


def _cpu_copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return value


def indices_held(optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter]) -> list[int]:
    """The indices (in `params`) of the parameters whose states this rank keeps."""
    index = {id(p): i for i, p in enumerate(params)}
    return [index[id(p)] for p in _flat(local_optimizer(optimizer))]


def from_state_dict(saved: dict[str, Any]) -> dict[str, Any]:
    """A whole `optimizer.state_dict()` (one group or several, in parameter order) in the
    index-keyed form of `local_state`."""
    return {"state": dict(saved["state"]), "param_groups": [
        {k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]]}  # fmt: skip


def merge(parts: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Index-keyed parts (shards) merged into one."""
    merged: dict[str, Any] = {"state": {}, "param_groups": None}
    for part in parts:
        merged["state"].update(part["state"])
        merged["param_groups"] = merged["param_groups"] or part["param_groups"]
    return merged


def load_state(
    optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter], saved: dict[str, Any]
) -> None:
    """Load index-keyed states (all of them, or at least this rank's) into `optimizer`; the
    group settings (lr, ...) go to the optimizer the scheduler drives too."""
    local = local_optimizer(optimizer)
    index = {id(p): i for i, p in enumerate(params)}
    groups, position = [], 0
    state = {}
    for group, settings in zip(local.param_groups, saved["param_groups"], strict=True):
        positions = []
        for p in group["params"]:
            if index[id(p)] in saved["state"]:
                state[position] = saved["state"][index[id(p)]]
            positions.append(position)
            position += 1
        groups.append({**settings, "params": positions})
    local.load_state_dict({"state": state, "param_groups": groups})
    if local is not optimizer:
        for group, settings in zip(optimizer.param_groups, saved["param_groups"], strict=True):
            group.update(settings)


def shard_file(rank: int) -> str:
    """Where a zero1 checkpoint keeps rank `rank`'s optimizer states (relative path)."""
    return f"{OPTIMIZER_DIR}/{rank_name(rank, '.pt')}"


def saved_states(
    training_state: dict[str, Any], directory: Path, rank: int, needed: set[int]
) -> dict[str, Any]:
    """The optimizer states of the parameters `needed` (by index) from a checkpoint, whichever
    way it holds them: one file per rank (zero1; this rank's file first) or the whole state in
    `training_state` (none)."""
    if "optimizer_shards" in training_state:
        return read_shards(directory, training_state["optimizer_shards"], rank, needed)
    whole = from_state_dict(training_state["optimizer"])
    return {"state": {i: s for i, s in whole["state"].items() if i in needed},
            "param_groups": whole["param_groups"]}  # fmt: skip


def read_shards(directory: Path, files: Sequence[str], rank: int, needed: set[int]) -> dict:
    """The states of the parameters `needed` from a checkpoint's shard files: this rank's own
    file first, the others only for what it lacks (another sharding, another partition), each
    dropped but for what is needed before the next is read."""
    order = sorted(range(len(files)), key=lambda r: r != rank)
    found: dict[str, Any] = {"state": {}, "param_groups": None}
    for r in order:
        if needed <= found["state"].keys() and found["param_groups"] is not None:
            break
        part = torch.load(directory / files[r], map_location="cpu", weights_only=False)
        found["state"].update({i: s for i, s in part["state"].items() if i in needed})
        found["param_groups"] = found["param_groups"] or part["param_groups"]
    return found
