"""Teacher labels, slot weights and the objective on hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from workload.train.loss import (
    Objective,
    decay_weights,
    dpace_weights,
    gather_slots,
    greedy_tokens,
    objective,
    teacher_labels,
    weighted_mean,
)


def test_decay_weights_start_at_one_for_slot_one():
    w = decay_weights(16, 7.0)
    assert w.shape == (15,)
    assert w[0] == 1.0
    assert math.isclose(w[1].item(), math.exp(-1 / 7), rel_tol=1e-6)
    assert math.isclose(w[14].item(), math.exp(-14 / 7), rel_tol=1e-6)


def test_weighted_mean_normalises_by_weights_of_valid_slots():
    per_slot = torch.tensor([[1.0, 2.0, 3.0]])
    weights = torch.tensor([[1.0, 0.5, 0.25]])
    valid = torch.tensor([[True, True, False]])
    assert math.isclose(weighted_mean(per_slot, weights, valid).item(), 2.0 / 1.5, rel_tol=1e-6)
    assert weighted_mean(per_slot, weights, torch.zeros_like(valid)).item() == 0.0


def test_dpace_weights_by_hand():
    ce = -torch.log(torch.tensor([[0.5, 0.25, 1.0]]))
    all_valid = torch.ones(1, 3, dtype=torch.bool)
    w = dpace_weights(ce, all_valid, alpha=0.5)
    # q~ = .75, .625, 1 -> P = .75, .46875, .46875 -> suffix sums
    assert torch.allclose(w, torch.tensor([[1.6875, 0.9375, 0.46875]]))
    middle_invalid = torch.tensor([[True, False, True]])
    w = dpace_weights(ce, middle_invalid, alpha=0.5)
    assert torch.allclose(w, torch.tensor([[1.5, 0.0, 0.75]]))
    assert not dpace_weights(ce.requires_grad_(), all_valid, 0.5).requires_grad


def test_teacher_labels_positions_and_validity():
    # greedy[p] is the target's token for position p+1; make it p + 100 to read positions back.
    S, K = 10, 4
    greedy = (torch.arange(S) + 100).unsqueeze(0)
    loss_mask = torch.ones(1, S, dtype=torch.bool)
    loss_mask[0, 4] = False
    doc_ids = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 1, 1, 1]])
    anchors = torch.tensor([[1, 5, 8]])
    valid_anchor = torch.tensor([[True, True, False]])
    labels, valid = teacher_labels(greedy, anchors, valid_anchor, loss_mask, doc_ids, K)
    # slot k of anchor a is labelled with greedy[a + k - 1] = a + k - 1 + 100
    assert labels[0, 0].tolist() == [101, 102, 103]
    assert labels[0, 1].tolist() == [105, 106, 107]
    # anchor 1: slot 3 -> position 4 has loss_mask 0
    assert valid[0, 0].tolist() == [True, True, False]
    # anchor 5: slot 2 -> position 7 is another document
    assert valid[0, 1].tolist() == [True, False, False]
    # a padding block is never valid
    assert valid[0, 2].tolist() == [False, False, False]


def test_teacher_labels_stop_at_the_row_end():
    greedy = torch.arange(6).unsqueeze(0)
    mask = torch.ones(1, 6, dtype=torch.bool)
    labels, valid = teacher_labels(
        greedy, torch.tensor([[3]]), torch.tensor([[True]]), mask, None, 5
    )
    assert valid[0, 0].tolist() == [True, True, False, False]  # positions 4, 5 in; 6, 7 out
    assert labels[0, 0, :2].tolist() == [3, 4]


def test_greedy_tokens_is_chunked_argmax():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(2, 7, 8)
    assert torch.equal(greedy_tokens(hidden, head, chunk=3), head(hidden).argmax(-1))


def test_gather_slots_reads_positions_a_plus_k_minus_1():
    values = torch.arange(10.0).view(1, 10, 1).expand(1, 10, 2)
    out = gather_slots(values, torch.tensor([[2, 8]]), block_size=4)
    assert out.shape == (1, 2, 3, 2)
    assert out[0, 0, :, 0].tolist() == [2.0, 3.0, 4.0]
    assert out[0, 1, :, 0].tolist() == [
        8.0,
        9.0,
        9.0,
    ]  # clamped past the end (those slots are invalid)


def _case(m=5, k1=3, h=8, v=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(h, v, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=g))
    hidden = torch.randn(m, k1, h, generator=g, requires_grad=True)
    labels = torch.randint(0, v, (m, k1), generator=g)
    valid = torch.rand(m, k1, generator=g) > 0.3
    return head, hidden, labels, valid


def test_ce_objective_matches_hand_formula_and_chunking_changes_nothing():
    head, hidden, labels, valid = _case()
    obj = Objective(type="ce", gamma=2.0)
    ce = F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten(), reduction="none").view(5, 3)
    w = decay_weights(4, 2.0).expand(5, 3) * valid
    expected = (ce * w).sum() / w.sum()
    grads = []
    for chunk in (1, 2, 64):
        hidden.grad = None
        loss = objective(hidden, head, labels, valid, obj, chunk_blocks=chunk)
        assert torch.allclose(loss, expected, atol=1e-6)
        loss.backward()
        grads.append(hidden.grad.clone())
    assert torch.allclose(grads[0], grads[2], atol=1e-6)
    assert torch.allclose(grads[1], grads[2], atol=1e-6)


def test_uniform_weighting_is_the_plain_mean_over_valid_slots():
    head, hidden, labels, valid = _case()
    ce = F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten(), reduction="none").view(5, 3)
    loss = objective(hidden, head, labels, valid, Objective(weighting="uniform"))
    assert torch.allclose(loss, ce[valid].mean(), atol=1e-6)


def test_logits_hook_sees_every_block_once():
    head, hidden, labels, valid = _case(m=7)
    seen = []
    loss = objective(
        hidden, head, labels, valid, Objective(), chunk_blocks=3,
        on_logits=lambda logits, lab, val: seen.append(logits.shape[0]),
    )  # fmt: skip
    loss.backward()  # the checkpoint recomputation must not call the hook again
    assert seen == [3, 3, 1]


def test_kl_is_zero_when_draft_equals_teacher_and_blend_mixes():
    head, hidden, labels, valid = _case()
    teacher = hidden.detach().clone()
    kl = objective(hidden, head, labels, valid, Objective(type="kl"), teacher_hidden=teacher)
    assert abs(kl.item()) < 1e-5
    ce = objective(hidden, head, labels, valid, Objective(type="ce"))
    blend = Objective(type="blend", kl_weight=0.7)
    mixed = objective(hidden, head, labels, valid, blend, teacher_hidden=teacher)
    assert torch.allclose(mixed, 0.3 * ce, atol=1e-5)
    with pytest.raises(ValueError, match="teacher_hidden"):
        objective(hidden, head, labels, valid, Objective(type="kl"))


def test_kl_has_temperature_squared_scale():
    head, hidden, labels, valid = _case(m=2, k1=1)
    valid = torch.ones_like(valid)
    teacher = torch.randn_like(hidden)
    for t in (1.0, 2.0):
        obj = Objective(type="kl", kl_temperature=t, weighting="uniform")
        got = objective(hidden, head, labels, valid, obj, teacher_hidden=teacher)
        p = F.log_softmax(head(teacher) / t, -1)
        q = F.log_softmax(head(hidden) / t, -1)
        want = (p.exp() * (p - q)).sum(-1).mean() * t * t
        assert torch.allclose(got, want, atol=1e-5)


def test_dpace_objective_uses_dpace_weights():
    head, hidden, labels, valid = _case()
    ce = F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten(), reduction="none").view(5, 3)
    w = dpace_weights(ce, valid, 0.5)
    expected = (ce * w).sum() / (w * valid).sum()
    got = objective(hidden, head, labels, valid, Objective(weighting="dpace", dpace_alpha=0.5))
    assert torch.allclose(got, expected, atol=1e-6)
