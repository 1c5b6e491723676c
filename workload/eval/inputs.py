"""What an evaluation reads, each refused in one line (EvalError): the prompts rendered with the
chat template, the stop tokens, the checkpoint (manifest) and its drafter, the target, and the
train-to-serve parity of them all."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, GenerationConfig

from workload.common.layout import MANIFEST
from workload.data.chat import DataError, resolve_chat_template
from workload.drafter.checkpoint import read_manifest, verify
from workload.drafter.model import DFlashDrafter
from workload.drafter.targets import load_target
from workload.eval.errors import EvalError
from workload.eval.parity import ParityError, before_eval, json_object
from workload.eval.prompts import PromptsError, PromptSet, read_prompt_set, render
from workload.eval.run_settings import RunSettings
from workload.eval.vllm_process import vllm_python


def read_prompts(path: Path) -> list[dict]:
    """The prompts of `path` (workload/eval/prompts.py: ours or a benchmark's, JSONL or parquet)."""
    return read_prompt_set(path).items


def prompt_set_of(path: Path) -> PromptSet:
    try:
        return read_prompt_set(path)
    except PromptsError as exc:
        raise EvalError(str(exc)) from None


def render_prompt(
    tokenizer: Any, item: dict, chat_template: str | None, kwargs: dict | None = None
) -> list[int]:
    ids = render(tokenizer, item, chat_template, kwargs or {})
    if not ids:
        raise EvalError(f"{item['where']}: the prompt renders to no tokens")
    return ids


def stop_token_ids(target: torch.nn.Module, tokenizer: Any) -> list[int]:
    """The generation config's eos ids, else the tokenizer's eos (z-lab's benchmark rule)."""
    return stop_ids_of(getattr(target, "generation_config", None), tokenizer)


def stop_ids_of(generation_config: Any, tokenizer: Any) -> list[int]:
    ids = getattr(generation_config, "eos_token_id", None) or tokenizer.eos_token_id
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


def generation_config(path: Path) -> Any:
    """The target's generation config as transformers gives a loaded model one: its
    generation_config.json, else one made from its config.json."""
    try:
        return GenerationConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        pass
    try:
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(path))
    except (OSError, ValueError):
        return None


def check_manifest(directory: Path, *, required: bool) -> None:
    """Refuse a checkpoint whose MANIFEST.sha256 is missing (if required) or does not match."""
    if not directory.is_dir():
        raise EvalError(f"{directory}: no such checkpoint directory")
    manifest = directory / MANIFEST
    if not manifest.exists():
        if required:
            raise EvalError(
                f"{manifest}: missing, the checkpoint is incomplete "
                "(pass --allow-incomplete to evaluate it anyway)"
            )
        return
    if read_manifest(directory) is None:
        raise EvalError(f"{manifest}: malformed (expected sha256sum lines)")
    if not verify(directory, hashes=True):
        raise EvalError(f"{manifest}: does not match the files beside it (partial or changed copy)")


def drafter_block_size(directory: Path) -> int:
    """dflash_config.block_size of a drafter directory (read before any model loads)."""
    where = directory / "config.json"
    try:
        config = json.loads(where.read_text())
        return int((config.get("dflash_config") or {}).get("block_size") or config["block_size"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise EvalError(f"{where}: no dflash_config.block_size (not a drafter directory)") from None


def load_drafter(directory: Path, *, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """Our DFlashDrafter (parameter-compatible with z-lab's published drafters)."""
    if not (directory / "config.json").is_file():
        raise EvalError(f"{directory / 'config.json'}: missing (not a drafter directory)")
    try:
        model = DFlashDrafter.from_pretrained(directory, dtype=dtype, local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EvalError(f"{directory}: cannot load the drafter: {first}") from None
    if model.mask_token_id is None:
        raise EvalError(f"{directory / 'config.json'}: dflash_config has no mask_token_id")
    return model.to(device).eval().requires_grad_(False)


def load_target_of(settings: RunSettings, device: torch.device):

    try:
        return load_target(
            settings.target_path,
            dtype=settings.dtype,
            device=device,
            attn_implementation=settings.attn_implementation,
        )
    except (OSError, ValueError) as exc:
        raise EvalError(f"target.path {settings.target_path}: {str(exc).splitlines()[0]}") from None


def chat_template(template: str | None) -> str | None:

    try:
        return resolve_chat_template(template)
    except DataError as exc:
        raise EvalError(str(exc)) from None


def served_chat(args: argparse.Namespace) -> dict:
    """The kwargs a serving benchmark's server renders with (args.serving's, JSON), {} where
    not said: the engine's default; its template file checked."""
    template, text = args.serving["chat_template"], args.serving["chat_template_kwargs"]
    if template is not None and not Path(template).is_file():
        raise EvalError(f"--serve-chat-template {template}: no such file")
    try:
        return json_object("--serve-chat-template-kwargs", text) or {}
    except ParityError as exc:
        raise EvalError(str(exc)) from None


def parity_check(args: argparse.Namespace) -> dict:
    """Train-to-serve parity before anything loads (workload/eval/parity.py): each mismatch is
    a refusal line, unless --force (then recorded in the result). A serving benchmark's
    `args.serving` (its server's chat settings) is compared instead of the kwargs."""
    vllm = None
    if args.engine == "vllm":
        vllm = vllm_python(args.vllm_python)
    try:
        lines = before_eval(args.config, args.checkpoint, args.chat_template_kwargs,
                            args.overrides, vllm, getattr(args, "serving", None))  # fmt: skip
    except ParityError as exc:
        raise EvalError(f"parity: {exc}") from None
    if lines and not args.force:
        raise EvalError(
            "\neval: error: ".join(f"parity: {line}" for line in lines)
            + "\neval: error: (--force evaluates anyway, the mismatches recorded in the result)"
        )
    return {"mismatches": lines, "forced": bool(lines)}
