"""DDTree depth: how deep a draft tree of a given node budget follows the teacher's tokens.

The tree (DDTree, Ringel & Romano) is grown best-first from one block's per-slot draft
distributions: a max-heap keyed by the cumulative log-probability of a path; popping node
(depth d, rank r) pushes its next sibling (d, r + 1) and its first child (d + 1, rank 0);
growth stops after `budget` non-root nodes. Only the top min(budget, V) tokens of a slot can
ever enter such a tree, so callers pass those (sorted, descending) instead of full rows.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch
from torch import Tensor


def tree_depth(
    top_logprobs: Sequence[Sequence[float]],
    label_ranks: Sequence[int],
    valid_len: int,
    budget: int,
) -> int:
    """Deepest d <= valid_len such that the labels of depths 1..d form a root path of the tree.

    top_logprobs[i]: descending log-probabilities of slot i + 1 (at least min(budget, V) of
    them); label_ranks[i]: the rank of the label of slot i + 1 in that row (anything not a
    rank below the row width means "not among them"). The tree has len(top_logprobs) depths.
    """
    depths = len(top_logprobs)
    if budget <= 0 or depths == 0 or valid_len <= 0:
        return 0
    width = min(budget, len(top_logprobs[0]))
    ranks = list(label_ranks)[: min(valid_len, depths)]
    ranks += [-1] * (depths - len(ranks))  # depths past valid_len never count
    # entry: (-score, depth index, rank, parent score, parent on the label path)
    heap = [(-top_logprobs[0][0], 0, 0, 0.0, True)]
    best = 0
    for _ in range(budget):
        if not heap:
            break
        neg, d, r, parent, parent_on = heapq.heappop(heap)
        on_path = parent_on and ranks[d] == r
        if on_path:
            best = d + 1
        if r + 1 < width:
            heapq.heappush(heap, (-(parent + top_logprobs[d][r + 1]), d, r + 1, parent, parent_on))
        if d + 1 < depths:
            score = -neg
            heapq.heappush(heap, (-(score + top_logprobs[d + 1][0]), d + 1, 0, score, on_path))
    return best


def label_ranks(top_ids: Tensor, labels: Tensor) -> Tensor:
    """Rank of each label among `top_ids` (last dim); top_ids.shape[-1] when absent."""
    hit = top_ids == labels.unsqueeze(-1)
    width = top_ids.shape[-1]
    first = hit.to(torch.int8).argmax(dim=-1)
    return torch.where(hit.any(dim=-1), first, torch.full_like(first, width))
