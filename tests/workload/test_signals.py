"""Training signals that match evaluation: slots past the first off-trajectory data token are
invalid (so `streak` counts what tau counts), validity stops at the end of an assistant turn,
the loss is one weighted mean over the whole step (micro-batches and ranks), and training and
evaluation draft through the same embedding scale, output multiplier and softcap."""

from __future__ import annotations

import functools
import sys

import pytest
import torch
import torch.distributed as dist

from tests.workload.test_distributed import on_ranks
from tests.workload.test_train import config
from workload.data.batches import Batch, eligible_anchors
from workload.data.chat import render_chat
from workload.drafter.targets import load_target
from workload.eval import decode as E
from workload.train import loop as T
from workload.train import loss as L
from workload.train import step as S

ANCHORS_ALL = "data.num_anchors=512"  # more than a row's eligible positions: every one, no draw
NO_NOISE = ("noise.start=0", "noise.end=0")


@pytest.fixture(scope="module")
def group():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return T.init_distributed()


@pytest.fixture(scope="module")
def loaded(tiny_dense):
    """The tiny target and tokenizer, loaded once for the module's runs."""
    return load_target(tiny_dense / "target")


class FixedStream:
    """The batches a test chose, in order (in place of the run's BatchStream)."""

    def __init__(self, batches: list[Batch]) -> None:
        self.batches = list(batches)

    def next_batch(self) -> Batch:
        return self.batches.pop(0)


def make_run(build, loaded, d, *overrides: str) -> T.Run:
    target, tokenizer = loaded
    cfg = config(build, *NO_NOISE, ANCHORS_ALL, *overrides)
    run, _ = T.setup(cfg, d, say=lambda m: None, target=target, tokenizer=tokenizer)
    return run


def rows(batch: Batch, lo: int, hi: int) -> Batch:
    return Batch(*(t[lo:hi] for t in (batch.input_ids, batch.loss_mask, batch.doc_ids,
                                      batch.position_ids)))  # fmt: skip


def one_row(ids: list[int], supervised_from: int) -> Batch:
    n = len(ids)
    mask = torch.arange(n) >= supervised_from
    return Batch(torch.tensor([ids]), mask[None], torch.zeros(1, n, dtype=torch.long),
                 torch.arange(n)[None])  # fmt: skip


# ---------------------------------------------------------------- the on-trajectory rule


def test_slots_after_the_first_off_trajectory_token_are_invalid():
    greedy = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])  # the target's token at p + 1
    data = torch.tensor([[0, 5, 6, 0, 8, 9, 10, 11]])  # leaves the greedy path at position 3
    anchors, real = torch.tensor([[0]]), torch.tensor([[True]])
    mask = torch.ones_like(data, dtype=torch.bool)
    labels, valid = L.teacher_labels(greedy, anchors, real, mask, None, 7, input_ids=data)
    assert labels.tolist() == [[[5, 6, 7, 8, 9, 10]]]
    # slot 3 (position 3) still has a true label: the verifier reaches it; slot 4 does not
    assert valid.tolist() == [[[True, True, True, False, False, False]]]
    _, off = L.teacher_labels(greedy, anchors, real, mask, None, 7)
    assert off.all()


def _perfect_drafter(monkeypatch) -> list:
    """Draft logits that agree with every label: the drafter's streak is then the number of
    leading valid slots, which is what the rule changes. Records each micro-step's loss sums."""
    seen = []

    def objective(*args, on_logits, **kwargs):
        def hook(logits, labels, valid):
            on_logits(torch.nn.functional.one_hot(labels, logits.shape[-1]).float() * 9, labels,
                      valid)  # fmt: skip

        out = L.objective(*args, on_logits=hook, **kwargs)
        seen.append(out)
        return out

    monkeypatch.setattr(S, "objective", objective)
    return seen


def greedy_data(run: T.Run, batch: Batch, new: int) -> tuple[list[int], int]:
    """The first row's prompt (up to its first supervised token) and the tiny target's own
    greedy continuation of `new` tokens, cut where the full forward disagrees with it."""
    row = batch.input_ids[0].tolist()
    start = int(batch.loss_mask[0].int().argmax())
    ids = row[:start]
    for _ in range(new):
        ids.append(int(S.target_forward(run, one_row(ids, start)).greedy[0, -1]))
    agree = S.target_forward(run, one_row(ids, start)).greedy[0, :-1] == torch.tensor(ids[1:])
    return ids[: start + int(agree[start - 1 :].int().cumprod(0).sum())], start


def _signals(run: T.Run, batch: Batch, seen: list) -> tuple[float, float, float]:
    sums = S.StepSums(run.device)
    S.micro_step(run, batch, 0, sums)
    got = sums.to_dict()
    return got["streak_sum"] / got["blocks"], got["acc_count"], float(seen[-1].weight)


def test_the_rule_changes_streak_on_other_data_and_not_on_greedy_data(
    tiny_dense, loaded, group, monkeypatch
):
    seen = _perfect_drafter(monkeypatch)
    block = "drafter.block_size=8"
    on = make_run(tiny_dense, loaded, group, block)
    off = make_run(tiny_dense, loaded, group, block, "loss.on_trajectory=false")
    ids, start = greedy_data(on, on.stream.next_batch(), new=48)
    assert len(ids) - start >= 40
    greedy = one_row(ids, start)
    assert _signals(on, greedy, seen) == _signals(off, greedy, seen)
    other = list(ids)
    for p in range(start + 4, len(ids), 9):  # leave the greedy path every 9 tokens
        other[p] = (other[p] + 1) % 100 + 10
    data = one_row(other, start)
    streak_on, slots_on, weight_on = _signals(on, data, seen)
    streak_off, slots_off, weight_off = _signals(off, data, seen)
    print(f"\nnon-greedy data, perfect drafter: streak {streak_off:.3f} -> {streak_on:.3f}, "
          f"valid slots {slots_off:.0f} -> {slots_on:.0f}")  # fmt: skip
    assert streak_on < streak_off - 0.5
    assert slots_on < slots_off and weight_on < weight_off


def test_the_rule_is_on_by_default_and_off_is_in_the_audit(tiny_dense):
    from workload.config import audit

    assert config(tiny_dense).loss.on_trajectory is True
    recipe = [i for i in audit(config(tiny_dense)) if i.level != "peer"]
    assert not [i for i in recipe if i.key == "loss.on_trajectory"]
    items = [i for i in audit(config(tiny_dense, "loss.on_trajectory=false"))
             if i.key == "loss.on_trajectory"]  # fmt: skip
    assert len(items) == 1 and "verifier never reaches" in items[0].line()


# ---------------------------------------------------------------- turns


def test_validity_stops_at_the_end_of_an_assistant_turn(chat_tokenizer):
    chat = [
        {"role": "user", "content": "add 2 and 3"},
        {"role": "assistant", "content": "2 plus 3 is 5, the sum."},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "good, 5 it is."},
    ]
    ex = render_chat(chat_tokenizer, chat, max_length=256)
    mask = torch.tensor([ex.loss_mask]).bool()
    turn = mask.int().diff(prepend=torch.zeros(1, 1, dtype=torch.int32)).eq(1).cumsum(1)  # 1, 2
    second = int((turn == 2).int().argmax())
    first_end = int(mask[0, :second].nonzero().max())
    assert second - first_end - 1 < 31  # the user turn between them fits in one block
    anchors = eligible_anchors(mask)[0].nonzero()[:, 0][None]
    real = torch.ones_like(anchors, dtype=torch.bool)
    greedy = torch.zeros_like(mask, dtype=torch.long)
    _, valid = L.teacher_labels(greedy, anchors, real, mask, None, 32)
    pos = L.slot_positions(anchors, 32)
    from_first = (anchors <= first_end).unsqueeze(-1).expand_as(pos)
    assert from_first.any() and valid[from_first].any()
    assert not (valid & from_first & (pos > first_end)).any()  # never into the next turn
    assert (valid & ~from_first).any()  # the second turn's own blocks still train


# ---------------------------------------------------------------- one normaliser per step


def two_rows(run: T.Run) -> Batch:
    """Two rows with very different numbers of valid slots: the second supervises 6 tokens."""
    batch = S.trim_padding(run.stream.next_batch())
    mask = batch.loss_mask.clone()
    keep = mask[1].nonzero()[:6, 0]
    mask[1] = False
    mask[1, keep] = True
    return Batch(batch.input_ids, mask, batch.doc_ids, batch.position_ids)


def step_grads(run: T.Run, batches: list[Batch]) -> tuple[float, torch.Tensor]:
    """(loss, flat gradient) of one step over `batches`, before clipping."""
    run.stream = FixedStream(batches)
    loss = S.accumulate(run, 0, S.StepSums(run.device))
    grads = [p.grad.flatten() for p in run.drafter.parameters()]
    out = float(loss), torch.cat(grads).clone()
    run.optimizer.zero_grad(set_to_none=True)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_grad_accumulation_gives_the_gradient_of_one_micro_batch(tiny_dense, loaded, group):
    whole = make_run(tiny_dense, loaded, group, "optim.batch_size=2")
    batch = two_rows(whole)
    loss, grad = step_grads(whole, [batch])
    accum = make_run(tiny_dense, loaded, group, "optim.batch_size=1", "optim.grad_accum=2")
    loss2, grad2 = step_grads(accum, [rows(batch, 0, 1), rows(batch, 1, 2)])
    assert loss2 == pytest.approx(loss, rel=1e-5)
    assert rel(grad2, grad) < 1e-4
    # the mean of per-micro-batch means (the old normalisation) is another gradient here
    single = make_run(tiny_dense, loaded, group, "optim.batch_size=1")
    old = step_grads(single, [rows(batch, 0, 1)])[1] + step_grads(single, [rows(batch, 1, 2)])[1]
    print(f"\ngradient, accum 2 vs one micro-batch: {rel(grad2, grad):.2e}; mean of "
          f"micro-batch means vs one micro-batch: {rel(old / 2, grad):.3f}")  # fmt: skip
    assert rel(old / 2, grad) > 0.05


_RANK = """
import sys, torch
from tests.workload.test_signals import make_run, rows, step_grads
from workload.train import loop as T
from workload.data.batches import Batch
from workload.drafter.targets import load_target
from pathlib import Path
build, batch_file, out = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
d = T.init_distributed()
batch = Batch(*torch.load(batch_file))
run = make_run(build, load_target(build / "target"), d, "optim.batch_size=1")
loss, grad = step_grads(run, [rows(batch, d.rank, d.rank + 1)])
share = torch.tensor(loss)  # each rank's share: their mean is the step's loss (as logged)
torch.distributed.all_reduce(share)
if d.rank == 0:
    torch.save((float(share) / d.world, grad), out)
"""


def test_two_ranks_give_the_gradient_of_one(tiny_dense, loaded, group, tmp_path):
    whole = make_run(tiny_dense, loaded, group, "optim.batch_size=2")
    batch = two_rows(whole)
    loss, grad = step_grads(whole, [batch])
    torch.save(tuple(batch.__dict__.values()), tmp_path / "batch.pt")
    out = on_ranks(_RANK, str(tiny_dense), str(tmp_path / "batch.pt"), str(tmp_path / "g.pt"),
                   timeout=300)  # fmt: skip
    assert [p.returncode for p in out] == [0, 0], [p.stderr[-2000:] for p in out]
    loss2, grad2 = torch.load(tmp_path / "g.pt")
    print(f"\ngradient, 2 ranks vs 1: {rel(grad2, grad):.2e}", file=sys.stderr)
    assert loss2 == pytest.approx(loss, rel=1e-5)
    assert rel(grad2, grad) < 1e-4


# ---------------------------------------------------------------- target conventions


CONVENTIONS = {"input_embedding_scale": 2.0, "output_multiplier": 0.5,
               "final_logit_softcapping": 3.0}  # fmt: skip


def test_training_and_eval_draft_with_the_same_conventions(tiny_dense, loaded, group, monkeypatch):
    run = make_run(tiny_dense, loaded, group)
    run.drafter.config.dflash_config = {**(run.drafter.config.dflash_config or {}), **CONVENTIONS}
    seen: dict = {"logits": []}
    handle = run.ddp.module.register_forward_pre_hook(
        lambda mod, args: seen.__setitem__("embeds", args[1].clone())
    )
    real = S.objective

    def objective(hidden, head, *args, on_logits, **kw):
        seen["hidden"], seen["head"] = hidden.detach(), head
        hook = functools.partial(lambda f, x, *a: (seen["logits"].append(x), f(x, *a)), on_logits)
        return real(hidden, head, *args, on_logits=hook, **kw)

    monkeypatch.setattr(S, "objective", objective)
    batch = S.trim_padding(run.stream.next_batch())
    try:
        S.micro_step(run, batch, 0, S.StepSums(run.device))
    finally:
        handle.remove()
    logits = torch.cat([x.flatten(0, 1) for x in seen["logits"]])
    assert logits.abs().max() <= 3.0 and logits.abs().max() > 2.0  # softcapped at 3
    plain = run.target.get_output_embeddings()(seen["hidden"])
    want = torch.tanh(plain * 0.5 / 3.0) * 3.0
    assert torch.allclose(logits, want.flatten(0, 1), atol=1e-5)
    assert torch.allclose(E.draft_logits(run.drafter, seen["hidden"], plain_head(run)), want,
                          atol=1e-5)  # fmt: skip
    mask_row = run.target.get_input_embeddings()(torch.tensor([run.cfg.drafter.mask_token_id]))
    assert torch.allclose(seen["embeds"][:, 1], 2.0 * mask_row)  # slot 1 of the first block
    session = E.DraftSession(run.drafter, run.target)
    captured = {}
    hook = run.drafter.register_forward_pre_hook(
        lambda mod, args, kwargs: captured.update(kwargs), with_kwargs=True
    )
    try:
        draft = session.draft(torch.zeros(1, 3, run.drafter.fc.in_features), 5, 3, 4)
    finally:
        hook.remove()
    mask = torch.tensor([[5] + [run.cfg.drafter.mask_token_id] * 3])
    assert torch.allclose(
        captured["noise_embedding"], 2.0 * run.target.get_input_embeddings()(mask)
    )
    assert draft.abs().max() <= 3.0


def plain_head(run: T.Run) -> torch.nn.Module:
    return run.target.get_output_embeddings()
