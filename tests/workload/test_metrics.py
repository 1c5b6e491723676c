"""acc / streak / dds against slow references written here from the definitions."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from workload.drafter.acceptance import tree_depth, tree_depths
from workload.train import metrics
from workload.train.metrics import DraftMetrics, ddtree_depth, finalize, metric_sums, streak_lengths

# ----------------------------------------------------------------------------- references


def ref_streak(pred: list[int], labels: list[int], valid: list[bool]) -> int:
    n = 0
    for p, t, v in zip(pred, labels, valid, strict=True):
        if not (v and p == t):
            break
        n += 1
    return n


def ref_tree_depth(logprobs: list[list[float]], labels: list[int], valid_len: int, budget: int):
    """Enumerate every token path (full vocabulary, every depth); the budget-b best-first tree
    is the set of the b best-scoring paths; return the deepest valid label prefix in it."""
    vocab, depths = len(logprobs[0]), len(logprobs)
    scored = []
    for d in range(1, depths + 1):
        for path in itertools.product(range(vocab), repeat=d):
            scored.append((sum(logprobs[i][t] for i, t in enumerate(path)), path))
    scored.sort(key=lambda x: -x[0])
    tree = {path for _, path in scored[:budget]}
    best = 0
    for d in range(1, min(valid_len, depths) + 1):
        if tuple(labels[:d]) in tree:
            best = d
    return best


def ref_sums(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, budgets):
    sums = {"acc_correct": 0, "acc_count": 0, "streak_sum": 0, "blocks": 0}
    sums.update({f"dds{b}_sum": 0 for b in budgets})
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    for m in range(logits.shape[0]):
        pred = [int(torch.argmax(logits[m, s])) for s in range(logits.shape[1])]
        lab, val = labels[m].tolist(), valid[m].tolist()
        for p, t, v in zip(pred, lab, val, strict=True):
            if v:
                sums["acc_count"] += 1
                sums["acc_correct"] += p == t
        if not val[0]:
            continue
        sums["blocks"] += 1
        sums["streak_sum"] += ref_streak(pred, lab, val)
        valid_len = next((i for i, v in enumerate(val) if not v), len(val))
        for b in budgets:
            sums[f"dds{b}_sum"] += ref_tree_depth(logprobs[m].tolist(), lab, valid_len, b)
    return sums


def random_case(seed: int, m: int, slots: int, vocab: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(m, slots, vocab, generator=g) * (0.5 + 3 * torch.rand(1, generator=g))
    # labels: often the draft's top-1 or top-2 (so streaks and trees go deep), else random
    order = logits.argsort(dim=-1, descending=True)
    pick = torch.randint(0, 4, (m, slots), generator=g).clamp(max=vocab - 1)
    labels = order.gather(-1, pick[..., None])[..., 0]
    noise = torch.randint(0, vocab, (m, slots), generator=g)
    labels = torch.where(torch.rand(m, slots, generator=g) < 0.2, noise, labels)
    valid = torch.rand(m, slots, generator=g) < 0.85
    return logits, labels, valid


# ----------------------------------------------------------------------------- random agreement


@pytest.mark.parametrize("seed", range(12))
def test_sums_equal_slow_reference_on_random_blocks(seed):
    slots, vocab = [(3, 5), (4, 4), (5, 3), (2, 7)][seed % 4]
    logits, labels, valid = random_case(seed, m=9, slots=slots, vocab=vocab)
    budgets = (1, 3, 8, 16)
    got = metric_sums(logits, labels, valid, budgets)
    want = ref_sums(logits, labels, valid, budgets)
    assert got == pytest.approx({k: float(v) for k, v in want.items()})


def test_ddtree_depth_equals_reference_per_block():
    hits = 0
    for seed in range(40):
        logits, labels, valid = random_case(1000 + seed, m=1, slots=4, vocab=4)
        lp = torch.log_softmax(logits[0].double(), -1).tolist()
        for budget in (2, 5, 8, 20):
            for valid_len in (1, 3, 4):
                want = ref_tree_depth(lp, labels[0].tolist(), valid_len, budget)
                got = ddtree_depth(logits[0], labels[0], valid_len, budget)
                assert got == want, (seed, budget, valid_len)
                hits += want >= 2
    assert hits > 20  # the cases reach past depth 1, so the comparison means something


# ----------------------------------------------------------------------------- hand-built cases


def _logits(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows).log()


TREE_CASE = _logits(
    [
        [0.50, 0.40, 0.05, 0.05],  # the label (token 1) is the draft's 2nd choice
        [0.97, 0.01, 0.01, 0.01],
        [0.90, 0.04, 0.03, 0.03],
    ]
)
TREE_LABELS = torch.tensor([1, 0, 0])


@pytest.mark.parametrize(
    ("budget", "depth"),
    # best-first order: (0) -.69, (0,0) -.72, (0,0,0) -.83, (1) -.92, (1,0) -.95, (1,0,0) -1.05
    [(1, 0), (3, 0), (4, 1), (5, 2), (6, 3), (8, 3)],
)
def test_tree_accepts_deeper_than_the_chain(budget, depth):
    assert ddtree_depth(TREE_CASE, TREE_LABELS, 3, budget) == depth
    sums = metric_sums(
        TREE_CASE[None], TREE_LABELS[None], torch.ones(1, 3, dtype=torch.bool), (budget,)
    )
    assert sums["streak_sum"] == 0  # the chain stops at slot 1
    assert sums[f"dds{budget}_sum"] == depth


def test_invalid_slots_cap_depth_and_uncounted_blocks():
    logits = TREE_CASE[None].repeat(3, 1, 1)
    labels = torch.tensor([[0, 0, 0], [1, 0, 0], [0, 0, 0]])
    valid = torch.tensor([[True, True, False], [True, True, True], [False, True, True]])
    sums = metric_sums(logits, labels, valid, (8,))
    assert sums["blocks"] == 2  # the third block's slot 1 is invalid: not a block
    assert sums["acc_count"] == 7 and sums["acc_correct"] == 6  # only (1,slot 1) is wrong
    assert sums["streak_sum"] == 2 + 0  # block 0 stops at its invalid slot 3
    assert sums["dds8_sum"] == 2 + 3
    assert ddtree_depth(TREE_CASE, torch.tensor([1, 0, 0]), 2, 8) == 2


def test_streak_is_per_block_not_a_product_of_accuracies():
    # block A: right, wrong; block B: wrong, right. Per-slot accuracy 0.5 each, so a
    # product-of-marginals "streak" would be 0.5 + 0.25 = 0.75; the real mean streak is 0.5.
    correct = torch.tensor([[True, False], [False, True]])
    valid = torch.ones(2, 2, dtype=torch.bool)
    assert streak_lengths(correct, valid).tolist() == [1, 0]
    logits = torch.zeros(2, 2, 3)
    logits[:, :, 0] = 1.0  # argmax 0 everywhere
    labels = torch.where(correct, 0, 2)
    assert finalize(metric_sums(logits, labels, valid))["streak"] == 0.5


def test_streak_stops_at_an_invalid_slot_even_if_later_slots_match():
    correct = torch.tensor([[True, True, True, True]])
    valid = torch.tensor([[True, False, True, True]])
    assert streak_lengths(correct, valid).tolist() == [1]


# ----------------------------------------------------------------------------- aggregation


def test_sums_add_up_across_batches_and_chunks(monkeypatch):
    logits, labels, valid = random_case(7, m=40, slots=6, vocab=11)
    whole = metric_sums(logits, labels, valid, (8, 16))
    halves = [
        metric_sums(logits[a:b], labels[a:b], valid[a:b], (8, 16)) for a, b in [(0, 17), (17, 40)]
    ]
    assert {k: halves[0][k] + halves[1][k] for k in whole} == pytest.approx(whole)
    monkeypatch.setattr(metrics, "_CHUNK_ELEMENTS", 6 * 11 * 3)  # 3 blocks per chunk
    assert metric_sums(logits, labels, valid, (8, 16)) == pytest.approx(whole)


def test_finalize_means_and_empty_input():
    sums = {
        "acc_correct": 3.0,
        "acc_count": 4.0,
        "streak_sum": 5.0,
        "blocks": 2.0,
        "dds8_sum": 7.0,
        "dds16_sum": 8.0,
    }
    assert finalize(sums) == {"acc": 0.75, "streak": 2.5, "dds8": 3.5, "dds16": 4.0}
    empty = metric_sums(
        torch.zeros(2, 3, 5),
        torch.zeros(2, 3, dtype=torch.long),
        torch.zeros(2, 3, dtype=torch.bool),
    )
    assert empty["blocks"] == 0
    assert all(math.isnan(v) for v in finalize(empty).values())


def test_bf16_logits_are_accepted():
    logits, labels, valid = random_case(3, m=5, slots=4, vocab=6)
    got = metric_sums(logits.bfloat16(), labels, valid, (8,))
    want = ref_sums(logits.bfloat16().float(), labels, valid, (8,))
    assert got == pytest.approx({k: float(v) for k, v in want.items()})


# ----------------------------------------------------------------------------- on the device


def _tree_case(seed: int, m: int, depths: int, top: int, ties: bool):
    """Descending top log-probabilities (steps of 0, 0.5 or 1 when `ties`: scores tie all the
    time), label ranks mostly 0 (paths go deep), sometimes absent (-1 or >= top)."""
    g = torch.Generator().manual_seed(seed)
    if ties:
        steps = torch.tensor([0.0, 0.5, 1.0])[torch.randint(0, 3, (m, depths, top), generator=g)]
    else:
        steps = torch.rand(m, depths, top, generator=g) * 2
    values = -steps.cumsum(dim=-1)
    ranks = torch.where(
        torch.rand(m, depths, generator=g) < 0.7, 0, torch.randint(0, 3, (m, depths), generator=g)
    )
    absent = torch.rand(m, depths, generator=g) < 0.1
    ranks = torch.where(absent, torch.randint(-1, top + 2, (m, depths), generator=g), ranks)
    valid_len = torch.randint(0, depths + 1, (m,), generator=g)
    return values, ranks, valid_len


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_tree_depths_equal_tree_depth_for_every_budget(seed, ties):
    g = torch.Generator().manual_seed(seed)
    depths, top = (
        int(torch.randint(1, 16, (1,), generator=g)),
        int(torch.randint(1, 33, (1,), generator=g)),
    )
    values, ranks, valid_len = _tree_case(seed, 24, depths, top, ties)
    deep = 0
    for budget in range(1, 33):
        got = tree_depths(values, ranks, valid_len, budget).tolist()
        want = [
            tree_depth(values[i].tolist(), ranks[i].tolist(), int(valid_len[i]), budget)
            for i in range(values.shape[0])
        ]
        assert got == want, (seed, ties, budget)
        deep += sum(w >= 3 for w in want)
    assert depths < 3 or deep > 0  # the trees do reach past depth 2


def test_tree_depths_break_ties_as_the_heap_does():
    # Every score ties within a depth: heapq pops by (depth, rank, parent score, parent on the
    # path) then, so the budget-b tree is a fixed set of nodes whatever the labels.
    values = torch.full((1, 3, 4), -1.0)
    for ranks, budget in itertools.product(itertools.product(range(4), repeat=3), (1, 2, 4, 5, 9)):
        labels = torch.tensor([ranks])
        want = tree_depth(values[0].tolist(), list(ranks), 3, budget)
        assert tree_depths(values, labels, torch.tensor([3]), budget).tolist() == [want]
    # equal scores, different depths: the shallower node first; equal parent scores: the one
    # whose parent is off the label path first (False < True)
    values = torch.tensor([[[0.0, 0.0], [0.0, 0.0]]])
    for ranks in itertools.product(range(2), repeat=2):
        for budget in range(1, 7):
            want = tree_depth(values[0].tolist(), list(ranks), 2, budget)
            got = tree_depths(values, torch.tensor([ranks]), torch.tensor([2]), budget).item()
            assert got == want, (ranks, budget)


def test_tree_depths_of_no_blocks_no_budget_no_valid_slot():
    values, ranks, _ = _tree_case(0, 3, 4, 5, ties=False)
    assert tree_depths(values, ranks, torch.tensor([4, 4, 4]), 0).tolist() == [0, 0, 0]
    assert tree_depths(values, ranks, torch.tensor([0, 0, 0]), 8).tolist() == [0, 0, 0]
    assert tree_depths(values[:0], ranks[:0], torch.tensor([], dtype=torch.long), 8).shape == (0,)


def test_draft_metrics_sum_chunks_without_reading_the_device():
    # what the trainer's loss hook does: several chunks, one vector of sums at the end
    logits, labels, valid = random_case(11, m=30, slots=3, vocab=5)
    collect = DraftMetrics((8, 16), logits.device)
    for lo in range(0, 30, 7):
        collect(logits[lo : lo + 7], labels[lo : lo + 7], valid[lo : lo + 7])
    vector = collect.sums()
    assert vector.dtype == torch.float64 and vector.shape == (6,)
    want = ref_sums(logits, labels, valid, (8, 16))
    assert dict(zip(want, vector.tolist(), strict=True)) == pytest.approx(
        {k: float(v) for k, v in want.items()}
    )
    assert DraftMetrics((8,), logits.device).sums().tolist() == [0.0] * 5
