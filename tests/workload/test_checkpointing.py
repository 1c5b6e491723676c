"""Activation checkpointing of the drafter's layers (drafter.activation_checkpointing): a step of
the tiny target gives the same loss and gradients with it as without it (fp32 and bf16 autocast,
chunked and dense attention, packed rows), each layer runs again in backward, a checkpointed
forward under autocast leaves no bf16 copies of the weights behind, and two ranks under DDP and
ZeRO-1 train the same run either way."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from tests.workload.test_model import _blocks, _embeds, _features, _target_config
from tests.workload.test_train import config, read_log
from tests.workload.test_train_ranks import assert_same_log, largest_difference, train_cli, weights
from workload.config import ConfigError, load_config
from workload.drafter.model import DFlashDrafter, build_drafter_config, checkpointing_on
from workload.train import loop as T
from workload.train.step import StepSums, micro_step, trim_padding

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def group():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return T.init_distributed()


def one_step(run: T.Run, batch, checkpointed: bool):
    """Loss, gradients and forward calls per drafter layer of one micro-step from the same
    random state (anchors and noise)."""
    run.drafter.checkpoint_layers = checkpointed
    calls = [0] * len(run.drafter.layers)
    hooks = [layer.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
             for i, layer in enumerate(run.drafter.layers)]  # fmt: skip
    torch.manual_seed(1)
    run.anchor_gen.manual_seed(2)
    run.optimizer.zero_grad(set_to_none=True)
    try:
        loss = micro_step(run, batch, 0, StepSums(run.device))
    finally:
        for hook in hooks:
            hook.remove()
    grads = {n: p.grad.detach().clone() for n, p in run.drafter.named_parameters()}
    return loss.total.detach(), grads, calls


SETTINGS = {
    "fp32 chunked": ["attention=chunked"],
    "fp32 dense": ["attention=dense"],
    "bf16 autocast": ["optim.precision=bf16"],
    "packed rows": ["data.pack=true", "drafter.layer_types=[sliding_attention,full_attention,"
                    "sliding_attention]", "drafter.sliding_window=16"],
}  # fmt: skip


@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
def test_a_checkpointed_step_has_the_same_loss_and_gradients(tiny_dense, group, settings):
    cfg = config(tiny_dense, "drafter.num_layers=3", *settings)
    run, _ = T.setup(cfg, group, say=lambda m: None)
    batch = trim_padding(run.stream.next_batch())
    loss, grads, calls = one_step(run, batch, checkpointed=False)
    loss_c, grads_c, calls_c = one_step(run, batch, checkpointed=True)
    assert calls == [1, 1, 1] and calls_c == [2, 2, 2]  # each layer runs again in backward
    torch.testing.assert_close(loss_c, loss, rtol=0, atol=1e-6)
    assert grads_c.keys() == grads.keys()
    for name, grad in grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grads_c[name], grad, rtol=0, atol=1e-6, msg=name)


def alive_after(fn) -> int:
    """Bytes torch allocated while running fn and still holds when it returns."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    stack, alive = list(prof.profiler.kineto_results.experimental_event_tree()), 0
    while stack:
        node = stack.pop()
        if node.tag == torch._C._profiler._EventType.Allocation:
            alive += node.extra_fields.alloc_size  # negative for a free
        stack.extend(node.children)
    del result
    return alive


def test_a_checkpointed_forward_under_autocast_keeps_no_copies_of_the_weights():
    """Autocast caches the bf16 cast of every fp32 weight until the step leaves autocast; a
    checkpointed layer keeps nothing for backward, so the cache alone would keep every layer's
    casts. After a checkpointed forward (still inside autocast) less is alive under bf16 than
    in fp32 (which casts nothing), far less than the casts of the layers' weights."""
    cfg = build_drafter_config(_target_config(), num_layers=4, block_size=4, mask_token_id=7,
                               target_layer_ids=[1, 4, 5])  # fmt: skip
    torch.manual_seed(0)
    model = DFlashDrafter(cfg).train()
    model.checkpoint_layers = True
    feats, embeds = _features(40), _embeds(4)

    def forward(dtype: torch.dtype) -> int:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            return alive_after(lambda: _blocks(model, feats, embeds, [5, 12, 20, 30]))

    casts = 2 * sum(p.numel() for n, p in model.layers.named_parameters() if "proj" in n)
    fp32, bf16 = forward(torch.float32), forward(torch.bfloat16)
    assert bf16 <= fp32 < casts, (bf16, fp32, casts)


def test_auto_is_on_for_cuda_only_and_the_trainer_follows_the_key(tiny_dense, group):
    assert checkpointing_on(None, "cuda") and not checkpointing_on(None, "cpu")
    assert checkpointing_on(True, "cpu") and not checkpointing_on(False, "cuda")
    for value, expected in (("null", False), ("true", True), ("false", False)):
        cfg = config(tiny_dense, f"drafter.activation_checkpointing={value}")
        run, _ = T.setup(cfg, group, say=lambda m: None)
        assert run.drafter.checkpoint_layers is expected, value


def test_a_value_other_than_true_false_or_null_is_refused_in_one_line(tiny_dense):
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["drafter.activation_checkpointing=auto"])
    assert str(caught.value) == (
        "--set drafter.activation_checkpointing=auto: drafter.activation_checkpointing: "
        "expected true or false, got 'auto'"
    )


@pytest.mark.slow
def test_two_ranks_under_zero1_train_the_same_run_with_checkpointing(tiny_dense, tmp_path):
    """DDP (bucket-view gradients, no_sync over grad_accum) and ZeRO-1 over two gloo ranks:
    the logged values and the weights after 4 steps do not depend on checkpointing."""
    runs = {}
    for value in ("false", "true"):
        run_dir = tmp_path / value
        done = train_cli(tiny_dense, run_dir, "--set", "optim.max_steps=4", "--set",
                         "optim.grad_accum=2", "--set", "dist.sharding=zero1", "--set",
                         f"drafter.activation_checkpointing={value}")  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        notes = json.loads((run_dir / "plan.json").read_text())["notes"]
        assert any("under activation checkpointing" in n for n in notes) is (value == "true")
        runs[value] = run_dir
    assert_same_log(read_log(runs["true"]), read_log(runs["false"]), rel=1e-6)
    assert largest_difference(weights(runs["true"], 4), weights(runs["false"], 4)) <= 1e-6
