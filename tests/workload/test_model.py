"""The drafter: training and inference agree, attention isolation, z-lab compatibility."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache, Qwen3Config

from workload.drafter.model import (
    DFlashDrafter,
    build_drafter_config,
    default_target_layer_ids,
    select_target_features,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
    pytest.mark.usefixtures("one_thread"),
]


H, LAYER_IDS, K, MASK = 64, [1, 4, 5], 4, 7
MIXED = (["sliding_attention", "full_attention"], 8)
FULL = (["full_attention", "full_attention"], None)
SLIDING = (["sliding_attention", "sliding_attention"], 8)


def _target_config(**kw) -> Qwen3Config:
    base = dict(
        hidden_size=H,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=8,
        intermediate_size=96,
        vocab_size=128,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    )
    return Qwen3Config(**{**base, **kw})


def _drafter(kind=MIXED, seed=0) -> DFlashDrafter:
    layer_types, window = kind
    cfg = build_drafter_config(
        _target_config(),
        num_layers=len(layer_types),
        block_size=K,
        mask_token_id=MASK,
        target_layer_ids=LAYER_IDS,
        layer_types=layer_types,
        sliding_window=window,
    )
    torch.manual_seed(seed)
    return DFlashDrafter(cfg).eval()


def _features(seq_len: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(
        1, seq_len, len(LAYER_IDS) * H, generator=torch.Generator().manual_seed(seed)
    )


def _embeds(num_blocks: int, seed: int = 2) -> torch.Tensor:
    return torch.randn(1, num_blocks * K, H, generator=torch.Generator().manual_seed(seed))


def _blocks(model, feats, embeds, anchors, valid=None, positions=None, docs=None, impl="chunked"):
    anchors = torch.tensor([anchors])
    valid = torch.ones_like(anchors, dtype=torch.bool) if valid is None else torch.tensor([valid])
    positions = torch.arange(feats.shape[1])[None] if positions is None else positions
    return model.forward_blocks(
        embeds,
        model.project_context(feats),
        anchors,
        valid,
        positions,
        doc_ids=docs,
        attention=impl,
    )


def _infer(model, feats, embeds, start, cache=None):
    """z-lab's inference call: context rows [start - c, start), block at positions start.."""
    c = feats.shape[1]
    positions = torch.arange(start - c, start + embeds.shape[1])[None]
    return model(
        position_ids=positions,
        noise_embedding=embeds,
        target_hidden=feats,
        past_key_values=cache,
        use_cache=cache is not None,
    )


def test_default_target_layer_ids_follow_zlab():
    from dflash.model import build_target_layer_ids

    assert default_target_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(64) == [1, 16, 31, 46, 61]
    assert default_target_layer_ids(40, 1) == [20]
    for layers in range(8, 80, 3):
        for n in (1, 3, 5, 8):
            assert default_target_layer_ids(layers, n) == build_target_layer_ids(layers, n)


def test_select_target_features_takes_layer_outputs():
    hidden_states = [torch.full((1, 3, 2), float(i)) for i in range(9)]  # embeddings + 8 layers
    got = select_target_features(hidden_states, [0, 3, 7])
    assert got.shape == (1, 3, 6)
    assert got[0, 0].tolist() == [1.0, 1.0, 4.0, 4.0, 8.0, 8.0]
    with pytest.raises(ValueError, match="out of range"):
        select_target_features(hidden_states, [8])


@pytest.mark.parametrize("kind", [MIXED, FULL, SLIDING], ids=["mixed", "full", "sliding"])
def test_training_blocks_equal_inference_forward(kind):
    model, feats = _drafter(kind), _features(30)
    anchors = [3, 11, 19, 26]
    embeds = _embeds(len(anchors))
    with torch.no_grad():
        train = _blocks(model, feats, embeds, anchors)
        for j, a in enumerate(anchors):
            infer = _infer(model, feats[:, :a], embeds[:, j * K : (j + 1) * K], a)
            torch.testing.assert_close(train[:, j * K : (j + 1) * K], infer, rtol=1e-5, atol=1e-5)


def test_inference_with_cache_matches_training():
    model, feats = _drafter(MIXED), _features(30)
    embeds = _embeds(2)
    with torch.no_grad():
        train = _blocks(model, feats, embeds, [12, 25])
        cache = DynamicCache(config=model.config)
        cache.activate_past_recording()
        first = _infer(model, feats[:, :12], embeds[:, :K], 12, cache)
        cache.crop(12 - cache.get_seq_length())  # drop the block's K/V, as the verify loop does
        second = _infer(model, feats[:, 12:25], embeds[:, K:], 25, cache)
    torch.testing.assert_close(first, train[:, :K], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second, train[:, K:], rtol=1e-5, atol=1e-5)


def test_packed_documents_equal_separate_rows():
    model = _drafter(MIXED)
    doc0, doc1 = _features(15, seed=3), _features(15, seed=4)
    packed = torch.cat([doc0, doc1], dim=1)
    docs = torch.tensor([[0] * 15 + [1] * 15])
    positions = torch.cat([torch.arange(15), torch.arange(15)])[None]
    embeds = _embeds(2)
    with torch.no_grad():
        train = _blocks(model, packed, embeds, [9, 26], positions=positions, docs=docs)
        alone0 = _infer(model, doc0[:, :9], embeds[:, :K], 9)
        alone1 = _infer(model, doc1[:, :11], embeds[:, K:], 11)
    torch.testing.assert_close(train[:, :K], alone0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(train[:, K:], alone1, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["chunked", "dense", "flex"])
@pytest.mark.parametrize("kind", [FULL, SLIDING], ids=["full", "sliding"])
def test_a_block_sees_only_its_context_and_itself(kind, impl):
    model, feats = _drafter(kind), _features(40)
    docs = torch.tensor([[0] * 8 + [1] * 32])
    anchors, j, a = [5, 20, 30], 2, 30
    embeds = _embeds(len(anchors))

    def block(f=feats, e=embeds):
        with torch.no_grad():
            return _blocks(model, f, e, anchors, docs=docs, impl=impl)[:, j * K : (j + 1) * K]

    def moved_features(rows):
        f = feats.clone()
        f[:, rows] += 2.0
        return block(f=f)

    base = block()
    hidden = list(range(a, 40)) + list(range(0, 8))  # at/after the anchor, the other document
    if kind is SLIDING:
        hidden += list(range(8, a - 8 + 1))  # outside the window (8) for every slot
    torch.testing.assert_close(moved_features(hidden), base, rtol=0, atol=1e-6)
    other = embeds.clone()
    other[:, : j * K] += 2.0  # every other block
    torch.testing.assert_close(block(e=other), base, rtol=0, atol=1e-6)
    assert not torch.allclose(moved_features([a - 1]), base, atol=1e-4)
    own = embeds.clone()
    own[:, j * K + 2] += 2.0  # slot 2 of the block itself
    moved = (block(e=own) - base).abs().amax(dim=(0, 2)) > 1e-4
    assert moved.tolist() == ([False, False, True, True] if kind is SLIDING else [True] * K)


@pytest.mark.parametrize("kind, builds", [(FULL, 1), (MIXED, 2)])
def test_flex_builds_one_block_mask_per_layer_kind_per_forward(kind, builds, monkeypatch):
    from torch.nn.attention import flex_attention

    calls = []
    real = flex_attention.create_block_mask
    monkeypatch.setattr(
        flex_attention, "create_block_mask", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    model = _drafter((kind[0] * 2, kind[1]))  # 4 layers
    with torch.no_grad():
        flex = _blocks(model, _features(30), _embeds(3), [4, 11, 20], impl="flex")
        dense = _blocks(model, _features(30), _embeds(3), [4, 11, 20], impl="dense")
    assert len(calls) == builds
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


def test_padding_blocks_are_finite_and_ignore_context():
    model, feats = _drafter(MIXED), _features(20)
    embeds = _embeds(2)
    with torch.no_grad():
        out = _blocks(model, feats, embeds, [6, 0], valid=[True, False])
        moved = _blocks(model, feats + 1.0, embeds, [6, 0], valid=[True, False])
    assert torch.isfinite(out).all()
    torch.testing.assert_close(moved[:, K:], out[:, K:])


def test_chunked_and_dense_agree_with_gradients():
    grads = {}
    for impl in ("chunked", "dense"):
        model, feats = _drafter(MIXED), _features(40)
        docs = torch.tensor([[0] * 18 + [1] * 22])
        positions = torch.cat([torch.arange(18), torch.arange(22)])[None]
        out = _blocks(
            model,
            feats,
            _embeds(4),
            [2, 10, 25, 0],
            valid=[True, True, True, False],
            positions=positions,
            docs=docs,
            impl=impl,
        )
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads[impl] = (out.detach(), {n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(grads["chunked"][0], grads["dense"][0], rtol=1e-5, atol=1e-5)
    for name, grad in grads["dense"][1].items():
        assert grad is not None and grad.abs().sum() > 0, name
        torch.testing.assert_close(grads["chunked"][1][name], grad, rtol=1e-4, atol=1e-5)


def test_config_json_is_zlab_format(tmp_path):
    _drafter(MIXED).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert cfg["dflash_config"] == {
        "target_layer_ids": LAYER_IDS,
        "mask_token_id": MASK,
        "block_size": K,
    }
    assert (cfg["block_size"], cfg["num_target_layers"], cfg["sliding_window"]) == (K, 8, 8)
    assert cfg["layer_types"] == MIXED[0] and cfg["model_type"] == "qwen3"
    assert cfg["rope_parameters"]["rope_theta"] == 5e5


def test_weights_are_one_file_whatever_the_default_shard_size(tmp_path, monkeypatch):
    """Contract §4 and resume read model.safetensors: a drafter bigger than transformers'
    default shard size (simulated by a 16 KB default) is still saved as that one file."""
    from transformers import PreTrainedModel

    real = PreTrainedModel.save_pretrained

    def small_default(self, directory, *args, max_shard_size="16KB", **kwargs):
        return real(self, directory, *args, max_shard_size=max_shard_size, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", small_default)
    drafter = _drafter(MIXED)
    assert sum(p.numel() * 4 for p in drafter.parameters()) > 64 * 1024
    drafter.save_pretrained(tmp_path / "one")
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == [
        "config.json", "dflash.py", "model.safetensors"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="saved in shards"):
        drafter.save_pretrained(tmp_path / "sharded", max_shard_size="16KB")


def _compare_inference(ours, theirs):
    feats, embeds = _features(24), _embeds(1)
    with torch.no_grad():
        for start in (10, 24):  # inside and beyond the sliding window
            got = _infer(ours, feats[:, :start], embeds, start)
            want = _infer(theirs, feats[:, :start], embeds, start)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        caches = [DynamicCache(config=m.config) for m in (ours, theirs)]
        outs = [
            _infer(m, feats[:, :16], embeds, 16, c)
            for m, c in zip((ours, theirs), caches, strict=True)
        ]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_our_checkpoint_loads_in_zlab_and_ours(tmp_path):
    from dflash.model import DFlashDraftModel

    original = _drafter(MIXED, seed=5)
    original.save_pretrained(tmp_path)
    ours = DFlashDrafter.from_pretrained(tmp_path).eval()
    theirs, info = DFlashDraftModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert theirs.target_layer_ids == LAYER_IDS and theirs.mask_token_id == MASK
    assert theirs.block_size == K and theirs.layers[0].self_attn.sliding_window == 8
    _compare_inference(original, ours)
    _compare_inference(ours, theirs.eval())


def test_zlab_drafter_loads_into_ours(tmp_path):
    from dflash.model import DFlashDraftModel

    # the shape of a published drafter config: block_size top-level, ids in dflash_config
    cfg = Qwen3Config(
        hidden_size=H,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        intermediate_size=96,
        vocab_size=128,
        layer_types=["sliding_attention", "full_attention"],
        use_sliding_window=True,
        sliding_window=8,
        block_size=K,
        num_target_layers=8,
        architectures=["DFlashDraftModel"],
        dflash_config={"target_layer_ids": LAYER_IDS, "mask_token_id": MASK},
    )
    torch.manual_seed(6)
    theirs = DFlashDraftModel(cfg).eval()
    theirs.save_pretrained(tmp_path)
    ours, info = DFlashDrafter.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert (ours.target_layer_ids, ours.mask_token_id, ours.block_size) == (LAYER_IDS, MASK, K)
    _compare_inference(ours.eval(), theirs)


def _tiny_hybrid_configs():
    from transformers import Qwen3_5Config, Qwen3_5TextConfig, Qwen3NextConfig

    common = dict(
        hidden_size=H,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=8,
        vocab_size=128,
    )
    text = Qwen3_5TextConfig(**common, intermediate_size=96)
    nxt = Qwen3NextConfig(**common, intermediate_size=96, moe_intermediate_size=32, num_experts=4)
    wrapped = Qwen3_5Config(text_config=text.to_dict())
    return {"qwen3_5_text": (text, 96), "qwen3_next": (nxt, 3 * H), "qwen3_5": (wrapped, 96)}


@pytest.mark.parametrize("name", ["qwen3_5_text", "qwen3_next", "qwen3_5"])
def test_hybrid_target_config_builds_and_runs(name):
    target, width = _tiny_hybrid_configs()[name]
    cfg = build_drafter_config(
        target,
        num_layers=2,
        block_size=K,
        mask_token_id=MASK,
        target_layer_ids=[1, 3, 5],
        layer_types=MIXED[0],
        sliding_window=8,
    )
    assert (cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads) == (H, 16, 2)
    assert cfg.intermediate_size == width and cfg.num_target_layers == 8
    assert "partial_rotary_factor" not in cfg.rope_parameters  # the drafter rotates all dims
    model = DFlashDrafter(cfg).eval()
    with torch.no_grad():
        out = _blocks(model, _features(20), _embeds(2), [4, 12])
        infer = _infer(model, _features(20)[:, :12], _embeds(2)[:, K:], 12)
    torch.testing.assert_close(out[:, K:], infer, rtol=1e-5, atol=1e-5)


def test_config_builder_refuses_bad_settings():
    target = _target_config()
    ok = dict(num_layers=2, block_size=K, mask_token_id=MASK, target_layer_ids=LAYER_IDS)
    with pytest.raises(ValueError, match="mask_token_id"):
        build_drafter_config(target, **{**ok, "mask_token_id": 128})
    with pytest.raises(ValueError, match="target_layer_ids"):
        build_drafter_config(target, **{**ok, "target_layer_ids": [1, 8]})
    with pytest.raises(ValueError, match="sliding_window"):
        build_drafter_config(target, **ok, layer_types=["sliding_attention"] * 2)


def test_a_published_layout_of_other_heads_trains_as_it_infers():
    """A layout taken from a published drafter (drafter.layout_from): heads, KV heads and
    head dim of its own, not the target's; the training path equals z-lab's inference."""
    cfg = build_drafter_config(_target_config(), num_layers=2, block_size=K, mask_token_id=MASK,
                               target_layer_ids=LAYER_IDS, layer_types=MIXED[0],
                               sliding_window=MIXED[1], num_attention_heads=8,
                               num_key_value_heads=4, head_dim=8, intermediate_size=40)  # fmt: skip
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (8, 4, 8)
    torch.manual_seed(0)
    model, feats = DFlashDrafter(cfg).eval(), _features(30)
    assert model.layers[0].self_attn.q_proj.out_features == 64
    anchors = [5, 17, 26]
    embeds = _embeds(len(anchors))
    with torch.no_grad():
        train = _blocks(model, feats, embeds, anchors)
        for j, a in enumerate(anchors):
            infer = _infer(model, feats[:, :a], embeds[:, j * K : (j + 1) * K], a)
            torch.testing.assert_close(train[:, j * K : (j + 1) * K], infer, rtol=1e-5, atol=1e-5)
