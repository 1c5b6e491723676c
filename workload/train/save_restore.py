"""The trainer's side of checkpoints: saving a run into one (`save_checkpoint`: gathered on
rank 0, written in the background) and restoring a run from one (`choose_checkpoint`, `restore`:
rank 0 picks it; ranks whose disks lack it get their part from rank 0 over the CPU group), at
this world size or another (regrid.py). The format itself is workload/drafter/checkpoint.py.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from workload.common.layout import TRAINING_STATE, WEIGHTS_NAME, step_name
from workload.config import config_hash, diff, from_dict
from workload.drafter.checkpoint import (
    begin,
    complete,
    discard,
    latest_complete,
    remove_stale_temps,
    step_dir,
    step_of,
    verify,
)
from workload.train import sharding
from workload.train.distributed import (
    Dist,
    any_rank,
    broadcast_int,
    broadcast_tensors,
    gather_to_main,
    hand_out,
    recv_state,
    run_polled,
    send_state,
)
from workload.train.regrid import fresh_streams
from workload.train.step import Run, StepSums, reduce_sums


class CheckpointWriteError(Exception):
    """A checkpoint written in the background failed (raised at the next join)."""


class BackgroundWriter:
    """Runs one checkpoint write at a time in a thread, so the ranks train on while it writes,
    syncs and hashes. A failure is kept and raised by the next `join` (never lost)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._what = ""

    def start(self, what: str, job: Callable[[], Any]) -> None:
        """Run `job` in the background (after the previous one, whose error is raised)."""
        self.join()
        self._what = what

        def run() -> None:
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - kept for the next join
                self._error = exc

        self._thread = threading.Thread(target=run, name=f"write {what}", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def failed(self) -> bool:
        return not self.busy and self._error is not None

    def wait(self, timeout: float | None = None) -> None:
        """Wait (at most `timeout` seconds) for the write to end, raising nothing."""
        if self._thread is not None:
            self._thread.join(timeout)

    def join(self, timeout: float | None = None) -> bool:
        """Wait (at most `timeout` seconds) for the write; True when none is running any more.
        Raises CheckpointWriteError when it failed."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointWriteError(f"{self._what}: writing failed: {error}") from error
        return True


def load_training_state(directory: str | os.PathLike, map_location: Any = "cpu") -> dict[str, Any]:
    return torch.load(
        Path(directory) / TRAINING_STATE, map_location=map_location, weights_only=False
    )


# ---------------------------------------------------------------- saving a run


def _rng_state(run: Run) -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "anchors": run.anchor_gen.get_state(),
    }
    if run.device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(run.device)
    return state


def _set_rng_state(run: Run, state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    run.anchor_gen.set_state(state["anchors"])
    if run.device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], run.device)


# the log interval's sums that every rank adds once a step (the rest are totals over the ranks)
PER_RANK_SUMS = ("loss", "grad_norm", "steps")


def _fresh_rng_state(run: Run, step: int) -> None:
    """Random streams of their own for a rank the checkpoint has none for (it had fewer)."""
    noise, anchors = fresh_streams(run.cfg.seed, run.dist.rank, step)
    random.seed(noise)
    np.random.seed(noise % 2**32)
    torch.manual_seed(noise)
    run.anchor_gen.manual_seed(anchors)


CHECKPOINT_DELAY_ENV = "DFLASHOPS_TEST_CHECKPOINT_DELAY_S"  # tests: a slow disk for the writer
WRITER_POLL_S = 1.0
_IDLE, _BUSY, _FAILED = 0, 1, 2


def wait_for_writer(writer: BackgroundWriter, d: Dist) -> None:
    """Before a save, rank 0's previous checkpoint write must have ended. Rank 0 waits for it
    a second at a time and tells every rank after each second, so no rank sits in one
    collective for long, however long the write takes; a failed write fails every rank."""
    while True:
        code = _IDLE
        if d.main:
            code = _FAILED if writer.failed else _BUSY if writer.busy else _IDLE
        code = broadcast_int(code, d)
        if code == _IDLE:
            return
        if code == _FAILED:
            if d.main:
                writer.join()  # raises the writer's error
            raise CheckpointWriteError("rank 0 failed to write a checkpoint (see its output)")
        if d.main:
            writer.wait(WRITER_POLL_S)


def _cpu_copy(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cpu_copy(v) for v in obj]
    return obj


def _save_file(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path)


def save_checkpoint(
    run: Run,
    run_dir: Path,
    step: int,
    interval: StepSums,
    seconds: float,
    writer: BackgroundWriter,
) -> None:
    """Gather on rank 0 what step_<step> holds: every rank's RNG state, the log interval so far
    (summed over ranks, with its seconds) and, under zero1, every rank's optimizer shard (over
    the CPU group, one rank at a time, each written into the temporary directory as it comes).
    Rank 0 then writes the rest, syncs, hashes and renames in the background (`writer`) while
    every rank trains on; the next save waits for it."""
    d = run.dist
    wait_for_writer(writer, d)
    rngs = gather_to_main(_rng_state(run), d)
    interval = {"sums": reduce_sums(interval, run.device), "seconds": seconds}
    params = list(run.drafter.parameters())
    zero = run.sharding in sharding.SHARDED  # hybrid: every rank too (nodes hold copies)
    if not d.main:
        if zero:
            send_state(sharding.local_state(run.optimizer, params), 0, d)
        return
    tmp = begin(run_dir, step)
    try:
        if zero:
            for r in range(1, d.world):
                _save_file(recv_state(r, d), tmp / sharding.shard_file(r))
        own = (sharding.local_state(run.optimizer, params) if zero
               else _cpu_copy(run.optimizer.state_dict()))  # fmt: skip
        weights = _cpu_copy(run.drafter.state_dict())
    except BaseException:
        discard(tmp)
        raise
    state = {
        "step": step,
        "world_size": d.world,
        "sharding": run.sharding,
        "scheduler": run.scheduler.state_dict(),
        "data": run.stream.state_dict(),
        "rng": rngs,
        "interval": interval,
        "config": run.cfg.to_dict(),
        "config_hash": config_hash(run.cfg),
    }
    if zero:
        state["optimizer_shards"] = [sharding.shard_file(r) for r in range(d.world)]
    else:
        state["optimizer"] = own

    def write(directory: Path) -> None:
        time.sleep(float(os.environ.get(CHECKPOINT_DELAY_ENV, 0)))
        run.drafter.save_pretrained(directory, state_dict=weights, safe_serialization=True)
        if zero:
            _save_file(own, directory / sharding.shard_file(0))
        torch.save(state, directory / TRAINING_STATE)

    def job() -> None:
        t0 = time.monotonic()
        c = run.cfg.checkpoint
        complete(run_dir, step, tmp, write, keep_last=c.keep_last, keep_every=c.keep_every)
        print(f"checkpoint: {step_name(step)} written ({time.monotonic() - t0:.1f}s)", flush=True)

    writer.start(f"checkpoint {step_name(step)}", job)


# ---------------------------------------------------------------- resuming a run


def choose_checkpoint(run_dir: Path, d: Dist) -> Path | None:
    """Rank 0 picks its newest complete checkpoint and sends the step to every rank: that one
    is resumed, whether or not the other ranks' nodes hold a copy (`restore` sends them what
    they lack)."""
    step = -1
    if d.main:
        remove_stale_temps(run_dir)
        latest = latest_complete(run_dir)
        step = -1 if latest is None else step_of(latest)
    step = broadcast_int(step, d)
    return None if step < 0 else step_dir(run_dir, step)


def restore(run: Run, step_dir: Path, say=print) -> tuple[int, dict[str, float], float]:
    """Load model, optimizer, scheduler, data position and this rank's RNG from a checkpoint.
    A rank that sees it complete on its own disk (rank 0; every rank on shared storage or on
    rank 0's node) reads its part itself. When some rank does not (node-local disks), rank 0
    broadcasts the weights to every rank and sends each such rank its part (training state,
    RNG, the optimizer states it keeps) over the CPU group, one rank at a time. Returns the
    step, this rank's part of the log interval in progress (rank 0 holds what all ranks summed
    before the checkpoint) and the seconds that interval had run."""
    d = run.dist
    needed = sharding.indices_held(run.optimizer, list(run.drafter.parameters()))
    here = d.main or verify(step_dir, hashes=False)
    asks = gather_to_main(None if here else needed, d)
    elsewhere = any_rank(not here, d)

    def read() -> tuple[dict | None, dict | None]:
        return _read_checkpoint(step_dir, d, set(needed))

    state, part = run_polled(read if here else None, d, f"reading {step_dir.name}") or (None, None)
    if elsewhere:
        wanting = [r for r, ask in enumerate(asks or []) if ask is not None]
        if wanting:
            say(f"resume: {step_dir.name} is not on the disk of rank(s) "
                f"{', '.join(map(str, wanting))}: rank 0 sends them the weights and their state")  # fmt: skip
        _broadcast_weights(run, step_dir)

        def make(r: int) -> dict:
            return _rank_part(state, step_dir, r, set(asks[r]))

        part = hand_out(make if d.main else None, wanting, d) or part
    else:
        run.drafter.load_state_dict(load_file(str(step_dir / WEIGHTS_NAME), device=str(run.device)))
    state = None  # rank 0's copy of what it sent
    return _apply_part(run, part, step_dir, say)


def _read_checkpoint(step_dir: Path, d: Dist, needed: set[int]) -> tuple[dict | None, dict]:
    """(the training state, on rank 0 only: it sends the other ranks theirs; this rank's part)."""
    state = load_training_state(step_dir)
    return (state if d.main else None), _rank_part(state, step_dir, d.rank, needed)


def _rank_part(state: dict, step_dir: Path, rank: int, needed: set[int]) -> dict:
    """What rank `rank` restores from the training state: all but the other ranks' RNG states
    (its own: None when the checkpoint had fewer ranks), and the optimizer states of the
    parameters `needed` (by index), wherever they are saved (any world size: regrid.py)."""
    part = {k: v for k, v in state.items() if k not in ("rng", "optimizer", "optimizer_shards")}
    part["rng"] = state["rng"][rank] if rank < len(state["rng"]) else None
    part["optimizer"] = sharding.saved_states(state, step_dir, rank, needed)
    return part


def _broadcast_weights(run: Run, step_dir: Path) -> None:
    """Rank 0 reads the weights (the others hear from it every second meanwhile) and
    broadcasts them, in pieces: every rank ends with rank 0's weights, bit for bit."""
    d = run.dist

    def read() -> dict[str, torch.Tensor]:
        return load_file(str(step_dir / WEIGHTS_NAME), device=str(run.device))

    weights = run_polled(read if d.main else None, d, f"reading {step_dir.name}'s weights")
    if d.main:
        run.drafter.load_state_dict(weights)
    del weights
    with torch.no_grad():
        broadcast_tensors(list(run.drafter.state_dict().values()), d)


def _apply_part(
    run: Run, part: dict, step_dir: Path, say=print
) -> tuple[int, dict[str, float], float]:
    """Load a rank's part of a checkpoint (all but the weights) into the run."""
    saved_sharding = part.get("sharding", "none")
    saved = from_dict(part["config"], name=str(step_dir))
    changed = diff(saved, run.cfg)
    if changed:
        say("resume: config differs from the checkpoint's: " + ", ".join(
            f"{k} {a!r} -> {b!r}" for k, a, b in changed))  # fmt: skip
    sharding.load_state(run.optimizer, list(run.drafter.parameters()), part["optimizer"])
    if saved_sharding != run.sharding:
        say(
            f"resume: optimizer states of dist.sharding {saved_sharding} loaded into {run.sharding}"
        )
    run.scheduler.load_state_dict(part["scheduler"])
    run.stream.load_state_dict(part["data"])
    if part["rng"] is not None:
        _set_rng_state(run, part["rng"])
    else:
        _fresh_rng_state(run, int(part["step"]))
    saved_interval = part.get("interval") or {}
    if "sums" not in saved_interval:  # older checkpoints: rank 0's own sums, no seconds
        saved_interval = {"sums": saved_interval if run.dist.world == 1 else {}, "seconds": 0.0}
    interval = dict(saved_interval["sums"]) if run.dist.main else {}
    saved_world = int(part.get("world_size", run.dist.world))
    for key in PER_RANK_SUMS if saved_world != run.dist.world else ():
        if key in interval:  # summed over the ranks then: counted in this world's ranks
            interval[key] *= run.dist.world / saved_world
    return int(part["step"]), interval, float(saved_interval["seconds"])
