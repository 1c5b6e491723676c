"""How much of a draft the target's greedy tokens accept: the chain's streak, and the DDTree
of a given node budget and how deep it follows the teacher's tokens.

The definition (one for training's `dds{b}` and eval's DDTree tau, as the official DDTree code
builds its trees, Ringel & Romano): the root is the block's first token (the committed bonus
token); the draft's slots 1..K-1 give one distribution per depth 1..K-1. Nodes are added
best-first by the cumulative log-probability of their path: a max-heap that starts with the best
token of slot 1; popping node (depth d, rank r) adds it to the tree and pushes its next sibling
(d, r + 1) and its first child (d + 1, rank 0). The budget b is the number of nodes besides the
root: growth stops after b pops, so a tree never holds more than b nodes below its root nor
reaches a depth beyond min(b, K - 1). Ties pop in heapq's order of (depth, rank). The accepted
depth is the deepest d such that the teacher's tokens of depths 1..d form a root path; a greedy
verifier of the tree accepts that many drafts and commits one more. Only the top min(b, V)
tokens of a slot can enter a tree, so callers pass those (sorted, descending).

`streak_lengths` is the chain's accepted length per block (training's `streak`, eval's
rounds). `build_tree` lists a tree's nodes; `tree_depth` is the readable reference of the depth (one
block, Python floats, a heap); `tree_depths` grows the trees of many blocks at once on their
device, with the same result, ties included.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch
from torch import Tensor


def build_tree(top_logprobs: Sequence[Sequence[float]], budget: int) -> list[tuple[int, int, int]]:
    """The tree's nodes in the order they are added: (parent index or -1 for the root, depth
    1.., rank of its token in its slot's row). top_logprobs[i]: descending, slot i + 1."""
    depths = len(top_logprobs)
    if budget <= 0 or depths == 0:
        return []
    width = min(budget, len(top_logprobs[0]))
    nodes: list[tuple[int, int, int]] = []
    heap = [
        (-top_logprobs[0][0], 0, 0, 0.0, -1)
    ]  # (-score, depth index, rank, parent score, parent)
    while heap and len(nodes) < budget:
        neg, d, r, parent_score, parent = heapq.heappop(heap)
        nodes.append((parent, d + 1, r))
        if r + 1 < width:
            sibling = parent_score + top_logprobs[d][r + 1]
            heapq.heappush(heap, (-sibling, d, r + 1, parent_score, parent))
        if d + 1 < depths:
            child = -neg + top_logprobs[d + 1][0]
            heapq.heappush(heap, (-child, d + 1, 0, -neg, len(nodes) - 1))
    return nodes


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


def tree_depths(
    top_logprobs: Tensor, label_ranks: Tensor, valid_len: Tensor, budget: int
) -> Tensor:
    """`tree_depth` of M blocks at once, without leaving the device: top_logprobs [M, D, T]
    (descending), label_ranks [M, D], valid_len [M] -> depths [M] long.

    The heap of a block never holds more than budget + 1 entries (one per popped node: the next
    sibling of its children), so each block gets budget + 1 frontier slots: a popped node's
    next sibling takes over its slot, its first child the slot of the round. Each round pops,
    per block, the smallest (-score, depth, rank, parent score, parent on the label path) as
    heapq does; scores are float64 sums in the same order as `tree_depth`'s Python floats.
    """
    m, depths, top = top_logprobs.shape
    device = top_logprobs.device
    best = torch.zeros(m, dtype=torch.long, device=device)
    if budget <= 0 or depths == 0 or m == 0:
        return best
    width = min(budget, top)
    lp = top_logprobs.double()
    rows = torch.arange(m, device=device)
    past = torch.arange(depths, device=device) >= valid_len.to(device)[:, None]
    ranks = label_ranks.to(device).masked_fill(past, -1)  # depths past valid_len never count
    frontier = _Frontier(m, budget + 1, device)
    frontier.put(slice(0, 1), lp[:, :1, 0], 0, 0, 0.0, True, True)  # the root
    for i in range(budget):
        left = frontier.alive.any(dim=1, keepdim=True)
        pick = frontier.heap_top()[:, None]
        d, r, score, parent, parent_on = frontier.take(pick)
        on_path = left & parent_on & (ranks.gather(1, d) == r)
        best = torch.where(on_path[:, 0], d[:, 0] + 1, best)
        nxt = (r + 1).clamp(max=width - 1)  # the next sibling takes the popped slot
        sibling = parent + lp[rows[:, None], d, nxt]
        frontier.put(pick, sibling, d, nxt, parent, parent_on, left & (r + 1 < width))
        below = (d + 1).clamp(max=depths - 1)  # the first child takes the slot of the round
        child = score + lp[rows[:, None], below, 0]
        slot = slice(i + 1, i + 2)
        frontier.put(slot, child, below, 0, score, on_path, left & (d + 1 < depths))
    return best


class _Frontier:
    """Candidate nodes of M trees, [M, slots] each: score, depth, rank, parent score, whether
    the parent is on the label path, and whether the slot holds a candidate."""

    def __init__(self, m: int, slots: int, device: torch.device) -> None:
        self.score = torch.zeros(m, slots, dtype=torch.float64, device=device)
        self.parent = torch.zeros_like(self.score)
        self.depth = torch.zeros(m, slots, dtype=torch.long, device=device)
        self.rank = torch.zeros_like(self.depth)
        self.parent_on = torch.zeros(m, slots, dtype=torch.bool, device=device)
        self.alive = torch.zeros_like(self.parent_on)

    def put(self, at: Tensor | slice, *values) -> None:
        """Write (score, depth, rank, parent, parent_on, alive) of one candidate per tree into
        slot `at`: a [M, 1] index (tensor values) or a slice of one slot (tensors or scalars)."""
        fields = (self.score, self.depth, self.rank, self.parent, self.parent_on, self.alive)
        for field, value in zip(fields, values, strict=True):
            if isinstance(at, slice):
                field[:, at] = value
            else:
                field.scatter_(1, at, value.to(field.dtype))

    def take(self, at: Tensor) -> tuple[Tensor, ...]:
        """(depth, rank, score, parent, parent_on) of slot `at` [M, 1] of each tree."""
        fields = (self.depth, self.rank, self.score, self.parent, self.parent_on)
        return tuple(f.gather(1, at) for f in fields)

    def heap_top(self) -> Tensor:
        """[M] the slot heapq would pop: the smallest (-score, depth, rank, parent, parent_on)
        among the candidates (some slot where a tree has none)."""
        best = self.alive
        for key in (-self.score, self.depth, self.rank, self.parent, self.parent_on.to(torch.int8)):
            top = math.inf if key.is_floating_point() else torch.iinfo(key.dtype).max
            masked = key.masked_fill(~best, top)
            best = best & (masked == masked.amin(dim=1, keepdim=True))
        return best.to(torch.int8).argmax(dim=1)


def label_ranks(top_ids: Tensor, labels: Tensor) -> Tensor:
    """Rank of each label among `top_ids` (last dim); top_ids.shape[-1] when absent."""
    hit = top_ids == labels.unsqueeze(-1)
    width = top_ids.shape[-1]
    first = hit.to(torch.int8).argmax(dim=-1)
    return torch.where(hit.any(dim=-1), first, torch.full_like(first, width))


def streak_lengths(correct: Tensor, valid: Tensor) -> Tensor:
    """[M] number of leading slots that are valid and correct."""
    ok = (correct.bool() & valid.bool()).to(torch.int32)
    return ok.cumprod(dim=1).sum(dim=1)
