"""The DFlash drafter: Qwen3-style layers whose attention also reads the target's features.

Parameter names and config.json match z-lab's published drafters (`dflash.DFlashDraftModel`), so
either side loads the other's checkpoint. The drafter has no embedding and no LM head: callers use
the frozen target's. Its inference half is workload/drafter/dflash_module.py, which every checkpoint ships
as `dflash.py` (what `AutoModel.from_pretrained(..., trust_remote_code=True)` loads); this module
adds the config builder and training (all blocks of a row at once, activation checkpointing).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3Config

from workload.common.layout import MODULE_NAME, WEIGHTS_NAME
from workload.config import recipe_layer_ids
from workload.drafter import dflash_module
from workload.drafter.attention import block_attention
from workload.drafter.dflash_module import (
    DFlashAttention,
    DFlashDraftModel,
    DFlashLayer,
    dflash_setting,
)

ARCHITECTURE = "DFlashDraftModel"
MAX_SHARD_SIZE = "1000GB"
LAYER_TYPES = ("full_attention", "sliding_attention")
# rope keys of multimodal/partial-rotary targets that a Qwen3-style drafter does not use
_TARGET_ONLY_ROPE_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")


def default_target_layer_ids(num_target_layers: int, n: int = 5) -> list[int]:
    """z-lab's default: n ids spread evenly over 1..N-3 (n == 1 -> [N // 2])."""
    if n < 1:
        raise ValueError(f"need at least one target layer, got n={n}")
    if n > 1 and num_target_layers < 4:
        raise ValueError(f"target has {num_target_layers} layers; need at least 4 for {n} ids")
    return recipe_layer_ids(num_target_layers, n)


def select_target_features(hidden_states: Sequence[Tensor], layer_ids: Sequence[int]) -> Tensor:
    """Concatenate the outputs of decoder layers `layer_ids`: id k is hidden_states[k + 1]."""
    num_layers = len(hidden_states) - 1
    bad = [k for k in layer_ids if not 0 <= k < num_layers]
    if bad:
        raise ValueError(f"target layer ids {bad} out of range 0..{num_layers - 1}")
    return torch.cat([hidden_states[k + 1] for k in layer_ids], dim=-1)


def build_drafter_config(
    target_config,
    *,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: list[int],
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    intermediate_size: int | None = None,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    head_dim: int | None = None,
) -> Qwen3Config:
    """A drafter config in z-lab's format, sized from the target's (text) config where the
    heads, KV heads, head dim and MLP width are not given (a published layout gives them)."""
    text = (
        target_config.get_text_config()
        if hasattr(target_config, "get_text_config")
        else target_config
    )
    layer_types = list(layer_types or ["full_attention"] * num_layers)
    _check_drafter_args(
        text, num_layers, block_size, mask_token_id, target_layer_ids, layer_types, sliding_window
    )
    heads = num_attention_heads or text.num_attention_heads
    kv_heads = num_key_value_heads or (
        getattr(text, "num_key_value_heads", None) if num_attention_heads is None else heads
    )
    if heads % (kv_heads or heads):
        raise ValueError(f"{heads} attention heads are not a multiple of {kv_heads} KV heads")
    dflash = {
        "target_layer_ids": list(target_layer_ids),
        "mask_token_id": mask_token_id,
        "block_size": block_size,
    }
    return Qwen3Config(
        hidden_size=text.hidden_size,
        intermediate_size=intermediate_size or _default_intermediate(text),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        head_dim=head_dim or getattr(text, "head_dim", None) or text.hidden_size // heads,
        hidden_act=getattr(text, "hidden_act", "silu"),
        rms_norm_eps=text.rms_norm_eps,
        vocab_size=text.vocab_size,
        max_position_embeddings=text.max_position_embeddings,
        rope_parameters=_drafter_rope(text),
        attention_bias=False,
        tie_word_embeddings=False,
        layer_types=layer_types,
        use_sliding_window=sliding_window is not None,
        sliding_window=sliding_window,
        max_window_layers=num_layers,
        architectures=[ARCHITECTURE],
        auto_map={"AutoModel": "dflash.DFlashDraftModel"},
        block_size=block_size,
        num_target_layers=text.num_hidden_layers,
        dflash_config=dflash,
    )


def _check_drafter_args(
    text, num_layers, block_size, mask_token_id, layer_ids, layer_types, sliding_window
) -> None:
    if num_layers < 1 or block_size < 2:
        raise ValueError(
            f"need num_layers >= 1 and block_size >= 2, got {num_layers}, {block_size}"
        )
    if not 0 <= mask_token_id < text.vocab_size:
        raise ValueError(
            f"mask_token_id {mask_token_id} is not a row of the target embedding "
            f"(vocab {text.vocab_size})"
        )
    bad = [k for k in layer_ids if not 0 <= k < text.num_hidden_layers]
    if not layer_ids or bad or len(set(layer_ids)) != len(layer_ids):
        raise ValueError(
            f"target_layer_ids {layer_ids} must be distinct ids in 0..{text.num_hidden_layers - 1}"
        )
    if len(layer_types) != num_layers or any(t not in LAYER_TYPES for t in layer_types):
        raise ValueError(f"layer_types {layer_types} must list {num_layers} of {LAYER_TYPES}")
    if "sliding_attention" in layer_types and sliding_window is None:
        raise ValueError("sliding_attention layers need a sliding_window")
    if sliding_window is not None and sliding_window < block_size:
        raise ValueError(f"sliding_window {sliding_window} is smaller than block_size {block_size}")


def _default_intermediate(text) -> int:
    """The target's dense MLP width; 3*H for MoE targets without dense layers."""
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    dense_layers = (
        getattr(text, "mlp_only_layers", None) or (getattr(text, "decoder_sparse_step", 1) or 1) > 1
    )
    width = getattr(text, "intermediate_size", None)
    if width and (not experts or dense_layers):
        return width
    return 3 * text.hidden_size


def _drafter_rope(text) -> dict:
    rope = dict(getattr(text, "rope_parameters", None) or {})
    if not rope:
        rope = dict(getattr(text, "rope_scaling", None) or {})
        rope["rope_theta"] = getattr(text, "rope_theta", 10000.0)
    for key in _TARGET_ONLY_ROPE_KEYS:
        rope.pop(key, None)
    rope.setdefault("rope_type", rope.pop("type", "default"))
    return rope


def attend_blocks(
    attn: DFlashAttention,
    h,
    ctx,
    ctx_rope,
    blk_rope,
    *,
    anchors,
    anchor_valid,
    block_size,
    doc_ids,
    impl,
    masks=None,
    pad_to=None,
) -> Tensor:
    q = attn.queries(h, *blk_rope)
    k_blk, v_blk = attn.keys_values(h, *blk_rope)
    k_ctx, v_ctx = attn.keys_values(ctx, *ctx_rope)
    out = block_attention(
        q,
        k_ctx,
        v_ctx,
        k_blk,
        v_blk,
        anchors=anchors,
        anchor_valid=anchor_valid,
        block_size=block_size,
        doc_ids=doc_ids,
        sliding_window=attn.sliding_window,
        causal_in_block=attn.is_causal,
        scaling=attn.scaling,
        impl=impl,
        masks=masks,
        pad_to=pad_to,
    )
    return attn.out(out)


def checkpointing_on(setting: bool | None, device_type: str) -> bool:
    """drafter.activation_checkpointing: true or false as set; null (auto) is on for CUDA (what
    makes a 27B target and its drafter fit 80 GB cards, for one more drafter forward per step)
    and off elsewhere (CPU runs are tiny: recomputing would only cost time)."""
    return device_type == "cuda" if setting is None else setting


class DFlashDrafter(DFlashDraftModel):
    """The checkpoint's class (workload/drafter/dflash_module.py, inference) plus training."""

    def __init__(self, config: Qwen3Config) -> None:
        if dflash_setting(config, "target_layer_ids") is None:  # refuse a target too shallow
            default_target_layer_ids(config.num_target_layers, config.num_hidden_layers)
        super().__init__(config)
        # training only: recompute each layer in backward instead of keeping its activations
        # (torch.utils.checkpoint; the trainer sets it from drafter.activation_checkpointing)
        self.checkpoint_layers = False
        # training only: (context rows, block queries) flex attention pads every call to (the
        # run's longest rows and most anchors x block): one compiled shape per layer kind
        self.flex_pad_to: tuple[int, int] | None = None

    def save_pretrained(self, save_directory, *args, **kwargs) -> None:
        """As PreTrainedModel's, but config.json names z-lab's class, as published drafters do,
        the class's module is shipped beside it (AutoModel with trust_remote_code loads it),
        and the weights are one model.safetensors whatever transformers' default shard size."""
        kwargs.setdefault("max_shard_size", MAX_SHARD_SIZE)
        super().save_pretrained(save_directory, *args, **kwargs)
        if not (Path(save_directory) / WEIGHTS_NAME).is_file():
            raise ValueError(
                f"{save_directory}: the drafter was saved in shards, not one {WEIGHTS_NAME}"
            )
        self.config.architectures = [ARCHITECTURE]
        if kwargs.get("is_main_process", True):
            self.config.save_pretrained(save_directory)
            shutil.copyfile(dflash_module.__file__, Path(save_directory) / MODULE_NAME)

    def forward_blocks(
        self,
        block_embeds: Tensor,
        context: Tensor,
        anchors: Tensor,
        anchor_valid: Tensor,
        context_positions: Tensor,
        doc_ids: Tensor | None = None,
        attention: str = "auto",
    ) -> Tensor:
        """Training: all N blocks of each row against the row's context -> [B, N*K, H]."""
        batch, total, _ = block_embeds.shape
        num_blocks = anchors.shape[1]
        block_size = total // max(num_blocks, 1)
        if block_size * num_blocks != total:
            raise ValueError(
                f"block_embeds has {total} slots, not a multiple of {num_blocks} anchors"
            )
        safe = anchors.clamp(0, context.shape[1] - 1)
        slots = torch.arange(block_size, device=anchors.device)
        blk_pos = (context_positions.gather(1, safe)[:, :, None] + slots).reshape(batch, total)
        ctx_rope = self.rotary_emb(context, context_positions)
        blk_rope = self.rotary_emb(block_embeds, blk_pos)
        x = block_embeds
        masks: dict = {}  # block masks shared by the layers of this forward
        for layer in self.layers:
            x = self._train_layer(
                layer,
                x,
                lambda h, a=layer.self_attn: attend_blocks(
                    a,
                    h,
                    context,
                    ctx_rope,
                    blk_rope,
                    anchors=anchors,
                    anchor_valid=anchor_valid,
                    block_size=block_size,
                    doc_ids=doc_ids,
                    impl=attention,
                    masks=masks,
                    pad_to=self.flex_pad_to,
                ),
            )
        return self.norm(x)

    def _train_layer(self, layer: DFlashLayer, x: Tensor, attend: Callable[[Tensor], Tensor]):
        if not (self.checkpoint_layers and torch.is_grad_enabled()):
            return layer(x, attend)
        x = checkpoint(layer, x, attend, use_reentrant=False)
        # The layer kept nothing for backward, so only autocast's cache still holds the bf16
        # casts of its weights; left there, every layer's would stay until the step leaves
        # autocast. The recompute in backward casts them again, as here (one cast per weight).
        torch.clear_autocast_cache()
        return x
