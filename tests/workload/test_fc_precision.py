"""optim.fc_precision: the drafter's fc in fp32 (the default off CUDA), TF32 (auto on CUDA), or
bf16 under autocast, which rounds the training noise away on large features (the numbers:
bench/gpu_fc_precision.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from workload.config import ConfigError, load_config
from workload.drafter.model import DFlashDrafter, build_drafter_config
from workload.train.build_run import resolve_fc_precision, set_fc_precision


@pytest.mark.parametrize(
    ("value", "device", "resolved"),
    [("auto", "cuda", "tf32"), ("auto", "cpu", "fp32"), ("tf32", "cpu", "fp32"),
     ("tf32", "cuda", "tf32"), ("bf16", "cpu", "bf16"), ("fp32", "cuda", "fp32")],
)  # fmt: skip
def test_auto_is_tf32_on_cuda_and_fp32_elsewhere(value, device, resolved):
    assert resolve_fc_precision(value, device) == resolved


def drafter() -> DFlashDrafter:
    target = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         vocab_size=256)  # fmt: skip
    config = build_drafter_config(target, num_layers=1, block_size=4, mask_token_id=255,
                                  target_layer_ids=[1, 2])  # fmt: skip
    torch.manual_seed(0)
    return DFlashDrafter(config).float()


def test_bf16_rounds_the_noise_away_and_fp32_keeps_it():
    """Under the trainer's bf16 autocast, features of +-16 plus noise of +-0.01 (under half of
    bf16's steps there, 0.0625 and 0.125): the fp32 fc sees the noise, the bf16 fc does not."""
    model = drafter()
    features = 16.0 * torch.randn(1, 8, 128).sign()
    noisy = features + (torch.rand_like(features) * 2 - 1) * 0.01
    for value, sees_noise in (("auto", True), ("bf16", False)):
        assert set_fc_precision(model, value, "cpu") == ("fp32" if value == "auto" else "bf16")
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            clean, moved = model.project_context(features), model.project_context(noisy)
        assert (not torch.equal(clean, moved)) is sees_noise, value
    model.fc_autocast = False
    with torch.no_grad():
        exact = model.project_context(features)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        assert torch.equal(model.project_context(features), exact)  # fp32 under autocast


def test_a_bad_value_names_the_key():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["optim.fc_precision=fp16"])
    assert "optim.fc_precision" in str(info.value) and "tf32" in str(info.value)
