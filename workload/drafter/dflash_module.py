"""The DFlash drafter for inference, as every checkpoint ships it (copied there as `dflash.py`).

A checkpoint's config.json names `{"AutoModel": "dflash.DFlashDraftModel"}`, as z-lab's published
drafters do, so `AutoModel.from_pretrained(checkpoint, trust_remote_code=True)` loads this class.
The file is self-contained (torch and transformers only): it is copied into checkpoints as it is.
`workload.drafter.model.DFlashDrafter` adds training to this class; inference is this code either way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)


def dflash_setting(config, name: str, default=None):
    """A setting from dflash_config, else the top-level attribute (z-lab's lookup order)."""
    return (getattr(config, "dflash_config", None) or {}).get(name, getattr(config, name, default))


def spread_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """z-lab's default taps: n ids spread evenly over 1..N-3 (n == 1 -> [N // 2])."""
    if n == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (n - 1)) for i in range(n)]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, heads, T, D]; cos/sin [B, T, D]."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys/values are [context | block], both through k_proj/v_proj."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        bias = config.attention_bias
        hidden, q_dim, kv_dim = (
            config.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        self.q_proj = nn.Linear(hidden, q_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=bias)
        self.o_proj = nn.Linear(q_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        layer_type = (getattr(config, "layer_types", None) or ["full_attention"] * (layer_idx + 1))[
            layer_idx
        ]
        sliding = layer_type == "sliding_attention"
        forced = getattr(config, "is_causal", None)
        self.is_causal = sliding if forced is None else bool(forced)
        self.sliding_window = config.sliding_window if sliding else None

    def _split(self, x: Tensor, heads: int) -> Tensor:
        return x.view(*x.shape[:2], heads, self.head_dim).transpose(1, 2)

    def queries(self, h: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return apply_rope(self.q_norm(self._split(self.q_proj(h), self.num_heads)), cos, sin)

    def keys_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        k = self.k_norm(self._split(self.k_proj(x), self.num_kv_heads))
        return apply_rope(k, cos, sin), self._split(self.v_proj(x), self.num_kv_heads)

    def out(self, attn: Tensor) -> Tensor:
        return self.o_proj(attn.transpose(1, 2).flatten(2))

    def infer(self, h, ctx, cos, sin, attention_mask=None, cache=None) -> Tensor:
        """h [B,q,H] block stream; ctx [B,c,H]; cos/sin [B, c+q, D] for [context | block]."""
        q_len = h.shape[1]
        q = self.queries(h, cos[:, -q_len:], sin[:, -q_len:])
        k, v = self.keys_values(torch.cat([ctx, h], dim=1), cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        if attention_mask is None:
            attention_mask = self._inference_mask(q_len, k.shape[2], h.device)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attention_mask,
            scale=self.scaling,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return self.out(out)

    def _inference_mask(self, q_len: int, kv_len: int, device) -> Tensor | None:
        """Queries are the last q_len of the kv_len keys (the cache holds everything before)."""
        if not self.is_causal and self.sliding_window is None:
            return None
        qi = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
        ki = torch.arange(kv_len, device=device)[None, :]
        visible = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
        if self.is_causal:
            visible &= ki <= qi
        if self.sliding_window is not None:
            visible &= (qi - ki).abs() < self.sliding_window
        return visible


class DFlashLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x: Tensor, attend: Callable[[Tensor], Tensor]) -> Tensor:
        x = x + attend(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(PreTrainedModel):
    """Parameter names and config match z-lab's `DFlashDraftModel`. No embedding, no LM head:
    callers use the frozen target's."""

    config_class = Qwen3Config
    config: Qwen3Config
    base_model_prefix = ""
    _no_split_modules = ["DFlashLayer"]
    # Attention is SDPA here (and the trainer's own in training) whatever the config asks for,
    # so a config that says "sdpa" (as z-lab's class leaves it) must not be refused.
    _supports_sdpa = True

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        ids = dflash_setting(config, "target_layer_ids")
        if ids is None:
            ids = spread_layer_ids(config.num_target_layers, config.num_hidden_layers)
        self.target_layer_ids: list[int] = list(ids)
        self.mask_token_id: int = dflash_setting(config, "mask_token_id")
        self.block_size: int = int(dflash_setting(config, "block_size", 16))
        hidden = config.hidden_size
        self.layers = nn.ModuleList(DFlashLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_init()

    def project_context(self, features: Tensor) -> Tensor:
        """[B, S, L*H] target features -> [B, S, H] context. fp32 features meet fp32 fc weights
        in fp32 even under autocast: training adds its noise in fp32, and a bf16 cast would
        round most of it away on large features."""
        device = features.device.type
        fp32 = features.dtype == self.fc.weight.dtype == torch.float32
        if fp32 and not getattr(self, "fc_autocast", False) and torch.is_autocast_enabled(device):
            with torch.autocast(device, enabled=False):
                return self.hidden_norm(self.fc(features))
        return self.hidden_norm(self.fc(features))

    def forward(
        self,
        position_ids: Tensor,
        noise_embedding: Tensor,
        target_hidden: Tensor,
        attention_mask: Tensor | None = None,
        past_key_values=None,
        use_cache: bool = False,
        **kwargs,
    ) -> Tensor:
        """Inference, as z-lab's: position_ids [B, c+q] cover [new context | block]; the cache
        (if any) holds the K/V of earlier context and grows by c+q (callers crop it)."""
        ctx = self.project_context(target_hidden)
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        x = noise_embedding
        for layer in self.layers:
            attn = layer.self_attn
            x = layer(
                x, lambda h, a=attn: a.infer(h, ctx, cos, sin, attention_mask, past_key_values)
            )
        return self.norm(x)
