"""One training step of a DFlash drafter: pure tensor code, read top to bottom.

target forward (clean hidden states, no grad) -> teacher labels from the final logits -> block
inputs (anchor token + MASK x K-1) and noised fc features -> drafter over all anchor blocks ->
loss sums through the target's frozen lm_head (chunked; the metrics see each chunk's logits) ->
backward; after grad_accum micro-steps: gradients / (the step's valid slot weight over all
micro-batches and ranks) -> clip -> AdamW -> schedule.
`Run` holds what a step reads: the frozen target, the drafter and its DDP wrapper, the optimizer
and schedule, the batch stream and the anchor generator. The run's lifecycle (processes, the
loop, signals) is in loop.py, its setup in build_run.py, its log in runlog.py, its checkpoints
in save_restore.py.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from workload.config import RunConfig
from workload.data.batches import Batch, BatchStream, HoldoutBatches, sample_anchors
from workload.drafter.model import DFlashDrafter, select_target_features
from workload.drafter.targets import DraftConventions, DraftHead, block_embeddings, output_head
from workload.train.distributed import Dist
from workload.train.loss import (
    LossSums,
    Objective,
    gather_slots,
    greedy_tokens,
    objective,
    teacher_labels,
)
from workload.train.metrics import DraftMetrics, empty_sums

DDS_BUDGETS = (8,)
# what a log interval sums on each rank (reduced over ranks for the log line)
# (slots_kept / slots_supervised: valid draft slots with and without loss.on_trajectory's rule)
SUM_KEYS = ("loss", "grad_norm", "steps", "tokens", "slots_kept", "slots_supervised",
            *empty_sums(DDS_BUDGETS))  # fmt: skip
# what a pass over the held-out data sums on each rank
VAL_KEYS = ("loss", "weight", *empty_sums(DDS_BUDGETS))


class StepSums:
    """The sums of a log interval on this rank, as one float64 vector on the device in
    SUM_KEYS order: adding to it never waits for the device (`reduce_sums` reads it)."""

    def __init__(self, device: torch.device, start: Mapping[str, float] | None = None) -> None:
        if start:
            values = [float(start.get(key, 0.0)) for key in SUM_KEYS]
            self.values = torch.tensor(values, dtype=torch.float64, device=device)
        else:
            self.values = torch.zeros(len(SUM_KEYS), dtype=torch.float64, device=device)

    def add(self, key: str, value: Tensor | float) -> None:
        i = SUM_KEYS.index(key)
        self.values[i : i + 1].add_(value)

    def add_metrics(self, sums: Tensor) -> None:
        """`DraftMetrics.sums()`: the metric keys, in their order."""
        i = SUM_KEYS.index("acc_correct")
        self.values[i : i + len(sums)].add_(sums)

    def to_dict(self) -> dict[str, float]:
        """This rank's sums on the host (one transfer)."""
        return dict(zip(SUM_KEYS, self.values.tolist(), strict=True))


def reduce_sums(sums: StepSums | Mapping[str, float], device: torch.device) -> dict[str, float]:
    """Sums over ranks, on the host: one all_reduce of the stacked sums, one transfer."""
    if not isinstance(sums, StepSums):
        sums = StepSums(device, sums)
    total = sums.values.clone()  # the interval goes on (a checkpoint reduces it mid-way)
    dist.all_reduce(total)
    return dict(zip(SUM_KEYS, total.tolist(), strict=True))


@dataclass
class Run:
    """A run's pieces, built by `build_run.setup`; what a step, a log line and a checkpoint read."""

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
    holdout: HoldoutBatches | None = None  # this rank's share of data.holdout (None: none)
    val_seed: int = 0  # the anchors of every pass over the holdout
    timing: bool = False
    times: dict[str, float] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.dist.device


def autocast_for(cfg: RunConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on GPU (fp32 master weights); fp32 on CPU unless precision: bf16."""
    precision = cfg.optim.precision
    if precision == "fp32" or (precision == "auto" and device.type != "cuda"):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def noise_std(cfg: RunConfig, step: int) -> float:
    n = cfg.noise
    if n.steps <= 0:
        return n.start
    return n.start + (n.end - n.start) * min(1.0, step / n.steps)


class DrafterStep(nn.Module):
    """The drafter's training forward as one module, so DDP sees (and syncs) every use."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, features, block_embeds, anchors, anchor_valid, positions, doc_ids, attention):
        context = self.drafter.project_context(features)
        return self.drafter.forward_blocks(
            block_embeds, context, anchors, anchor_valid, positions, doc_ids, attention=attention
        )


@dataclass
class TeacherView:
    features: Tensor  # [B, S, L*H] clean features of the fc layers
    teacher_hidden: Tensor  # [B, S, H] what the teacher's logits are computed from
    greedy: Tensor  # [B, S] the teacher's token for position p + 1


def decoder_body(target: nn.Module) -> nn.Module:
    return target.model if hasattr(target, "model") else target.get_decoder()


@torch.no_grad()
def target_forward(run: Run, batch: Batch) -> TeacherView:
    """The frozen target's clean forward: fc features and the teacher (before any noise).

    No attention mask: transformers (5.x) builds the causal mask itself, with each layer's
    sliding window, and when position_ids restart inside a row (packed documents) it keeps the
    documents apart (`find_packed_sequence_indices`; sdpa, eager and flex_attention; padding
    continues the last document's positions, so it is that document's tail)."""
    body = decoder_body(run.target)
    out = body(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        attention_mask=None,
        output_hidden_states=True,
        use_cache=False,
    )
    hidden_states = out.hidden_states
    features = select_target_features(hidden_states, run.fc_ids)
    if run.cfg.loss.teacher == "logits":
        teacher_hidden = out.last_hidden_state
    else:  # old runs: lm_head(norm(last configured layer)); hidden_states[-1] is already normed
        last = run.layer_ids[-1]
        h = hidden_states[last + 1]
        teacher_hidden = h if last + 2 == len(hidden_states) else body.norm(h)
    greedy = greedy_tokens(teacher_hidden, output_head(run.target))
    return TeacherView(features, teacher_hidden, greedy)


def add_noise(features: Tensor, std: float) -> Tensor:
    """fp32 features plus uniform noise in [-std, +std] (fc inputs only; the teacher never sees
    it). fp32 because a bf16 step is 0.125 at |x| >= 16, where noise of 0.05 would round away;
    the drafter's fc takes fp32 features in fp32 (`DFlashDrafter.project_context`)."""
    features = features.float()
    if std <= 0:
        return features
    return features + (torch.rand_like(features) * 2 - 1) * std


def block_inputs(run: Run, batch: Batch, anchors: Tensor) -> Tensor:
    """Target embeddings of [anchor token, MASK x K-1] for every block: [B, N*K, H]."""
    k = run.cfg.drafter.block_size
    b, n = anchors.shape
    ids = torch.full((b, n, k), run.cfg.drafter.mask_token_id, device=anchors.device)
    ids[:, :, 0] = batch.input_ids.gather(1, anchors)
    conventions = DraftConventions.of(run.drafter.config)
    return block_embeddings(run.target, ids.view(b, n * k), conventions)


def real_blocks(per_block: Tensor, real: Tensor) -> Tensor:
    """[B, N, ...] values of every block -> [M, ...] those of the real blocks (`real`: their
    indices among the B*N, in order; an index, not a mask: no wait for the device)."""
    return per_block.flatten(0, 1).index_select(0, real)


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """A host tensor on `device`; on CUDA from pinned memory without blocking (a plain copy
    from pageable memory waits for everything queued on the device)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _tick(run: Run, name: str, start: float) -> float:
    if run.timing:
        if run.device.type == "cuda":
            torch.cuda.synchronize(run.device)
        now = time.perf_counter()
        run.times[name] = run.times.get(name, 0.0) + now - start
        return now
    return start


def _on_device(run: Run, batch: Batch, generator: torch.Generator):
    """Anchors drawn on the host, then the batch, anchors, validity and the indices of the real
    blocks on the device (without waiting for it)."""
    cfg = run.cfg
    anchors, anchor_valid = sample_anchors(
        batch.loss_mask, batch.doc_ids, num_anchors=cfg.data.num_anchors,
        generator=generator, max_per_row=cfg.data.max_anchors_per_row,
    )  # fmt: skip
    real = anchor_valid.flatten().nonzero()[:, 0]  # the real blocks among the B*N
    batch = Batch(*(to_device(t, run.device) for t in (batch.input_ids, batch.loss_mask,
                                                      batch.doc_ids, batch.position_ids)))  # fmt: skip
    anchors, anchor_valid, real = (to_device(t, run.device) for t in (anchors, anchor_valid, real))
    return batch, anchors, anchor_valid, real


def _teacher(run: Run, batch: Batch, anchors: Tensor, anchor_valid: Tensor, view: TeacherView):
    """(labels, valid, supervised): `valid` under loss.on_trajectory when it is on,
    `supervised` the slots valid without that rule (what `kept` is a share of)."""
    k = run.cfg.drafter.block_size
    labels, valid = teacher_labels(
        view.greedy, anchors, anchor_valid, batch.loss_mask, batch.doc_ids, k,
        input_ids=batch.input_ids if run.cfg.loss.on_trajectory else None,
    )  # fmt: skip
    supervised = valid
    if run.cfg.loss.on_trajectory:
        _, supervised = teacher_labels(
            view.greedy, anchors, anchor_valid, batch.loss_mask, batch.doc_ids, k
        )
    return labels, valid, supervised


def _draft_loss(run: Run, module: nn.Module, features: Tensor, embeds: Tensor, batch: Batch,
                anchors: Tensor, anchor_valid: Tensor, real: Tensor, labels: Tensor,
                valid: Tensor, view: TeacherView) -> tuple[LossSums, DraftMetrics]:  # fmt: skip
    """The drafter over every block (through `module`: DDP, or the bare step) and the loss
    sums of its real blocks, with their draft metrics."""
    cfg = run.cfg
    k = cfg.drafter.block_size
    hidden = module(
        features, embeds, anchors, anchor_valid, batch.position_ids,
        batch.doc_ids if cfg.data.pack else None, cfg.attention,
    )  # fmt: skip
    b, n = anchors.shape
    slots = real_blocks(hidden.view(b, n, k, -1)[:, :, 1:], real)
    teacher = None
    if cfg.loss.type != "ce":
        teacher = real_blocks(gather_slots(view.teacher_hidden, anchors, k), real)
    metrics = DraftMetrics(DDS_BUDGETS, run.device)
    head = DraftHead(output_head(run.target), DraftConventions.of(run.drafter.config))
    loss = objective(
        slots, head, real_blocks(labels, real), real_blocks(valid, real),
        Objective.from_config(cfg.loss), teacher_hidden=teacher, on_logits=metrics,
        reduction="sum",
    )  # fmt: skip
    return loss, metrics


def micro_step(run: Run, batch: Batch, step: int, sums: StepSums) -> LossSums:
    """Forward and backward one micro-batch of host tensors (as the stream gives them); returns
    its loss sums (detached; the gradient is of their total, normalised later by `accumulate`)
    and adds its tokens, kept slots and draft metrics to `sums`. Nothing here waits for the
    device: what needs the host (token count, anchors, which blocks are real) is done on host
    tensors."""
    cfg = run.cfg
    t0 = time.perf_counter()
    sums.add("tokens", int((batch.doc_ids >= 0).sum()))
    batch, anchors, anchor_valid, real = _on_device(run, batch, run.anchor_gen)
    autocast = autocast_for(cfg, run.device)
    with autocast:
        view = target_forward(run, batch)
        labels, valid, supervised = _teacher(run, batch, anchors, anchor_valid, view)
        with torch.no_grad():
            embeds = block_inputs(run, batch, anchors)
            features = add_noise(view.features, noise_std(cfg, step))
    sums.add("slots_kept", valid.sum())
    sums.add("slots_supervised", supervised.sum())
    t1 = _tick(run, "target_forward", t0)
    with autocast_for(cfg, run.device):
        loss, metrics = _draft_loss(run, run.ddp, features, embeds, batch, anchors,
                                    anchor_valid, real, labels, valid, view)  # fmt: skip
    loss.total.backward()
    _tick(run, "drafter_fwd_bwd", t1)
    sums.add_metrics(metrics.sums())
    return LossSums(loss.total.detach(), loss.weight)


@torch.no_grad()
def holdout_sums(run: Run) -> dict[str, float]:
    """Loss and draft metrics over the held-out documents, as VAL_KEYS sums over every rank's
    share (one all_reduce): no noise, the bare drafter (not DDP), and the same anchors at every
    pass (a generator seeded with `run.val_seed`), so passes at different steps compare."""
    total = torch.zeros(len(VAL_KEYS), dtype=torch.float64, device=run.device)
    generator = torch.Generator().manual_seed(run.val_seed)
    for host_batch in run.holdout or ():
        batch, anchors, anchor_valid, real = _on_device(run, trim_padding(host_batch), generator)
        with autocast_for(run.cfg, run.device):
            view = target_forward(run, batch)
            labels, valid, _ = _teacher(run, batch, anchors, anchor_valid, view)
            embeds = block_inputs(run, batch, anchors)
            loss, metrics = _draft_loss(run, run.ddp.module, view.features.float(), embeds,
                                        batch, anchors, anchor_valid, real, labels, valid, view)  # fmt: skip
        total[0] += loss.total.double()
        total[1] += loss.weight.double()
        total[2:] += metrics.sums()
    dist.all_reduce(total)
    return dict(zip(VAL_KEYS, total.tolist(), strict=True))


def trim_padding(batch: Batch) -> Batch:
    """Drop the columns where every row is padding (right padding only: exact for a causal
    target, and the drafter never looks past an anchor's document). Host tensors."""
    width = int((batch.doc_ids >= 0).sum(1).max())
    if width == batch.input_ids.shape[1] or width == 0:
        return batch
    return Batch(*(t[:, :width] for t in (batch.input_ids, batch.loss_mask, batch.doc_ids,
                                          batch.position_ids)))  # fmt: skip


def accumulate(run: Run, step: int, sums: StepSums) -> Tensor:
    """Forward and backward grad_accum micro-batches and normalise the summed gradients by the
    step's valid slot weight over all micro-batches and ranks (one all_reduce of a scalar on
    the device; DDP has averaged the gradients over ranks). Returns this rank's share of the
    step's loss (their mean over ranks is the loss the gradient is of), on the device."""
    accum = run.cfg.optim.grad_accum
    totals, weights = [], []
    for i in range(accum):
        batch = trim_padding(run.stream.next_batch())
        sync = contextlib.nullcontext() if i == accum - 1 else run.ddp.no_sync()
        with sync:
            total, weight = micro_step(run, batch, step, sums)
        totals.append(total)
        weights.append(weight)
    weight = torch.stack(weights).sum()
    world = run.dist.world
    if world > 1:
        dist.all_reduce(weight)
    scale = world / weight.clamp_min(1e-12)
    grads = [p.grad for p in run.drafter.parameters() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, scale)
    return torch.stack(totals).sum() * scale


def train_step(run: Run, step: int, sums: StepSums) -> tuple[Tensor, Tensor, float]:
    """One optimizer step over grad_accum micro-batches; adds its tokens and draft metrics to
    `sums` and returns (loss, grad norm, lr): the first two are on the device (not waited for)."""
    loss = accumulate(run, step, sums)
    t0 = time.perf_counter()
    grad_norm = torch.nn.utils.clip_grad_norm_(run.drafter.parameters(), run.cfg.optim.grad_clip)
    lr = run.optimizer.param_groups[0]["lr"]
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    _tick(run, "optimizer", t0)
    return loss, grad_norm.detach(), lr
