"""One definition of a DDTree of budget b (ddtree.py), for training's dds{b} and eval's DDTree tau:
b nodes besides the root, added best-first by the cumulative log-probability of their path."""

from __future__ import annotations

import math
import random

import pytest
import torch

from workload.drafter.acceptance import build_tree, label_ranks, tree_depth, tree_depths
from workload.train.metrics import ddtree_depth

# Three draft slots over tokens a..d, probabilities chosen by hand (no ties between paths).
A, B, C, D = range(4)
PROBS = [
    {A: 0.6, B: 0.3, C: 0.1},  # slot 1
    {A: 0.9, B: 0.1},  # slot 2 (x = A, y = B)
    {A: 0.6, B: 0.4},  # slot 3 (p = A, q = B)
]
# Paths by probability: a .6, a-x .54, a-x-p .324, b .3, a-x-q .216, b-x .27 ...
# best-first: a, a-x, a-x-p, b, b-x (.27), a-x-q (.216), b-x-p (.162), b-x-q (.108), c (.1)
EXPECTED = [  # (parent index from 0, -1: root; depth; token) in the order they join
    (-1, 1, A),  # 0: a
    (0, 2, A),  # 1: a-x
    (1, 3, A),  # 2: a-x-p
    (-1, 1, B),  # 3: b
    (3, 2, A),  # 4: b-x
    (1, 3, B),  # 5: a-x-q
    (4, 3, A),  # 6: b-x-p
    (4, 3, B),  # 7: b-x-q
    (-1, 1, C),  # 8: c
]


def _rows(width: int = 4):
    """Descending log-probabilities and their token ids per slot (missing tokens: -inf)."""
    logprobs, ids = [], []
    for probs in PROBS:
        order = sorted(range(width), key=lambda t: -probs.get(t, 0.0))
        ids.append(order)
        logprobs.append([math.log(probs[t]) if t in probs else -math.inf for t in order])
    return logprobs, ids


def _tokens(nodes, ids):
    return [(parent, depth, ids[depth - 1][rank]) for parent, depth, rank in nodes]


@pytest.mark.parametrize("budget", range(1, 10))
def test_budget_counts_the_nodes_besides_the_root_best_first(budget):
    logprobs, ids = _rows()
    nodes = _tokens(build_tree(logprobs, budget), ids)
    assert nodes == EXPECTED[:budget]
    assert max(depth for _, depth, _ in nodes) <= min(budget, len(PROBS))


@pytest.mark.parametrize(
    ("labels", "depths"),  # depths for budgets 1..9
    [
        ([A, A, A], [1, 2, 3, 3, 3, 3, 3, 3, 3]),
        ([B, A, A], [0, 0, 0, 1, 2, 2, 3, 3, 3]),
        ([A, A, B], [1, 2, 2, 2, 2, 3, 3, 3, 3]),
        ([C, A, A], [0, 0, 0, 0, 0, 0, 0, 0, 1]),
        ([A, B, A], [1, 1, 1, 1, 1, 1, 1, 1, 1]),  # a-y (.06) never beats the rest
        ([D, A, A], [0] * 9),
    ],
)
def test_accepted_depth_follows_the_labels_down_the_tree(labels, depths):
    logprobs, ids = _rows()
    ranks = label_ranks(torch.tensor(ids), torch.tensor(labels)).tolist()
    full = torch.tensor(logprobs).exp()  # training's metric takes the draft's distributions
    logits = torch.where(full > 0, full.log(), torch.full_like(full, -1e9))
    dense = torch.full((3, 4), -1e9)
    for slot, row in enumerate(ids):
        dense[slot, row] = logits[slot]
    for budget, want in enumerate(depths, 1):
        assert tree_depth(logprobs, ranks, 3, budget) == want, budget
        assert ddtree_depth(dense, torch.tensor(labels), 3, budget) == want, budget  # dds{b}
        batched = tree_depths(
            torch.tensor([logprobs]), torch.tensor([ranks]), torch.tensor([3]), budget
        )
        assert batched.tolist() == [want], budget


def test_tree_depth_is_the_depth_of_the_label_path_in_the_built_tree():
    rng = random.Random(0)
    for _ in range(200):
        depths, width, budget = rng.randint(1, 6), rng.randint(1, 6), rng.randint(1, 20)
        rows = [sorted((math.log(rng.random()) for _ in range(width)), reverse=True)]
        rows += [sorted((math.log(rng.random()) for _ in range(width)), reverse=True)
                 for _ in range(depths - 1)]  # fmt: skip
        ranks = [rng.randrange(width + 1) for _ in range(depths)]  # width: not among them
        nodes = build_tree(rows, budget)
        assert len(nodes) == min(budget, sum(width ** (d + 1) for d in range(depths)))
        node, deepest = -1, 0
        while True:
            child = next(
                (i for i, (parent, depth, rank) in enumerate(nodes)
                 if parent == node and rank == ranks[depth - 1]),
                None,
            )  # fmt: skip
            if child is None:
                break
            node, deepest = child, nodes[child][1]
        assert tree_depth(rows, ranks, depths, budget) == deepest
