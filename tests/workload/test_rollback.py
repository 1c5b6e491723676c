"""The real draft-and-verify loop on a hybrid (Gated DeltaNet) target: the cache rollback leaves
exactly the state of the kept tokens, and the loop's rounds equal the simulation's."""

from __future__ import annotations

import collections

import pytest
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config

from workload.drafter.model import DFlashDrafter
from workload.drafter.targets import force_torch_fallback_off_gpu
from workload.eval.decode import (
    evaluate_drafter,
    greedy_continuation,
    real_generate,
    real_tree_generate,
    target_hidden_states,
)
from workload.eval.rollback import VerifyCache, crop, linear_layers, new_cache

VOCAB, BLOCK, MASK = 32, 8, 31

pytestmark = pytest.mark.usefixtures("one_thread")


def _prompts() -> list[torch.Tensor]:
    return [
        torch.randint(0, VOCAB - 1, (1, 6 + s), generator=torch.Generator().manual_seed(s))
        for s in range(6)
    ]


def _drafter() -> DFlashDrafter:
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_hidden_layers=2, num_target_layers=6,
    )  # fmt: skip
    config.dflash_config = {"target_layer_ids": [1, 3], "mask_token_id": MASK, "block_size": BLOCK}
    drafter = DFlashDrafter(config).eval()
    for layer in drafter.layers:
        layer.self_attn.o_proj.weight.mul_(0.5)
        layer.mlp.down_proj.weight.mul_(0.5)
    return drafter


@pytest.fixture(scope="module")
@torch.no_grad()
def hybrid():
    """A random float32 Qwen3.5-text target (4 Gated DeltaNet layers, 2 full attention) on the
    torch fallback, and a drafter whose mask embedding points at the target's favourite token,
    so its guesses are often right and acceptance lengths vary over the whole block."""
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False,
    )  # fmt: skip
    target = Qwen3_5ForCausalLM(config).eval()
    force_torch_fallback_off_gpu(target)
    counts = collections.Counter()
    for p in _prompts():
        counts.update(greedy_continuation(target, p[0].tolist(), 40, []))
    favourite = counts.most_common(1)[0][0]
    row = target.lm_head.weight[favourite]
    target.model.embed_tokens.weight[MASK] = 3.0 * row / row.norm()
    return target, _drafter()


def _states(cache) -> list[torch.Tensor]:
    """Every tensor of the cache: K/V of attention layers, conv and recurrent states."""
    out = []
    for layer in cache.layers:
        if hasattr(layer, "recurrent_states"):
            out += [layer.conv_states[0], layer.recurrent_states[0]]
        else:
            out += [layer.keys, layer.values]
    return out


def _forward(target, cache, ids, start):
    pos = torch.arange(start, start + len(ids))[None]
    return target(torch.tensor([ids]), position_ids=pos, past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("kept", [1, 3, 7])
@torch.no_grad()
def test_rollback_leaves_exactly_the_state_of_the_kept_tokens(hybrid, kept):
    target = hybrid[0]
    prompt = _prompts()[4][0].tolist()
    block = torch.randint(0, VOCAB, (BLOCK,), generator=torch.Generator().manual_seed(9)).tolist()
    start = len(prompt)

    rolled = VerifyCache(target.config)
    _forward(target, rolled.cache, prompt, 0)
    rolled.before_verify()
    _forward(target, rolled.cache, block, start)
    after_verify = [t.clone() for t in _states(rolled.cache)]
    rolled.keep(start, kept, block, lambda ids, at: _forward(target, rolled.cache, ids, at))

    fresh = new_cache(target.config)  # never saw the rejected tokens
    _forward(target, fresh, prompt, 0)
    _forward(target, fresh, block[:kept], start)
    crop(fresh, start + kept)

    assert len(linear_layers(rolled.cache)) == 4
    assert rolled.cache.get_seq_length() == start + kept
    for got, want in zip(_states(rolled.cache), _states(fresh), strict=True):
        assert torch.equal(got, want)
    # without the rollback, the rejected tokens would stay in the recurrent states
    changed = [not torch.equal(a, b) for a, b in zip(after_verify, _states(fresh), strict=False)]
    assert any(changed)
    # and one forward over the whole kept prefix agrees to float32 rounding
    whole = new_cache(target.config)
    _forward(target, whole, prompt + block[:kept], 0)
    crop(whole, start + kept)
    for got, want in zip(_states(rolled.cache), _states(whole), strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    nxt = block[kept]
    want = _forward(target, whole, [nxt], start + kept).logits
    got = _forward(target, rolled.cache, [nxt], start + kept).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_real_loop_equals_the_simulation_on_a_hybrid_target(hybrid):
    """fp32: every round of the real loop (which rolls the Gated DeltaNet state back) accepts
    what the simulation from one forward says it does, and emits the greedy continuation."""
    target, drafter = hybrid
    seen, recomputed = [], 0
    for max_new, prompt in [(40, p) for p in _prompts()] + [(23, _prompts()[1])]:
        ids = prompt[0].tolist()
        seq = ids + greedy_continuation(target, ids, max_new, [])
        hidden = target_hidden_states(target, seq)
        sim = evaluate_drafter(drafter, target, hidden, seq, len(ids), max_new, [], [3, 16])
        tokens, lengths = real_generate(drafter, target, prompt, max_new, [])
        assert tokens == seq[len(ids) :]
        assert lengths == [r.produced for r in sim.chain]
        for b in (3, 16):
            tokens, tree = real_tree_generate(drafter, target, prompt, max_new, [], b)
            assert tokens == seq[len(ids) :]
            assert tree == [r.produced for r in sim.trees[b]], b
        seen += lengths
        recomputed += sum(1 for n in lengths if n < BLOCK)
    counts = collections.Counter(seen)
    assert len(counts) >= 3 and max(counts) == BLOCK and counts[1] < 0.9 * len(seen), counts
    assert recomputed > 0  # rounds that rolled back
