"""Training-time draft metrics (`acc`, `streak`, `dds{b}`) as sums that aggregate exactly.

Inputs are the draft logits of slots 1..K-1 of M blocks, the teacher's tokens for those slots
and which slots are valid. A block counts when its slot 1 is valid. `streak` is the per-block
number of leading valid, correct slots (never a product of per-position accuracies);
`dds{b}` is the depth a DDTree of budget b reaches along the teacher's tokens (see drafter/acceptance.py).

Everything stays on the logits' device: the loss hands each chunk of logits to a
`DraftMetrics`, which keeps what the metrics need of it (argmax hits, top log-probabilities,
label ranks: small), and `DraftMetrics.sums()` turns them into one float64 vector of sums.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from workload.drafter.acceptance import label_ranks, streak_lengths, tree_depth, tree_depths

_CHUNK_ELEMENTS = 1 << 25  # logits elements upcast to float32 at a time (128 MiB)


def leading_valid(valid: Tensor) -> Tensor:
    """[M] number of leading valid slots."""
    return valid.bool().to(torch.int32).cumprod(dim=1).sum(dim=1)


def ddtree_depth(logprobs: Tensor, labels: Tensor, valid_len: int, budget: int) -> int:
    """Accepted depth of one block's DDTree: logprobs [D, V] (or logits), labels [D]."""
    if budget <= 0 or valid_len <= 0:
        return 0
    logprobs = torch.log_softmax(logprobs.detach().float(), dim=-1)
    values, ids = logprobs.topk(min(budget, logprobs.shape[-1]), dim=-1)
    ranks = label_ranks(ids, labels.to(ids.device))
    return tree_depth(values.tolist(), ranks.tolist(), valid_len, budget)


def empty_sums(budgets: Sequence[int] = (8,)) -> dict[str, float]:
    """The keys of `metric_sums`, all zero (a micro-step without a valid block has these)."""
    sums = {"acc_correct": 0.0, "acc_count": 0.0, "streak_sum": 0.0, "blocks": 0.0}
    sums.update({f"dds{int(b)}_sum": 0.0 for b in budgets})
    return sums


class DraftMetrics:
    """Collects what the metrics need of each chunk of draft logits (call it as the loss's
    `on_logits` hook); `sums()` is the vector of `empty_sums(budgets)`' keys, in that order,
    float64 on the logits' device. Nothing here waits for the device."""

    def __init__(self, budgets: Sequence[int], device: torch.device) -> None:
        self.budgets = [int(b) for b in budgets]
        self.device = device
        self.parts: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []

    def __call__(self, logits: Tensor, labels: Tensor, valid: Tensor) -> None:
        """logits [m, K-1, V], labels and valid [m, K-1] of a chunk of blocks."""
        labels, valid = labels.to(logits.device), valid.to(logits.device).bool()
        top = min(max(self.budgets, default=1), logits.shape[-1])
        step = max(1, _CHUNK_ELEMENTS // max(1, logits.shape[1] * logits.shape[2]))
        with torch.no_grad():
            for lo in range(0, logits.shape[0], step):
                part = slice(lo, lo + step)
                self.parts.append((*_chunk_stats(logits[part].detach(), labels[part], top),
                                   valid[part]))  # fmt: skip

    def sums(self) -> Tensor:
        if not self.parts:
            return torch.zeros(4 + len(self.budgets), dtype=torch.float64, device=self.device)
        correct, top_logprobs, ranks, valid = (torch.cat(t) for t in zip(*self.parts, strict=True))
        return block_sums(correct, valid, top_logprobs, ranks, self.budgets)


def _chunk_stats(logits: Tensor, labels: Tensor, top: int) -> tuple[Tensor, Tensor, Tensor]:
    """(argmax == label [m, D], top log-probabilities [m, D, top], label ranks [m, D])."""
    correct = logits.argmax(dim=-1) == labels
    logits = logits.float()
    values, ids = logits.topk(top, dim=-1)
    values = values - torch.logsumexp(logits, dim=-1, keepdim=True)
    return correct, values, label_ranks(ids, labels)


def block_sums(
    correct: Tensor, valid: Tensor, top_logprobs: Tensor, ranks: Tensor, budgets: Sequence[int]
) -> Tensor:
    """acc_correct, acc_count, streak_sum, blocks, dds{b}_sum... of M blocks as one float64
    vector on their device. correct/valid/ranks [M, D], top_logprobs [M, D, T]."""
    valid = valid.bool()
    counted = valid[:, 0]
    depth_limit = leading_valid(valid)  # 0 for blocks that do not count
    parts = [
        (correct & valid).sum(),
        valid.sum(),
        torch.where(counted, streak_lengths(correct, valid), 0).sum(),
        counted.sum(),
    ]
    parts += [tree_depths(top_logprobs, ranks, depth_limit, int(b)).sum() for b in budgets]
    return torch.stack(parts).double()


def metric_sums(
    logits: Tensor, labels: Tensor, valid: Tensor, budgets: Sequence[int] = (8,)
) -> dict[str, float]:
    """Sums and counts over M blocks: logits [M, K-1, V], labels [M, K-1], valid [M, K-1].

    Returns acc_correct, acc_count, streak_sum, blocks and dds{b}_sum for each budget (on the
    host: one transfer).
    """
    metrics = DraftMetrics(budgets, logits.device)
    if logits.shape[0] and logits.shape[1]:
        metrics(logits, labels, valid)
    keys = empty_sums(metrics.budgets)
    return dict(zip(keys, metrics.sums().tolist(), strict=True))


def finalize(sums: dict[str, float]) -> dict[str, float]:
    """Means from sums: acc, streak and dds{b} (NaN when nothing was counted)."""

    def ratio(num: float, den: float) -> float:
        return num / den if den else float("nan")

    out = {
        "acc": ratio(sums["acc_correct"], sums["acc_count"]),
        "streak": ratio(sums["streak_sum"], sums["blocks"]),
    }
    for key, value in sums.items():
        if key.startswith("dds") and key.endswith("_sum"):
            out[key[: -len("_sum")]] = ratio(value, sums["blocks"])
    return out
