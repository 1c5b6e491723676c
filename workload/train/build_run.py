"""A run's pieces from its config: the frozen target, the drafter (new or `drafter.init_from`),
DDP, the optimizer (replicated or ZeRO-1) and its schedule, the batch stream, the per-rank
random streams; with the recipe audit and the refusals that need the loaded target.

`setup(cfg, dist)` returns the `Run` (step.py) and the audit items; bad input is `UsageError`.
"""

from __future__ import annotations

import json
import math
import random
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from workload.common.parallel_rules import resolve_grad_comm, resolve_sharding
from workload.config import (
    PACKED_ATTENTION,
    RunConfig,
    TargetFacts,
    UsageError,
    audit,
    audit_errors,
    recipe_layer_ids,
)
from workload.data.batches import BatchStream
from workload.drafter.model import (
    DFlashDrafter,
    build_drafter_config,
    checkpointing_on,
    default_target_layer_ids,
)
from workload.drafter.targets import embedding_rows, load_target, text_config
from workload.plan.memory import anchors_per_row
from workload.train import comm, sharding
from workload.train.distributed import Dist, node_group
from workload.train.run_data import length_item, load_data, open_data_source, streams
from workload.train.step import DrafterStep, Run


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


def resolve_fc_precision(value: str, device: str) -> str:
    """optim.fc_precision: auto is TF32 on CUDA (within bench/gpu_fc_precision.py's bar, bf16
    is not: it rounds the training noise away), fp32 elsewhere; TF32 exists on CUDA only."""
    if value == "auto":
        return "tf32" if device == "cuda" else "fp32"
    return "fp32" if value == "tf32" and device != "cuda" else value


def set_fc_precision(drafter: DFlashDrafter, value: str, device: str) -> str:
    """The fc's precision as resolved: bf16 lets autocast cast it (project_context keeps it in
    fp32 otherwise); tf32 turns on TF32 for the process's fp32 CUDA matmuls, forward and
    backward (under autocast the fc is the one fp32 matmul of a step)."""
    fc = resolve_fc_precision(value, device)
    drafter.fc_autocast = fc == "bf16"
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = fc == "tf32"
    return fc


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
        num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads,
        head_dim=d.head_dim,
    )
    return DFlashDrafter(config).float()


def flex_pad_to(cfg: RunConfig) -> tuple[int, int]:
    """The most context rows and block queries a row of this run has (what flex pads to)."""
    return cfg.data.max_length, anchors_per_row(cfg) * cfg.drafter.block_size


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


def val_seed(seed: int, rank: int) -> int:
    """The seed of a rank's anchors over the holdout (the same at every pass)."""
    return int(np.random.SeedSequence([seed, rank, 1]).generate_state(1, dtype=np.uint64)[0])


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
    run_dir: Path | None = None,
) -> tuple[Run, list]:
    """Load the target and data (unless given), build drafter, optimizer and schedule, and run
    the recipe audit (UsageError on its errors). Returns the run and the audit items.
    `examples` (tests, benches) are trained on as given, with no holdout; else data.path is
    read through its token store (run_data.py), which `run_dir` may hold."""
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
    # the data is checked before the target loads: a refusal should not wait for a 27B load
    source, data_facts = open_data_source(cfg) if examples is None else (None, None)
    if target is None:
        target, tokenizer = _load_target(cfg, d)
    facts = target_facts(target, tokenizer)
    resolve_target_settings(cfg, facts, tokenizer)
    items = audit(cfg, facts, data_facts)
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
    pad_id = getattr(tokenizer, "pad_token_id", None) or 0
    holdout = None
    if source is not None:
        data = load_data(cfg, d, source, tokenizer, run_dir, say=say)
        items.append(length_item(data.store))
        stream, holdout = streams(cfg, d, data, pad_id)
    else:
        stream = BatchStream(
            examples, batch_size=cfg.optim.batch_size, seq_len=cfg.data.max_length,
            pack=cfg.data.pack, seed=cfg.data.seed, rank=d.rank, world_size=d.world,
            pad_id=pad_id,
        )  # fmt: skip
    torch.manual_seed(cfg.seed)  # the same initial drafter on every rank
    drafter = build_drafter(cfg, target, fc_ids).to(d.device)
    drafter.train()
    drafter.checkpoint_layers = checkpointing_on(
        cfg.drafter.activation_checkpointing, d.device.type
    )
    drafter.flex_pad_to = flex_pad_to(cfg)
    fc = set_fc_precision(drafter, cfg.optim.fc_precision, d.device.type)
    step_module = DrafterStep(drafter)
    ddp = DistributedDataParallel(
        step_module,
        device_ids=[d.device.index] if d.device.type == "cuda" else None,
        gradient_as_bucket_view=True,  # the gradients live in DDP's buckets: no second copy
    )
    grad_comm = resolve_grad_comm(cfg.dist.grad_comm_dtype, d.device.type, d.nnodes)
    comm.install_grad_comm(ddp, grad_comm)
    o = cfg.optim
    mode = resolve_sharding(cfg.dist.sharding, d.world, d.nnodes)
    group = node_group(d, timedelta(seconds=cfg.dist.timeout_s)) if mode == "hybrid" else None
    optimizer = sharding.build_optimizer(list(drafter.parameters()), o, mode, d.device, group)
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
        f"{d.world} rank(s) on {d.nnodes} node(s), {d.device.type}, optimizer sharding {mode}, "
        f"gradients all-reduced in {grad_comm} once per step of {o.grad_accum} micro-batch(es); "
        f"fc in {fc}"
    )
    run = Run(
        cfg, d, target, drafter, ddp, optimizer, scheduler, stream, anchor_gen,
        layer_ids, fc_ids, total, hybrid, sharding=mode, holdout=holdout,
        val_seed=val_seed(cfg.seed, d.rank),
    )  # fmt: skip
    return run, items
