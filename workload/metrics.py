"""Training-time draft metrics (`acc`, `streak`, `dds{b}`) as sums that aggregate exactly.

Inputs are the draft logits of slots 1..K-1 of M blocks, the teacher's tokens for those slots
and which slots are valid. A block counts when its slot 1 is valid. `streak` is the per-block
number of leading valid, correct slots (never a product of per-position accuracies);
`dds{b}` is the depth a DDTree of budget b reaches along the teacher's tokens (see ddtree.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from workload.ddtree import label_ranks, tree_depth

_CHUNK_ELEMENTS = 1 << 25  # logits elements upcast to float32 at a time (128 MiB)


def streak_lengths(correct: Tensor, valid: Tensor) -> Tensor:
    """[M] number of leading slots that are valid and correct."""
    ok = (correct.bool() & valid.bool()).to(torch.int32)
    return ok.cumprod(dim=1).sum(dim=1)


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


def _tree_sums(logits: Tensor, labels: Tensor, valid_len: Tensor, budgets: Sequence[int]) -> list:
    """Sum over blocks of the DDTree depth, per budget (logits of counted blocks only)."""
    top = min(max(budgets), logits.shape[-1])
    logits = logits.float()
    values, ids = logits.topk(top, dim=-1)
    values = values - torch.logsumexp(logits, dim=-1, keepdim=True)
    ranks = label_ranks(ids, labels).tolist()
    rows, lengths = values.tolist(), valid_len.tolist()
    return [
        sum(tree_depth(r, k, n, b) for r, k, n in zip(rows, ranks, lengths, strict=True))
        for b in budgets
    ]


def empty_sums(budgets: Sequence[int] = (8,)) -> dict[str, float]:
    """The keys of `metric_sums`, all zero (a micro-step without a valid block has these)."""
    sums = {"acc_correct": 0.0, "acc_count": 0.0, "streak_sum": 0.0, "blocks": 0.0}
    sums.update({f"dds{int(b)}_sum": 0.0 for b in budgets})
    return sums


def metric_sums(
    logits: Tensor, labels: Tensor, valid: Tensor, budgets: Sequence[int] = (8,)
) -> dict[str, float]:
    """Sums and counts over M blocks: logits [M, K-1, V], labels [M, K-1], valid [M, K-1].

    Returns acc_correct, acc_count, streak_sum, blocks and dds{b}_sum for each budget.
    """
    budgets = [int(b) for b in budgets]
    sums = empty_sums(budgets)
    m, slots, vocab = logits.shape
    if m == 0 or slots == 0:
        return sums
    step = max(1, _CHUNK_ELEMENTS // (slots * vocab))
    with torch.no_grad():
        for lo in range(0, m, step):
            chunk = slice(lo, lo + step)
            _add_chunk(sums, logits[chunk].detach(), labels[chunk], valid[chunk].bool(), budgets)
    return sums


def _add_chunk(sums: dict, logits: Tensor, labels: Tensor, valid: Tensor, budgets: list) -> None:
    labels = labels.to(logits.device)
    valid = valid.to(logits.device)
    correct = logits.argmax(dim=-1) == labels
    counted = valid[:, 0]
    sums["acc_correct"] += float((correct & valid).sum())
    sums["acc_count"] += float(valid.sum())
    sums["streak_sum"] += float(streak_lengths(correct, valid)[counted].sum())
    sums["blocks"] += float(counted.sum())
    if budgets and bool(counted.any()):
        depths = _tree_sums(
            logits[counted], labels[counted], leading_valid(valid[counted]), budgets
        )
        for b, total in zip(budgets, depths, strict=True):
            sums[f"dds{b}_sum"] += float(total)


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
