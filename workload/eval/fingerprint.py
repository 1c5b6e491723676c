"""The settings that decide an eval's τ, recorded on every result so unlike results are told apart.

`fingerprint` (CONTRACTS §6): prompts_sha256 (prompts.prompts_sha256), chat_template_sha256 (the
template in effect: the run's data.chat_template, else the tokenizer's), chat_template_kwargs,
temperature, max_new_tokens, block_size, target ({path, digest}), engine ({name, version}) and
dtype (the precision the engine ran in). Two evaluations with the same settings have equal
fingerprints. The drafter's own digest (`checkpoint_sha256`, of its MANIFEST.sha256) is kept
beside the fingerprint, not in it: the steps of one run differ there by design.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from workload.common.layout import MANIFEST

WEIGHTS_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def template_sha256(template: str | None, tokenizer: Any) -> str | None:
    """sha256 of the chat template in effect (None when there is none)."""
    chosen = template if template is not None else getattr(tokenizer, "chat_template", None)
    if chosen is None:
        return None
    if not isinstance(chosen, str):  # a tokenizer's named templates
        chosen = json.dumps(chosen, sort_keys=True)
    return sha256_text(chosen)


def target_identity(path: Path) -> dict:
    """{path, digest}: sha256 of config.json and the weights index (or, for a model without an
    index, the names and sizes of its weight files): cheap, and it changes with the weights'
    layout or a new export."""
    h = hashlib.sha256()
    config = path / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    index = next((path / n for n in WEIGHTS_INDEXES if (path / n).is_file()), None)
    if index is not None:
        h.update(index.read_bytes())
    else:
        for weights in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
            h.update(f"{weights.name} {weights.stat().st_size}\n".encode())
    return {"path": str(path.resolve()), "digest": h.hexdigest()}


def checkpoint_sha256(directory: Path) -> str | None:
    """sha256 of the checkpoint's MANIFEST.sha256 (it lists every file's sha256), None without."""
    manifest = directory / MANIFEST
    return hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.is_file() else None


def fingerprint(
    *,
    prompts_sha256: str,
    chat_template_sha256: str | None,
    chat_template_kwargs: dict,
    max_new_tokens: int,
    block_size: int,
    target: dict,
    engine: dict,
    dtype: str,
    temperature: float = 0.0,
) -> dict:
    return {
        "prompts_sha256": prompts_sha256,
        "chat_template_sha256": chat_template_sha256,
        "chat_template_kwargs": chat_template_kwargs,
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "block_size": block_size,
        "target": target,
        "engine": engine,
        "dtype": dtype,
    }
