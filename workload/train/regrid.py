"""Resuming at another world size: the global batch kept, the move said and logged.

A checkpoint's data position is global (rows of the concatenated epochs, the same on every
rank), its optimizer states are keyed by parameter index (any partition reads them:
train/sharding.py) and its weights are whole, so only three things depend on the number of
ranks: the rows a step takes (batch_size x world x grad_accum), each rank's random streams,
and the log interval's sums. `regrid` runs before the run is built: when the newest checkpoint
was written by another number of ranks and the run asks for the checkpoint's own grad_accum,
it scales grad_accum so that a step takes the same rows (2 ranks at 1 -> 1 rank at 2), or
names the change when no whole number does. The ranks the checkpoint has no random streams
for start their own (`fresh_streams`), drawn from (seed, rank, step).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from workload.common.layout import TRAINING_STATE
from workload.config import RunConfig
from workload.drafter.checkpoint import latest_complete
from workload.train.distributed import Dist, broadcast_object


@dataclass(frozen=True)
class Move:
    """A resume at another world size, as the first log line after it records it."""

    step: int
    from_world: int
    world: int
    from_rows: int  # rows a step took before (batch_size x world x grad_accum)
    rows: int  # rows a step takes now
    grad_accum: int

    def log_keys(self) -> dict[str, int]:
        return {"resumed_at": self.step, "from_world_size": self.from_world,
                "world_size": self.world, "grad_accum": self.grad_accum,
                "rows_per_step": self.rows}  # fmt: skip


def saved_grid(run_dir: Path, d: Dist) -> dict | None:
    """Rank 0 reads the newest complete checkpoint's step, world size and batch settings
    (memory-mapped: the optimizer states are not read) and every rank hears them; None when
    there is no checkpoint."""
    grid = None
    if d.main:
        latest = latest_complete(run_dir)
        if latest is not None:
            state = torch.load(latest / TRAINING_STATE, map_location="cpu", mmap=True,
                               weights_only=False)  # fmt: skip
            optim = state["config"]["optim"]
            grid = {"step": int(state["step"]), "world": int(state["world_size"]),
                    "batch_size": int(optim["batch_size"]),
                    "grad_accum": int(optim["grad_accum"])}  # fmt: skip
            del state
    return broadcast_object(grid, d)


def regrid(cfg: RunConfig, run_dir: Path, d: Dist, say=print) -> Move | None:
    """Set cfg.optim.grad_accum for a resume at another world size (see the module doc) and
    return the move; None when the checkpoint's world size is this run's (or none exists)."""
    grid = saved_grid(run_dir, d)
    if grid is None or grid["world"] == d.world:
        return None
    o = cfg.optim
    before = grid["batch_size"] * grid["world"] * grid["grad_accum"]
    per_micro = o.batch_size * d.world
    if o.grad_accum == grid["grad_accum"] and before % per_micro == 0:
        o.grad_accum = before // per_micro
    rows = per_micro * o.grad_accum
    head = (f"resume: step_{grid['step']} was written by {grid['world']} rank(s), this run has "
            f"{d.world}")  # fmt: skip
    if rows == before:
        say(f"{head}: optim.grad_accum {grid['grad_accum']} -> {o.grad_accum} keeps the global "
            f"batch of {rows} rows a step; optimizer states resharded, data position kept")  # fmt: skip
    else:
        say(f"{head}: the global batch changes from {before} to {rows} rows a step (no whole "
            f"optim.grad_accum keeps it at batch_size {o.batch_size}); the data position is kept")  # fmt: skip
    return Move(grid["step"], grid["world"], d.world, before, rows, o.grad_accum)


def fresh_streams(seed: int, rank: int, step: int) -> tuple[int, int]:
    """(noise, anchors) seeds for a rank the checkpoint has no random streams for."""
    noise, anchors = np.random.SeedSequence([seed, rank, step, 2]).generate_state(2, np.uint64)
    return int(noise), int(anchors)
