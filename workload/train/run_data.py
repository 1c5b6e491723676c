"""A run's data: its source (data/source.py), the token store every rank of a node shares
(data/token_store.py), the split into training and held-out conversations, and the two streams.

One process a node (local rank 0) finds or builds the store; the node's other ranks wait for
it. Every rank waits inside `run_polled`, which has each rank tell the others every second
whether it is still working, so however long tokenizing takes no rank sits in one collective
near the process group's timeout (ranks of a node that finished early included). The builder's
path then reaches its node's ranks over the CPU group.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from workload.common.provenance import target_digest
from workload.config import AuditItem, DataFacts, RunConfig, UsageError
from workload.data.batches import BatchStream, HoldoutBatches, split_holdout
from workload.data.chat import DataError, check_template, resolve_chat_template
from workload.data.source import DataSource, open_source
from workload.data.token_store import (
    RenderSettings,
    TokenStore,
    find_or_build,
    length_line,
    lost_share,
    store_root,
)
from workload.train.distributed import Dist, run_polled


@dataclass
class RunData:
    source: DataSource
    store: TokenStore
    train_docs: np.ndarray  # store indices
    holdout_docs: np.ndarray


def open_data_source(cfg: RunConfig) -> tuple[DataSource, DataFacts]:
    """data.path checked on every rank (the same one-line refusal everywhere), with what the
    recipe audit needs to know of it."""
    try:
        source = open_source(cfg.data.path)
    except DataError as exc:
        raise UsageError(str(exc)) from None
    return source, DataFacts(source.kind, source.manifest, target_digest(cfg.target.path))


def render_settings(cfg: RunConfig) -> RenderSettings:
    d = cfg.data
    template = resolve_chat_template(d.chat_template)
    return RenderSettings(d.max_length, template, dict(d.chat_template_kwargs or {}))


def load_data(
    cfg: RunConfig, d: Dist, source: DataSource, tokenizer: Any, run_dir: Path | None, say=print
) -> RunData:
    """The store of `source` (built by each node's local rank 0 when missing) and its split."""
    try:
        settings = render_settings(cfg)
        check_template(cfg.data.path, tokenizer, settings.chat_template)
    except DataError as exc:
        raise UsageError(str(exc)) from None
    root = store_root(source, run_dir, cfg.data.cache_dir)

    def build() -> str:
        store = find_or_build(source, tokenizer, settings, root=root, workers=cfg.data.workers,
                              say=lambda m: print(m, flush=True))  # fmt: skip
        return str(store.path)

    try:
        built = run_polled(build if d.local_rank == 0 else None, d, "tokenizing the data")
    except DataError as exc:
        raise UsageError(str(exc)) from None
    store = TokenStore(node_leaders_value(built, d))
    train, held = split_holdout(len(store), cfg.data.holdout, cfg.data.seed)
    say(f"data: {source.describe()}: {len(train)} conversations to train on, {len(held)} held "
        f"out (data.holdout {cfg.data.holdout if cfg.data.holdout is not None else 'default'})")  # fmt: skip
    return RunData(source, store, train, held)


LOST_WARN_SHARE = 0.05  # supervised tokens past data.max_length above which the audit warns


def length_item(store: TokenStore) -> AuditItem:
    """What data.max_length cost this store (turns cut, supervised tokens lost), in the audit
    as `dataset.lost` (audit.json: `diff` shows it); a warning above LOST_WARN_SHARE."""
    h = store.header
    share, note = lost_share(h), length_line(h)
    if share > LOST_WARN_SHARE:
        note += ": a longer data.max_length trains them (the plan says what a step then costs)"
    return AuditItem("dataset.lost", f"{share:.1%}", f"<= {LOST_WARN_SHARE:.0%}", note,
                     "warn" if share > LOST_WARN_SHARE else "info")  # fmt: skip


def node_leaders_value(value: Any, d: Dist) -> Any:
    """On every rank, the `value` of its node's local rank 0 (over the CPU group)."""
    if d.world == 1:
        return value
    node = os.environ.get("GROUP_RANK") or socket.gethostname()
    everyone: list[Any] = [None] * d.world
    dist.all_gather_object(everyone, (node, d.local_rank, value), group=d.control)
    return next(v for n, local, v in everyone if n == node and local == 0)


def streams(cfg: RunConfig, d: Dist, data: RunData, pad_id: int) -> tuple[BatchStream, Any]:
    """(the training stream, this rank's share of the holdout or None)."""
    stream = BatchStream(
        data.store.arrays,
        batch_size=cfg.optim.batch_size,
        seq_len=cfg.data.max_length,
        pack=cfg.data.pack,
        seed=cfg.data.seed,
        rank=d.rank,
        world_size=d.world,
        pad_id=pad_id,
        docs=data.train_docs,
    )
    holdout = None
    if len(data.holdout_docs):
        holdout = HoldoutBatches(data.store.arrays, data.holdout_docs,
                                 batch_size=cfg.optim.batch_size, seq_len=cfg.data.max_length,
                                 rank=d.rank, world_size=d.world, pad_id=pad_id)  # fmt: skip
    return stream, holdout
