"""Load a frozen Hugging Face target (dense or hybrid) for drafter training and evaluation.

Hybrid Gated DeltaNet models (Qwen3.5/3.6 text, Qwen3-Next, ...) pick fla's triton kernels at
import time whenever fla imports, without looking at the device. Those kernels crash on CPU, so
`load_target` installs a per-call dispatcher: CPU tensors go to transformers' torch reference,
CUDA tensors keep the fla kernels.

A drafter reads the target's embedding and drafts through the target's head, with the settings a
DFlash config may add (`input_embedding_scale`, `output_multiplier`, `final_logit_softcapping`).
Training and evaluation both go through `block_embeddings` and `draft_logits` below.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Module-level functions that transformers wraps with `use_kernel_func_from_hub_with_fallback`.
_KERNEL_FUNCS = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)
_PACKED_KWARGS = ("cu_seqlens", "seq_idx")


def text_config(config: Any) -> Any:
    """The text/decoder part of a config (itself for plain causal LMs)."""
    sub = getattr(config, "text_config", None)
    if sub is not None:
        return sub
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config


def embedding_rows(model: torch.nn.Module) -> int:
    """Number of rows of the target's input embedding (may exceed len(tokenizer))."""
    return int(model.get_input_embeddings().weight.shape[0])


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def _device_dispatch(name: str, kernel: Callable, reference: Callable) -> Callable:
    @functools.wraps(reference)
    def dispatch(*args, **kwargs):
        first = _first_tensor(args, kwargs)
        if first is not None and first.device.type == "cuda":
            return kernel(*args, **kwargs)
        if any(kwargs.get(k) is not None for k in _PACKED_KWARGS):
            raise ValueError(
                f"{name}: the torch reference (used off-GPU) can't keep packed sequences apart; "
                "use padded rows (data.pack: false) for hybrid targets on CPU"
            )
        return reference(*args, **kwargs)

    dispatch._dflash_dispatch = True  # type: ignore[attr-defined]
    return dispatch


def force_torch_fallback_off_gpu(model: torch.nn.Module) -> list[str]:
    """Patch the modeling modules of `model` so linear-attention kernels run in torch off-GPU.

    Returns the patched `module.function` names. Idempotent.
    """
    patched = []
    module_names = {type(m).__module__ for m in model.modules()}
    for module_name in sorted(module_names):
        module = sys.modules.get(module_name)
        if module is None:
            continue
        for fn_name in _KERNEL_FUNCS:
            fn = getattr(module, fn_name, None)
            reference = getattr(fn, "__wrapped__", None)
            if fn is None or reference is None or getattr(fn, "_dflash_dispatch", False):
                continue
            setattr(module, fn_name, _device_dispatch(fn_name, fn, reference))
            patched.append(f"{module_name}.{fn_name}")
    return patched


def _resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype | str:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        # bf16 on GPU (what the checkpoints ship in); fp32 on CPU, where bf16 matmuls are slow.
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    try:
        return getattr(torch, dtype)
    except AttributeError:
        raise ValueError(
            f"target.dtype: unknown dtype {dtype!r} (use auto, bfloat16, float32)"
        ) from None


def load_target(
    path: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
) -> tuple[torch.nn.Module, Any]:
    """Load `path` with AutoModelForCausalLM + AutoTokenizer, offline, frozen, in eval mode,
    each weight read straight onto `device` (a rank never holds the whole target in host RAM:
    eight ranks of a 27B target would need 8 x 54 GB)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"target.path: {path} has no config.json (not a model directory)")
    device = torch.device(device)
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=_resolve_dtype(dtype, device.type),
        attn_implementation=attn_implementation,
        local_files_only=True,
        device_map={"": device},  # each tensor straight to the device: no whole copy in host RAM
    )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    force_torch_fallback_off_gpu(model)
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


# ----------------------------------------------------------------------------- the draft's use


@dataclass(frozen=True)
class DraftConventions:
    """How a drafter uses the target's embedding and head (read from the drafter's config)."""

    embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    logit_softcap: float | None = None

    @classmethod
    def of(cls, config: Any) -> DraftConventions:
        from workload.drafter.model import dflash_setting

        cap = dflash_setting(config, "final_logit_softcapping")
        return cls(
            float(dflash_setting(config, "input_embedding_scale", 1.0) or 1.0),
            float(dflash_setting(config, "output_multiplier", 1.0) or 1.0),
            float(cap) if cap is not None and float(cap) > 0 else None,
        )


def output_head(target: torch.nn.Module) -> torch.nn.Module:
    """The target's LM head (the module its logits come from)."""
    head = getattr(target, "lm_head", None)
    return head if head is not None else target.get_output_embeddings()


def block_embeddings(
    target: torch.nn.Module, ids: torch.Tensor, conventions: DraftConventions
) -> torch.Tensor:
    """The drafter's inputs for token ids: the target's embedding module, times the scale."""
    embeds = target.get_input_embeddings()(ids)
    if conventions.embedding_scale != 1.0:
        embeds = embeds * conventions.embedding_scale
    return embeds


def draft_logits(
    hidden: torch.Tensor, head: torch.nn.Module, conventions: DraftConventions
) -> torch.Tensor:
    """The drafter's logits: the target's head, times the output multiplier, then softcapped."""
    logits = head(hidden)
    if conventions.output_multiplier != 1.0:
        logits = logits * conventions.output_multiplier
    if conventions.logit_softcap is not None:
        logits = torch.tanh(logits / conventions.logit_softcap) * conventions.logit_softcap
    return logits


class DraftHead(torch.nn.Module):
    """`draft_logits` as a module: what the training loss calls as its LM head."""

    def __init__(self, head: torch.nn.Module, conventions: DraftConventions) -> None:
        super().__init__()
        self.head = head
        self.conventions = conventions

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return draft_logits(hidden, self.head, self.conventions)
