"""The training step on the tiny target: the logged metrics equal the host-side reference the
trainer used before they moved onto the device, and the step reads device values a fixed
number of times, however many chunks of logits and blocks it has."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.distributed as dist

from bench.host_syncs import HostSyncs
from tests.workload.test_train import config
from workload.drafter.acceptance import label_ranks, tree_depth
from workload.train import loop as T
from workload.train import loss as L
from workload.train import step as S
from workload.train.metrics import finalize, leading_valid, streak_lengths


@pytest.fixture(scope="module")
def group():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return T.init_distributed()


# ---------------------------------------------------------------- the reference


def reference_sums(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, budgets):
    """The trainer's metric sums before they moved onto the device: one chunk of logits at a
    time, Python floats, and a heap per block (ddtree.tree_depth)."""
    sums = {"acc_correct": 0.0, "acc_count": 0.0, "streak_sum": 0.0, "blocks": 0.0}
    sums.update({f"dds{b}_sum": 0.0 for b in budgets})
    valid = valid.bool()
    correct = logits.argmax(dim=-1) == labels
    counted = valid[:, 0]
    sums["acc_correct"] += float((correct & valid).sum())
    sums["acc_count"] += float(valid.sum())
    sums["streak_sum"] += float(streak_lengths(correct, valid)[counted].sum())
    sums["blocks"] += float(counted.sum())
    if not bool(counted.any()):
        return sums
    chunk = logits[counted].float()
    values, ids = chunk.topk(min(max(budgets), chunk.shape[-1]), dim=-1)
    values = values - torch.logsumexp(chunk, dim=-1, keepdim=True)
    rows, ranks = values.tolist(), label_ranks(ids, labels[counted]).tolist()
    lengths = leading_valid(valid[counted]).tolist()
    for b in budgets:
        sums[f"dds{b}_sum"] += float(
            sum(tree_depth(r, k, n, b) for r, k, n in zip(rows, ranks, lengths, strict=True))
        )
    return sums


def _agreeing(logits: torch.Tensor, labels: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """The logits with the label made the top-1 on 60% of the slots and about the top-2 on 20%
    (a drafter after 3 steps agrees with nothing: every metric would be 0)."""
    logits = logits.float().clone()
    top = logits.amax(dim=-1)
    coin = torch.rand(labels.shape, generator=g)
    at = logits.gather(-1, labels[..., None])[..., 0]
    at = torch.where(coin < 0.6, top + 5, torch.where(coin < 0.8, top - 1e-3, at))
    return logits.scatter(-1, labels[..., None], at[..., None])


def _record_step_inputs(monkeypatch, chunk_blocks: int) -> dict:
    """Record, per micro-step, every chunk of logits the metrics see (made to agree with the
    teacher often) and the loss; per step, the gradient norm. The loss runs with
    `chunk_blocks` blocks per chunk."""
    seen: dict = {"micro": [], "norms": []}
    g = torch.Generator().manual_seed(0)

    def objective(*args, on_logits, **kwargs):
        chunks: list = []

        def hook(logits, labels, valid):
            logits = _agreeing(logits, labels, g)
            chunks.append((logits, labels.clone(), valid.clone()))
            on_logits(logits, labels, valid)

        loss = L.objective(*args, chunk_blocks=chunk_blocks, on_logits=hook, **kwargs)
        seen["micro"].append((chunks, [t.detach().clone() for t in loss]))
        return loss

    clip = torch.nn.utils.clip_grad_norm_

    def recorded_clip(*args, **kwargs):
        norm = clip(*args, **kwargs)
        seen["norms"].append(norm.clone())
        return norm

    monkeypatch.setattr(S, "objective", objective)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recorded_clip)
    return seen


def test_logged_metrics_equal_the_host_reference(tiny_dense, group, tmp_path, monkeypatch):
    accum, steps = 2, 3
    seen = _record_step_inputs(monkeypatch, chunk_blocks=5)
    cfg = config(tiny_dense, f"optim.max_steps={steps}", "log.log_every=1",
                 f"optim.grad_accum={accum}", "data.num_anchors=16")  # fmt: skip
    assert T.train(cfg, tmp_path / "run") == 0
    log = [json.loads(line) for line in (tmp_path / "run" / T.LOG_NAME).read_text().splitlines()]
    assert len(log) == steps and len(seen["micro"]) == steps * accum
    for i, record in enumerate(log):
        assert set(record) == {"step", "time", "loss", "acc", "streak", "dds8", "lr", "noise",
                               "epoch", "grad_norm", "tok_s", "kept"}  # fmt: skip
        assert 0.0 <= record["kept"] <= 1.0
        micro = seen["micro"][i * accum : (i + 1) * accum]
        sums: dict[str, float] = {}
        for chunks, _ in micro:
            for logits, labels, valid in chunks:
                for key, value in reference_sums(logits, labels, valid, S.DDS_BUDGETS).items():
                    sums[key] = sums.get(key, 0.0) + value
        want = {
            **finalize(sums),
            # one weighted mean over the step's slots (not a mean of micro-batch means)
            "loss": float(sum(t for _, (t, _) in micro) / sum(w for _, (_, w) in micro)),
            "grad_norm": float(seen["norms"][i]),
        }
        for key, value in want.items():
            assert record[key] == pytest.approx(value, rel=1e-6, abs=0), (i, key)
        assert sum(len(chunks) for chunks, _ in micro) >= 4  # several chunks per step
        assert sums["blocks"] > 10 and sums["dds8_sum"] > sums["streak_sum"] > 0


# ---------------------------------------------------------------- host syncs


def _step_syncs(run: T.Run, chunk_blocks: int, monkeypatch) -> HostSyncs:
    monkeypatch.setattr(S, "objective", functools.partial(L.objective, chunk_blocks=chunk_blocks))
    S.train_step(run, 0, S.StepSums(run.device))  # warm-up (first-step set-up is not counted)
    with HostSyncs() as syncs:
        S.train_step(run, 1, S.StepSums(run.device))
    return syncs


def test_host_syncs_of_a_step_do_not_grow_with_chunks_or_blocks(tiny_dense, group, monkeypatch):
    counts = {}
    for anchors in (4, 16):
        for chunk_blocks in (64, 1):  # one chunk for every block, then one block per chunk
            run, _ = T.setup(config(tiny_dense, f"data.num_anchors={anchors}"), group,
                             say=lambda m: None)  # fmt: skip
            syncs = _step_syncs(run, chunk_blocks, monkeypatch)
            counts[anchors, chunk_blocks] = syncs.total
            assert not [s for s in syncs.sites if "metrics.py" in s or "ddtree.py" in s], syncs
            assert not [s for s in syncs.sites if "loss.py" in s], syncs
    print(f"\nhost syncs per step (anchors, blocks per chunk): {counts}")
    assert len(set(counts.values())) == 1, counts
