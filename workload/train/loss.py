"""Teacher labels, slot weights and the training objective of a DFlash drafter.

Slot k (1..K-1) of the block at anchor a predicts position a+k. Its teacher is the target's own
greedy token there: argmax of the target's final logits at a+k-1, from the clean forward pass.
Labels are computed before any noise exists, so they cannot depend on noise or on the fc inputs.
A block's valid slots are a leading run, as the verifier's accepted prefix is: they stop at the
first slot outside the anchor's assistant turn or document, and (`loss.on_trajectory`) after the
first position where the data leaves the target's greedy path, where the label would continue a
prefix the verifier never reaches. So training's `streak` counts what evaluation's tau counts.

Shapes: B rows, S row length, N anchors per row, K block size, M real blocks (anchor_valid),
H hidden size, V vocab. Logits are never materialised for all blocks at once: the objective runs
the frozen lm_head over chunks of blocks under activation checkpointing, so at most one chunk of
[blocks * (K-1), V] logits is alive in the forward and in the backward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

LogitsHook = Callable[[Tensor, Tensor, Tensor], None]


class LossSums(NamedTuple):
    """A loss as sums, so a step normalises once over all its micro-batches and ranks."""

    total: Tensor  # sum(loss * w) over valid slots, with the graph
    weight: Tensor  # sum(w) over valid slots, detached


@dataclass(frozen=True)
class Objective:
    """The loss settings (a `LossConfig` has the same field names)."""

    type: str = "ce"  # ce | kl | blend
    gamma: float = 7.0
    weighting: str = "decay"  # decay | dpace | uniform
    dpace_alpha: float = 0.5
    kl_temperature: float = 2.0
    kl_weight: float = 0.7

    @classmethod
    def from_config(cls, cfg: object) -> Objective:
        names = ("type", "gamma", "weighting", "dpace_alpha", "kl_temperature", "kl_weight")
        return cls(**{n: getattr(cfg, n) for n in names})


# ---------------------------------------------------------------- teacher


@torch.no_grad()
def greedy_tokens(final_hidden: Tensor, lm_head: torch.nn.Module, chunk: int = 1024) -> Tensor:
    """argmax of lm_head(final_hidden) at every position, [B, S, H] -> [B, S] long, in chunks."""
    flat = final_hidden.reshape(-1, final_hidden.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
    for i in range(0, flat.shape[0], chunk):
        out[i : i + chunk] = lm_head(flat[i : i + chunk]).argmax(dim=-1)
    return out.view(final_hidden.shape[:-1])


def slot_positions(anchors: Tensor, block_size: int) -> Tensor:
    """Row position a+k predicted by slot k = 1..K-1 of each block: [B, N] -> [B, N, K-1]."""
    k = torch.arange(1, block_size, device=anchors.device)
    return anchors.unsqueeze(-1) + k


def teacher_labels(
    greedy: Tensor,
    anchors: Tensor,
    anchor_valid: Tensor,
    loss_mask: Tensor,
    doc_ids: Tensor | None,
    block_size: int,
    input_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Labels and validity of slots 1..K-1: [B, N, K-1] long and bool.

    Label of slot k = greedy[a+k-1] (the target's token at a+k). Slot k is valid iff the block
    is real and every slot j <= k has a+j < S, loss_mask[a+j] and a+j in the anchor's document
    (validity never resumes after a gap, such as a user turn between two assistant turns).
    With `input_ids` (the on-trajectory rule), slot k is also invalid when some slot j < k has a
    data token input_ids[a+j] other than its label.
    """
    seq_len = greedy.shape[1]
    pos = slot_positions(anchors, block_size)  # [B, N, K-1]
    inside = pos < seq_len
    safe = pos.clamp(max=seq_len - 1)
    flat = safe.flatten(1)
    labels = greedy.gather(1, flat - 1).view_as(pos)
    valid = inside & anchor_valid.unsqueeze(-1) & loss_mask.bool().gather(1, flat).view_as(pos)
    if doc_ids is not None:
        anchor_doc = doc_ids.gather(1, anchors).unsqueeze(-1)
        valid &= doc_ids.gather(1, flat).view_as(pos) == anchor_doc
    if input_ids is not None:
        on_path = input_ids.gather(1, flat).view_as(pos) == labels
        reached = torch.ones_like(on_path)
        reached[..., 1:] = on_path[..., :-1]
        valid &= reached
    return labels, leading_run(valid)


def leading_run(valid: Tensor) -> Tensor:
    """[..., K-1] bool -> the same with every slot after the first invalid one made invalid."""
    return valid.to(torch.int32).cumprod(dim=-1).bool()


def gather_slots(per_position: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """[B, S, ...] values at the positions a+k-1 that predict slots 1..K-1 -> [B, N, K-1, ...]."""
    seq_len = per_position.shape[1]
    src = (slot_positions(anchors, block_size) - 1).clamp(max=seq_len - 1)
    b, n, k1 = src.shape
    idx = src.reshape(b, n * k1)
    trailing = per_position.shape[2:]
    idx = idx.view(b, n * k1, *([1] * len(trailing))).expand(b, n * k1, *trailing)
    return per_position.gather(1, idx).view(b, n, k1, *trailing)


# ---------------------------------------------------------------- slot weights


def decay_weights(block_size: int, gamma: float, device: torch.device | None = None) -> Tensor:
    """w_k = exp(-(k-1)/gamma) for slots k = 1..K-1 (slot 0 is the anchor, never trained)."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def dpace_weights(ce: Tensor, valid: Tensor, alpha: float) -> Tensor:
    """D-PACE slot weights from per-slot CE [M, K-1] (detached).

    q_i = exp(-CE_i); q~_i = (1-alpha) q_i + alpha on valid slots, 1 on others;
    P_m = prod_{i<=m} q~_i; w_j = valid_j * sum_{m>=j} valid_m P_m.
    """
    valid_f = valid.float()
    q = torch.exp(-ce.detach().float())
    q_tilde = torch.where(valid, (1 - alpha) * q + alpha, torch.ones_like(q))
    prefix = torch.cumprod(q_tilde, dim=-1)
    suffix = (valid_f * prefix).flip(-1).cumsum(-1).flip(-1)
    return valid_f * suffix


def weighted_sums(per_slot: Tensor, weights: Tensor, valid: Tensor) -> LossSums:
    """(sum(loss * w * valid), sum(w * valid))."""
    w = weights.float() * valid.float()
    return LossSums((per_slot.float() * w).sum(), w.sum().detach())


def weighted_mean(per_slot: Tensor, weights: Tensor, valid: Tensor) -> Tensor:
    """sum(loss * w * valid) / sum(w * valid); zero (with a graph) when nothing is valid."""
    total, weight = weighted_sums(per_slot, weights, valid)
    return total / weight.clamp_min(1e-12)


# ---------------------------------------------------------------- per-slot losses


def _soft_kl(draft_logits: Tensor, teacher_logits: Tensor, temperature: float) -> Tensor:
    """T^2 * KL(softmax(teacher/T) || softmax(draft/T)) per slot."""
    log_q = F.log_softmax(draft_logits.float() / temperature, dim=-1)
    log_p = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return kl * temperature**2


def _chunk_terms(
    lm_head: torch.nn.Module,
    obj: Objective,
    hook: list[LogitsHook | None],
    hidden: Tensor,
    labels: Tensor,
    valid: Tensor,
    teacher_hidden: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """Per-slot (CE, objective loss) of a chunk of blocks, [m, K-1] each."""
    logits = lm_head(hidden)  # [m, K-1, V]
    if hook[0] is not None:
        hook[0](logits.detach(), labels, valid)
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    ce = ce.view(labels.shape)
    if obj.type == "ce":
        return ce, ce
    with torch.no_grad():
        teacher_logits = lm_head(teacher_hidden)
    kl = _soft_kl(logits, teacher_logits, obj.kl_temperature)
    if obj.type == "kl":
        return ce, kl
    return ce, obj.kl_weight * kl + (1 - obj.kl_weight) * ce


def objective(
    hidden: Tensor,
    lm_head: torch.nn.Module,
    labels: Tensor,
    valid: Tensor,
    obj: Objective,
    *,
    teacher_hidden: Tensor | None = None,
    chunk_blocks: int = 64,
    on_logits: LogitsHook | None = None,
    reduction: str = "mean",
) -> Tensor | LossSums:
    """The training loss of M blocks.

    hidden [M, K-1, H]: drafter outputs of slots 1..K-1; labels/valid [M, K-1];
    teacher_hidden [M, K-1, H]: the target's final hidden at a+k-1 (kl and blend only).
    `on_logits(logits, labels, valid)` sees each chunk's detached draft logits once (metrics).
    Weighted mean over valid slots with decay, D-PACE or uniform weights; `reduction="sum"`
    returns its numerator and denominator instead (`LossSums`).
    """
    if obj.type != "ce" and teacher_hidden is None:
        raise ValueError(f"loss type {obj.type!r} needs teacher_hidden")
    hook: list[LogitsHook | None] = [on_logits]
    ces, losses = [], []
    for i in range(0, hidden.shape[0], chunk_blocks):
        sl = slice(i, i + chunk_blocks)
        th = teacher_hidden[sl] if teacher_hidden is not None else None
        args = (lm_head, obj, hook, hidden[sl], labels[sl], valid[sl], th)
        if torch.is_grad_enabled() and hidden.requires_grad:
            ce, loss = checkpoint(_chunk_terms, *args, use_reentrant=False)
        else:
            ce, loss = _chunk_terms(*args)
        ces.append(ce)
        losses.append(loss)
    hook[0] = None  # the backward recomputation must not report the logits a second time
    k1 = labels.shape[-1]
    if not losses:
        zero = hidden.sum() * 0.0
        return LossSums(zero, zero.detach()) if reduction == "sum" else zero
    ce = torch.cat(ces)
    per_slot = torch.cat(losses)
    if obj.weighting == "dpace":
        weights = dpace_weights(ce, valid, obj.dpace_alpha)
    elif obj.weighting == "decay":
        weights = decay_weights(k1 + 1, obj.gamma, hidden.device).expand_as(per_slot)
    else:
        weights = torch.ones_like(per_slot)
    if reduction == "sum":
        return weighted_sums(per_slot, weights, valid)
    return weighted_mean(per_slot, weights, valid)
