"""Bounded compilation: over an epoch of the tiny config's data, flex attention and its block
masks meet one shape per layer kind (training) instead of one per power-of-two bucket of each
batch's rows and anchors; the held-out pass adds at most two (its batch and its last,
smaller one). On CPU flex runs eagerly: the test counts the shape keys a compiled flex is
specialised on (`attention.flex_shape_key`), from the real stream and anchors, and checks a
real pass of the drafter records exactly the keys predicted."""

from __future__ import annotations

import pytest
import torch

from tests.workload.test_train import tiny_config
from workload.data.batches import sample_anchors
from workload.drafter import attention as A
from workload.train import loop as T
from workload.train import step as S
from workload.train.build_run import setup


@pytest.fixture(scope="module")
def run(tiny_dense, tmp_path_factory):
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = tiny_config(tiny_dense, "attention=flex")
    run, _ = setup(cfg, T.init_distributed(), say=lambda m: None,
                   run_dir=tmp_path_factory.mktemp("shapes"))  # fmt: skip
    return run


def kinds(run) -> set[tuple]:
    c = run.drafter.config
    return {(c.sliding_window if t == "sliding_attention" else None, t == "sliding_attention")
            for t in c.layer_types}  # fmt: skip


def keys_of(run, batches, pad_to) -> set[tuple]:
    """The flex shape keys of `batches` (host Batch), anchors drawn as a step draws them."""
    c, k = run.drafter.config, run.cfg.drafter.block_size
    gen, keys = torch.Generator().manual_seed(0), set()
    for batch in batches:
        batch = S.trim_padding(batch)
        anchors, _ = sample_anchors(batch.loss_mask, batch.doc_ids,
                                    num_anchors=run.cfg.data.num_anchors, generator=gen,
                                    max_per_row=run.cfg.data.max_anchors_per_row)  # fmt: skip
        rows, seq = batch.input_ids.shape
        ctx_pad, blk_pad = A.flex_padded(seq, anchors.shape[1] * k, pad_to)
        for window, causal in kinds(run):
            keys.add(A.flex_shape_key(rows, c.num_attention_heads, c.head_dim, ctx_pad, blk_pad,
                                      window, causal))  # fmt: skip
    return keys


def test_an_epoch_compiles_one_flex_shape_per_layer_kind(run):
    steps = -(-run.stream.rows_per_epoch // run.cfg.optim.batch_size)
    batches = [run.stream.next_batch() for _ in range(steps)]
    bounded = keys_of(run, batches, run.drafter.flex_pad_to)
    buckets = keys_of(run, batches, None)  # what each batch's own buckets would compile
    print(
        f"{steps} batches: {len(bounded)} flex shapes padded to the run's most, "
        f"{len(buckets)} with power-of-two buckets per batch"
    )
    assert len(bounded) == len(kinds(run)) <= 2
    assert len(buckets) > len(bounded)

    A.FLEX_SHAPES.clear()  # a real pass over the held-out rows records what was predicted
    S.holdout_sums(run)
    held = list(run.holdout)
    assert keys_of(run, held, run.drafter.flex_pad_to) == A.FLEX_SHAPES
    assert len(A.FLEX_SHAPES) <= 2 * len(kinds(run))
