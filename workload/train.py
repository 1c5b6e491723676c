"""`python -m workload.train --config RUN.yaml --run-dir DIR [--resume] [--set key=value]...`

Trains a DFlash drafter against a frozen target, online, in one process per device. Per step:
batch -> frozen target forward (hidden states, no grad) -> teacher labels from the final logits
-> features of the configured target layers -> uniform noise on the fc inputs only -> drafter
over all anchor blocks -> logits through the target's frozen lm_head (chunked) -> loss ->
backward -> clip -> AdamW -> cosine schedule with warmup.

One process on CPU and `torchrun --nproc_per_node 8` (or multi-node through torchrun's
rendezvous) are the same code path: a process group (gloo on CPU, nccl on GPU, with an explicit
timeout) and DDP over the drafter only, whose AdamW states are sharded over the ranks (ZeRO-1)
when there are several; the frozen target is replicated on every rank, loaded straight onto its
device. Rank 0 writes the run directory: train_log.jsonl, state.json, audit.json,
resolved.yaml, checkpoints/ (written in the background while the ranks train on); every rank
keeps ranks/rank_<R>.json (a heartbeat) and, but rank 0, ranks/rank_<R>.log (its output).
SIGINT/SIGTERM (to rank 0 alone is enough) finish the current step on every rank, save a
checkpoint and exit 0; a second signal exits now.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from workload import checkpoint as ckpt
from workload import plan, sharding
from workload.config import (
    PACKED_ATTENTION,
    ConfigError,
    RunConfig,
    TargetFacts,
    audit,
    audit_errors,
    audit_json,
    config_hash,
    diff,
    dump,
    from_dict,
    load_config,
    recipe_layer_ids,
)
from workload.data import BatchStream, DataError, load_examples
from workload.distributed import (
    Dist,
    DistSetupError,
    any_rank,
    broadcast_int,
    broadcast_object,
    broadcast_tensors,
    gather_to_main,
    hand_out,
    init_distributed,
    recv_state,
    run_polled,
    send_state,
)
from workload.metrics import finalize
from workload.model import (
    WEIGHTS_NAME,
    DFlashDrafter,
    build_drafter_config,
    checkpointing_on,
    default_target_layer_ids,
)
from workload.rank_files import Heartbeat, env_rank, process_start_ticks, redirect_output
from workload.step import SUM_KEYS, DrafterStep, StepSums, noise_std, train_step
from workload.targets import embedding_rows, load_target, text_config

LOG_NAME = "train_log.jsonl"
STATE_NAME = "state.json"
clock = time.monotonic  # seconds of a log interval (tests replace it)


class UsageError(Exception):
    """Bad input found at start (config, run dir, target): one line, exit code 2."""


# ---------------------------------------------------------------- the run's pieces


@dataclass
class Run:
    cfg: RunConfig
    dist: Dist
    target: nn.Module
    drafter: DFlashDrafter
    ddp: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    stream: BatchStream
    anchor_gen: torch.Generator
    layer_ids: list[int]  # every configured target layer id
    fc_ids: list[int]  # the ones the drafter reads
    total_steps: int
    hybrid: bool
    sharding: str = "none"  # of the optimizer: none | zero1
    timing: bool = False
    times: dict[str, float] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.dist.device


def target_facts(target: nn.Module, tokenizer: Any) -> TargetFacts:
    eos = target.config.eos_token_id if hasattr(target.config, "eos_token_id") else None
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    eos_ids.add(tokenizer.eos_token_id)
    return TargetFacts(
        num_layers=text_config(target.config).num_hidden_layers,
        embedding_rows=embedding_rows(target),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_ids=tuple(sorted(i for i in eos_ids if i is not None)),
    )


def resolve_target_settings(cfg: RunConfig, facts: TargetFacts, tokenizer: Any) -> None:
    """Fill what null means in the config: the mask token (the start drafter's, else the
    tokenizer's) and the layer ids (from the target)."""
    d = cfg.drafter
    if d.mask_token_id is None and d.init_from:
        d.mask_token_id = start_drafter_mask(d.init_from)
    if d.mask_token_id is None:
        d.mask_token_id = getattr(tokenizer, "mask_token_id", None)
    if d.target_layer_ids is None:
        n = len(recipe_layer_ids(facts.num_layers))
        d.target_layer_ids = default_target_layer_ids(facts.num_layers, n)


def is_hybrid(target: nn.Module) -> bool:
    return "linear_attention" in (getattr(text_config(target.config), "layer_types", None) or [])


def start_drafter_mask(init_from: str) -> int | None:
    """The mask token in the start drafter's config.json (None when it has none)."""
    path = Path(init_from) / "config.json"
    try:
        config = json.loads(path.read_text())
    except OSError as exc:
        raise UsageError(f"drafter.init_from: {path}: {exc.strerror}") from None
    except ValueError:
        raise UsageError(f"drafter.init_from: {path}: not valid JSON") from None
    return (config.get("dflash_config") or {}).get("mask_token_id", config.get("mask_token_id"))


def init_mismatches(cfg: RunConfig, drafter: DFlashDrafter, fc_ids: list[int]) -> list[str]:
    """The drafter settings of the config that the start drafter does not have."""
    d, c = cfg.drafter, drafter.config
    types = list(d.layer_types or ["full_attention"] * d.num_layers)
    start_types = list(getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers)
    window = d.sliding_window if "sliding_attention" in types else None
    start_window = c.sliding_window if "sliding_attention" in start_types else None
    pairs = [
        ("target_layer_ids (fc inputs)", fc_ids, drafter.target_layer_ids),
        ("block_size", d.block_size, drafter.block_size),
        ("num_layers", d.num_layers, c.num_hidden_layers),
        ("layer_types", types, start_types),
        ("sliding_window", window, start_window),
        ("mask_token_id", d.mask_token_id, drafter.mask_token_id),
    ]
    if d.intermediate_size is not None:
        pairs.append(("intermediate_size", d.intermediate_size, c.intermediate_size))
    return [f"drafter.{key} {want!r} (start drafter: {got!r})"
            for key, want, got in pairs if want != got]  # fmt: skip


def build_drafter(cfg: RunConfig, target: nn.Module, fc_ids: list[int]) -> DFlashDrafter:
    d = cfg.drafter
    if d.init_from:
        start_drafter_mask(d.init_from)  # a missing or broken config.json: one line
        drafter = DFlashDrafter.from_pretrained(d.init_from, dtype=torch.float32)
        if drafter.mask_token_id is None:  # e.g. a SpecForge init config: take the config's
            drafter.mask_token_id = d.mask_token_id
            drafter.config.dflash_config = {
                **(getattr(drafter.config, "dflash_config", None) or {}),
                "mask_token_id": d.mask_token_id,
            }
        wrong = init_mismatches(cfg, drafter, fc_ids)
        if wrong:
            raise UsageError(
                f"drafter.init_from: {d.init_from} does not match the config: {'; '.join(wrong)}; "
                "set these keys to the start drafter's values"
            )
        return drafter
    config = build_drafter_config(
        target.config,
        num_layers=d.num_layers,
        block_size=d.block_size,
        mask_token_id=d.mask_token_id,
        target_layer_ids=fc_ids,
        layer_types=d.layer_types,
        sliding_window=d.sliding_window,
        intermediate_size=d.intermediate_size,
    )
    return DFlashDrafter(config).float()


def lr_lambda(total_steps: int, warmup_ratio: float, min_ratio: float):
    warmup = math.ceil(warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def count_steps(cfg: RunConfig, stream: BatchStream, world: int) -> int:
    o = cfg.optim
    steps = [o.max_steps] if o.max_steps is not None else []
    if o.epochs is not None:
        rows_per_step = o.batch_size * world * o.grad_accum
        steps.append(max(1, math.ceil(o.epochs * stream.rows_per_epoch / rows_per_step)))
    return min(steps)


def _load_target(cfg: RunConfig, d: Dist) -> tuple[nn.Module, Any]:
    """load_target, with a missing or unloadable target as one line (UsageError)."""
    try:
        return load_target(
            cfg.target.path,
            dtype=cfg.target.dtype,
            device=d.device,
            attn_implementation=cfg.target.attn_implementation,
        )
    except (OSError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if not first.startswith("target.path"):
            first = f"target.path: {cfg.target.path}: cannot load the target: {first}"
        raise UsageError(first) from None


def rank_seeds(seed: int, rank: int) -> tuple[int, int]:
    """(noise, anchors) seeds of a rank: independent streams for every (seed, rank, use)."""
    noise, anchors = np.random.SeedSequence([seed, rank]).generate_state(2, dtype=np.uint64)
    return int(noise), int(anchors)


def attention_of(target: nn.Module) -> str | None:
    """The attention implementation the target's (text) layers run."""
    return getattr(text_config(target.config), "_attn_implementation", None)


def setup(
    cfg: RunConfig,
    d: Dist,
    *,
    say=print,
    target: nn.Module | None = None,
    tokenizer: Any = None,
    examples: list | None = None,
) -> tuple[Run, list]:
    """Load the target and data (unless given), build drafter, optimizer and schedule, and run
    the recipe audit (UsageError on its errors). Returns the run and the audit items."""
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    wanted = cfg.target.attn_implementation if target is None else attention_of(target)
    if wanted == "flex_attention" and d.device.type == "cpu":
        raise UsageError(
            "target.attn_implementation: flex_attention is not supported on CPU (transformers' "
            "flex path there fails in inductor's C++ compile or returns NaN with torch 2.13); "
            "use sdpa or eager, or run on a GPU"
        )
    if target is None:
        target, tokenizer = _load_target(cfg, d)
    facts = target_facts(target, tokenizer)
    resolve_target_settings(cfg, facts, tokenizer)
    items = audit(cfg, facts)
    errors = audit_errors(items)
    if errors:
        raise UsageError("; ".join(f"{e.key}: {e.note}" for e in errors))
    hybrid = is_hybrid(target)
    attn = attention_of(target)
    if cfg.data.pack and attn not in PACKED_ATTENTION:
        raise UsageError(
            f"data.pack: true with the target's attention {attn!r} is not supported (documents "
            f"could see each other); use target.attn_implementation {' or '.join(PACKED_ATTENTION)}"
        )
    if hybrid and cfg.data.pack:
        raise UsageError(
            "data.pack: true is not supported for hybrid (linear-attention) targets: documents "
            "would leak through the recurrent state; set data.pack: false"
        )
    layer_ids = list(cfg.drafter.target_layer_ids)
    fc_ids = layer_ids[:-1] if cfg.drafter.fc_layers == "all_but_last" else layer_ids
    say(f"target: {cfg.target.path} ({facts.num_layers} layers, {facts.embedding_rows} rows)")
    if examples is None:
        try:
            examples = load_examples(
                cfg.data.path,
                tokenizer,
                max_length=cfg.data.max_length,
                chat_template=cfg.data.chat_template,
            )
        except DataError as exc:
            raise UsageError(str(exc)) from None
    stream = BatchStream(
        examples,
        batch_size=cfg.optim.batch_size,
        seq_len=cfg.data.max_length,
        pack=cfg.data.pack,
        seed=cfg.data.seed,
        rank=d.rank,
        world_size=d.world,
        pad_id=getattr(tokenizer, "pad_token_id", None) or 0,
    )
    torch.manual_seed(cfg.seed)  # the same initial drafter on every rank
    drafter = build_drafter(cfg, target, fc_ids).to(d.device)
    drafter.train()
    drafter.checkpoint_layers = checkpointing_on(
        cfg.drafter.activation_checkpointing, d.device.type
    )
    step_module = DrafterStep(drafter)
    ddp = DistributedDataParallel(
        step_module,
        device_ids=[d.device.index] if d.device.type == "cuda" else None,
        gradient_as_bucket_view=True,  # the gradients live in DDP's buckets: no second copy
    )
    o = cfg.optim
    mode = sharding.resolve_sharding(cfg.dist.sharding, d.world)
    optimizer = sharding.build_optimizer(list(drafter.parameters()), o, mode, d.device)
    total = count_steps(cfg, stream, d.world)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(total, o.warmup_ratio, o.min_lr / o.lr)
    )
    # per-rank streams of randomness: anchors on the CPU generator, noise on the device's
    noise_seed, anchor_seed = rank_seeds(cfg.seed, d.rank)
    torch.manual_seed(noise_seed)
    anchor_gen = torch.Generator().manual_seed(anchor_seed)
    say(
        f"drafter: {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, "
        f"reads layers {fc_ids}, mask {cfg.drafter.mask_token_id}, {total} steps, "
        f"{d.world} rank(s) on {d.device.type}, optimizer sharding {mode}"
    )
    run = Run(
        cfg, d, target, drafter, ddp, optimizer, scheduler, stream, anchor_gen,
        layer_ids, fc_ids, total, hybrid, sharding=mode,
    )  # fmt: skip
    return run, items


# ---------------------------------------------------------------- run directory files


class RunState:
    """`state.json`: merged with what is there (the launcher may add keys), replaced atomically."""

    def __init__(self, run_dir: Path, enabled: bool) -> None:
        self.path = run_dir / STATE_NAME
        self.enabled = enabled

    def read(self) -> dict[str, Any]:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def update(self, **values: Any) -> None:
        if self.enabled:
            ckpt.write_json_atomic(self.path, {**self.read(), **values})


class MetricLog:
    """train_log.jsonl: one JSON object a line, flushed at once; rank 0 only."""

    def __init__(self, run_dir: Path, enabled: bool) -> None:
        self.path = run_dir / LOG_NAME
        self.enabled = enabled
        self.file = self.path.open("a") if enabled else None

    def write(self, record: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def truncate_log(path: Path, last_step: int) -> None:
    """Keep only the lines up to `last_step` (resuming rewinds the log to the checkpoint)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


class Wandb:
    """W&B logging of the same keys when log.wandb.project is set (rank 0 only)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, enabled: bool, run_id: str | None) -> None:
        self.run = None
        w = cfg.log.wandb
        if not (enabled and w.project):
            return
        import wandb

        self.run = wandb.init(
            project=w.project,
            entity=w.entity,
            name=w.name or run_dir.name,
            mode=w.mode,
            dir=str(run_dir),
            config=cfg.to_dict(),
            id=run_id,
            resume="allow",
        )

    @property
    def location(self) -> tuple[str | None, str | None]:
        """(run id, URL or, offline, the local run directory)."""
        if self.run is None:
            return None, None
        url = getattr(self.run, "url", None)
        return self.run.id, url or str(Path(self.run.dir).parent)

    def log(self, record: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in record.items() if k not in ("step", "time")},
                         step=record["step"])  # fmt: skip

    def finish(self, exit_code: int) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)


# ---------------------------------------------------------------- stop requests


class StopFlag:
    """SIGINT/SIGTERM ask for a clean stop at the end of the step; a second one exits now.
    The previous handlers come back on `restore()` (the trainer may run inside a test)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            os._exit(128 + signum)
        self.requested = True
        name = signal.Signals(signum).name
        print(f"received {name}: stopping after this step (again to exit now)", flush=True)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def reduce_sums(sums: StepSums | Mapping[str, float], device: torch.device) -> dict[str, float]:
    """Sums over ranks, on the host: one all_reduce of the stacked sums, one transfer."""
    if not isinstance(sums, StepSums):
        sums = StepSums(device, sums)
    total = sums.values.clone()  # the interval goes on (a checkpoint reduces it mid-way)
    dist.all_reduce(total)
    return dict(zip(SUM_KEYS, total.tolist(), strict=True))


# ---------------------------------------------------------------- checkpoints


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


CHECKPOINT_DELAY_ENV = "DFLASHOPS_TEST_CHECKPOINT_DELAY_S"  # tests: a slow disk for the writer
WRITER_POLL_S = 1.0
_IDLE, _BUSY, _FAILED = 0, 1, 2


def wait_for_writer(writer: ckpt.BackgroundWriter, d: Dist) -> None:
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
            raise ckpt.CheckpointWriteError("rank 0 failed to write a checkpoint (see its output)")
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
    writer: ckpt.BackgroundWriter,
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
    zero = run.sharding == "zero1"
    if not d.main:
        if zero:
            send_state(sharding.local_state(run.optimizer, params), 0, d)
        return
    tmp = ckpt.begin(run_dir, step)
    try:
        if zero:
            for r in range(1, d.world):
                _save_file(recv_state(r, d), tmp / sharding.shard_file(r))
        own = (sharding.local_state(run.optimizer, params) if zero
               else _cpu_copy(run.optimizer.state_dict()))  # fmt: skip
        weights = _cpu_copy(run.drafter.state_dict())
    except BaseException:
        ckpt.discard(tmp)
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
        torch.save(state, directory / ckpt.TRAINING_STATE)

    def job() -> None:
        t0 = time.monotonic()
        c = run.cfg.checkpoint
        ckpt.complete(run_dir, step, tmp, write, keep_last=c.keep_last, keep_every=c.keep_every)
        print(f"checkpoint: step_{step} written ({time.monotonic() - t0:.1f}s)", flush=True)

    writer.start(f"checkpoint step_{step}", job)


def choose_checkpoint(run_dir: Path, d: Dist) -> Path | None:
    """Rank 0 picks its newest complete checkpoint and sends the step to every rank: that one
    is resumed, whether or not the other ranks' nodes hold a copy (`restore` sends them what
    they lack)."""
    step = -1
    if d.main:
        ckpt.remove_stale_temps(run_dir)
        latest = ckpt.latest_complete(run_dir)
        step = -1 if latest is None else ckpt.step_of(latest)
    step = broadcast_int(step, d)
    return None if step < 0 else ckpt.step_dir(run_dir, step)


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
    here = d.main or ckpt.verify(step_dir, hashes=False)
    asks = gather_to_main(None if here else needed, d)
    elsewhere = any_rank(not here, d)

    def read() -> tuple[dict | None, dict | None]:
        return _read_checkpoint(step_dir, d, set(needed))

    state, part = run_polled(read if here else None, d, f"reading {step_dir.name}") or (None, None)
    refusal = broadcast_object(_world_refusal(state, run, step_dir) if d.main else None, d)
    if refusal:
        raise UsageError(refusal)
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
        from safetensors.torch import load_file

        run.drafter.load_state_dict(load_file(str(step_dir / WEIGHTS_NAME), device=str(run.device)))
    state = None  # rank 0's copy of what it sent
    return _apply_part(run, part, step_dir, say)


def _read_checkpoint(step_dir: Path, d: Dist, needed: set[int]) -> tuple[dict | None, dict | None]:
    """(the training state, on rank 0 only: it sends the other ranks theirs; this rank's part,
    None when the checkpoint has another world size)."""
    state = ckpt.load_training_state(step_dir)
    part = _rank_part(state, step_dir, d.rank, needed) if state["world_size"] == d.world else None
    return (state if d.main else None), part


def _rank_part(state: dict, step_dir: Path, rank: int, needed: set[int]) -> dict:
    """What rank `rank` restores from the training state: all but the other ranks' RNG states,
    and the optimizer states of the parameters `needed` (by index), wherever they are saved."""
    part = {k: v for k, v in state.items() if k not in ("rng", "optimizer", "optimizer_shards")}
    part["rng"] = state["rng"][rank]
    part["optimizer"] = sharding.saved_states(state, step_dir, rank, needed)
    return part


def _world_refusal(state: dict | None, run: Run, step_dir: Path) -> str | None:
    """Rank 0's refusal of a checkpoint written by another number of ranks (the data order and
    RNG streams are per rank), else None."""
    if state is None or state["world_size"] == run.dist.world:
        return None
    return (
        f"resume: {step_dir.name} was written by {state['world_size']} ranks (dist.sharding "
        f"{state.get('sharding', 'none')}) and this run has {run.dist.world} (dist.sharding "
        f"{run.sharding}): resume with {state['world_size']} processes, or start a new run "
        "from its weights with drafter.init_from"
    )


def _broadcast_weights(run: Run, step_dir: Path) -> None:
    """Rank 0 reads the weights (the others hear from it every second meanwhile) and
    broadcasts them, in pieces: every rank ends with rank 0's weights, bit for bit."""
    from safetensors.torch import load_file

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
    _set_rng_state(run, part["rng"])
    saved_interval = part.get("interval") or {}
    if "sums" not in saved_interval:  # older checkpoints: rank 0's own sums, no seconds
        saved_interval = {"sums": saved_interval if run.dist.world == 1 else {}, "seconds": 0.0}
    interval = dict(saved_interval["sums"]) if run.dist.main else {}
    return int(part["step"]), interval, float(saved_interval["seconds"])


# ---------------------------------------------------------------- the loop


def log_record(
    run: Run, step: int, interval: StepSums, seconds: float, lr: float
) -> dict[str, Any]:
    sums = reduce_sums(interval, run.device)
    rank_steps = max(sums["steps"], 1.0)  # steps of the interval x ranks
    record: dict[str, Any] = {
        "step": step,
        "time": time.time(),
        "loss": sums["loss"] / rank_steps,
    }
    record.update(finalize(sums))
    record.update(
        lr=lr,
        noise=noise_std(run.cfg, step - 1),
        epoch=run.stream.epoch,
        grad_norm=sums["grad_norm"] / rank_steps,
        tok_s=sums.get("tokens", 0.0) / max(seconds, 1e-9),
    )
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in record.items()}


def progress_line(r: dict[str, Any], total: int) -> str:
    def f(key: str, fmt: str) -> str:
        v = r.get(key)
        return "-" if v is None else format(v, fmt)

    return (
        f"step {r['step']}/{total} loss {f('loss', '.4f')} acc {f('acc', '.3f')} "
        f"streak {f('streak', '.2f')} dds8 {f('dds8', '.2f')} lr {f('lr', '.2e')} "
        f"noise {f('noise', '.3f')} gnorm {f('grad_norm', '.2f')} tok/s {f('tok_s', '.0f')} "
        f"epoch {f('epoch', '.2f')}"
    )


def train(
    cfg: RunConfig, run_dir: Path, *, resume: bool = False, stop_after: int | None = None
) -> int:
    """Run (or resume) training in `run_dir`; returns the exit code (0 also when stopped).
    `stop_after`: stop (with a checkpoint) after this step, as if asked to."""
    owns_group = not dist.is_initialized()
    stop = StopFlag()
    beat: Heartbeat | None = None
    status, exit_code = "failed", 1
    try:
        d = init_distributed(cfg.dist)
        used = d.main and (run_dir / LOG_NAME).exists() and not resume
        if any_rank(used, d):  # rank 0's file system decides, every rank stops
            raise UsageError(
                f"{run_dir / LOG_NAME} exists: this run directory was used; "
                "pass --resume to continue it, or choose a new --run-dir"
            )
        beat = Heartbeat(run_dir, d.rank, d.local_rank, d.world)
        beat.update(status="starting")
        state = RunState(run_dir, d.main)
        if d.main:
            run_dir.mkdir(parents=True, exist_ok=True)
            state.update(pid=os.getpid(), pid_start=process_start_ticks(), started=time.time(),
                         finished=None, exit_code=None, status="starting",
                         world_size=d.world)  # fmt: skip
        try:
            status = _train(cfg, run_dir, resume, d, state, stop, stop_after, beat)
        except UsageError:
            state.update(status="failed", finished=time.time(), exit_code=2)
            raise
        except BaseException:
            state.update(status="failed", finished=time.time(), exit_code=1)
            raise
        state.update(status=status, finished=time.time(), exit_code=0)
        exit_code = 0
        return 0
    except (UsageError, DistSetupError):
        exit_code = 2
        raise
    finally:
        if beat is not None:
            beat.update(status=status if exit_code == 0 else "failed", exit_code=exit_code)
        stop.restore()
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _train(
    cfg: RunConfig,
    run_dir: Path,
    resume: bool,
    d: Dist,
    state: RunState,
    stop: StopFlag,
    stop_after: int | None,
    beat: Heartbeat,
) -> str:
    def say(msg: str) -> None:
        if d.main:
            print(msg, flush=True)

    via = os.environ.get("GLOO_SOCKET_IFNAME") or "the default interface"
    print(f"rank {d.rank}/{d.world}: pid {os.getpid()} on {socket.gethostname()}, device "
          f"{d.device}, collectives on {via}", flush=True)  # fmt: skip

    run, items = setup(cfg, d, say=say)
    for item in items:
        say(f"recipe audit: {item.line()}")
    if not items:
        say("recipe audit: every setting matches the recipe")
    if d.main:
        ckpt.write_json_atomic(run_dir / "audit.json", audit_json(items))
        dump(cfg, run_dir / "resolved.yaml")
        memory = plan.estimate(cfg, run.target.config, d.world, device=d.device.type,
                               gpu_memory=plan.device_memory(d.device))  # fmt: skip
        for line in memory.lines():
            say(f"memory plan: {line}")
        ckpt.write_json_atomic(run_dir / "plan.json", memory.to_json())

    step, interval, elapsed = 0, {}, 0.0
    if resume:
        latest = choose_checkpoint(run_dir, d)
        if latest is None:
            say("resume: no complete checkpoint; starting at step 0")
        else:
            step, interval, elapsed = restore(run, latest, say=say)
            say(f"resume: restored {latest} (step {step})")
        if d.main:
            truncate_log(run_dir / LOG_NAME, step)
    log = MetricLog(run_dir, d.main)
    wb = Wandb(cfg, run_dir, d.main, state.read().get("wandb_id") if resume else None)
    wandb_id, wandb_url = wb.location
    state.update(
        status="running", last_step=step, total_steps=run.total_steps, wandb_id=wandb_id,
        wandb_url=wandb_url,
    )  # fmt: skip
    beat.update(status="running", step=step)
    if wandb_url:
        say(f"wandb: {wandb_url}")

    status, exit_code = "finished", 1
    t_interval = clock() - elapsed
    writer = ckpt.BackgroundWriter()  # rank 0's checkpoint writes
    interval = StepSums(d.device, interval)
    try:
        while step < run.total_steps:
            loss, grad_norm, lr = train_step(run, step, interval)
            step += 1
            for key, value in (("loss", loss), ("grad_norm", grad_norm), ("steps", 1.0)):
                interval.add(key, value)
            last = step == run.total_steps
            if step == 1 or step % cfg.log.log_every == 0 or last:
                record = log_record(run, step, interval, clock() - t_interval, lr)
                log.write(record)
                wb.log(record)
                say(progress_line(record, run.total_steps))
                state.update(last_step=step)
                beat.update(step=step)
                interval, t_interval = StepSums(d.device), clock()
            stopping = any_rank(stop.requested or step == stop_after, d)
            if step % cfg.checkpoint.every == 0 or last or stopping:
                save_checkpoint(run, run_dir, step, interval, clock() - t_interval, writer)
                say(f"checkpoint: step_{step} saving")
            if stopping:
                status = "stopped"
                say(f"stopped at step {step} on request")
                break
        writer.join()  # the last checkpoint is complete before the run says it ended
        exit_code = 0
    finally:
        writer.wait()  # a write in flight completes even when the run fails
        log.close()
        wb.finish(exit_code)
        state.update(last_step=step)
    return status


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m workload.train", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="run config (YAML)")
    p.add_argument("--run-dir", required=True, help="where logs, state and checkpoints go")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                   help="stop after this step with a checkpoint, as if asked to (resumable)")  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set loss.gamma=7 (YAML-typed)")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        redirect_output(Path(args.run_dir), env_rank()[0])
    except OSError as exc:
        print(f"error: --run-dir {args.run_dir}: cannot write this rank's log: {exc.strerror}",
              file=sys.stderr, flush=True)  # fmt: skip
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # console.log gets progress lines, not tqdm bars
    try:
        cfg = load_config(args.config, args.set)
        return train(cfg, Path(args.run_dir), resume=args.resume, stop_after=args.stop_after)
    except (ConfigError, UsageError, DistSetupError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
