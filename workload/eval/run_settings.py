"""What a run config (run.yaml) tells the programs that read a trained drafter: the target, the
data, the chat template and its kwargs, the drafter's shape as the run set it. No torch: the
planner reaches it through parity before any model loads."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from workload.config import ConfigError, load_config
from workload.eval.errors import EvalError


@dataclass
class RunSettings:
    target_path: Path
    dtype: str
    attn_implementation: str
    chat_template: str | None
    data_path: Path | None
    chat_template_kwargs: dict = field(default_factory=dict)
    # the drafter as the run set it: block_size, mask_token_id, target_layer_ids (None: a
    # default, no claim about a checkpoint)
    drafter: dict[str, Any] = field(default_factory=dict)


def resolve_path(path: str | None, base: Path) -> Path | None:
    if path is None:
        return None
    p = Path(path).expanduser()
    if not p.is_absolute() and (base / p).exists():
        return base / p
    return p


def load_run_settings(config_path: Path, overrides: Sequence[str] = ()) -> RunSettings:
    """What a run config says an evaluation (and parity) reads: target, data, chat settings."""
    if not config_path.is_file():
        raise EvalError(f"{config_path}: no such config file")
    try:
        cfg = load_config(config_path, overrides)
    except ConfigError as exc:
        raise EvalError(str(exc)) from None
    base = config_path.resolve().parent
    given = drafter_keys_given(config_path, overrides)
    template = cfg.data.chat_template
    if template is not None and "{" not in template:
        template = str(resolve_path(template, base))
    return RunSettings(
        target_path=resolve_path(cfg.target.path, base),
        dtype=cfg.target.dtype,
        attn_implementation=cfg.target.attn_implementation,
        chat_template=template,
        data_path=resolve_path(cfg.data.path, base),
        chat_template_kwargs=config_kwargs(cfg, config_path),
        drafter={key: getattr(cfg.drafter, key) if key in given else None
                 for key in ("block_size", "mask_token_id", "target_layer_ids")},
    )  # fmt: skip


def config_kwargs(cfg: Any, config_path: Path) -> dict:
    """data.chat_template_kwargs of the run config (read from the YAML where the config object
    has no such field), {} when unset."""
    if hasattr(cfg.data, "chat_template_kwargs"):
        kwargs = cfg.data.chat_template_kwargs
    else:
        try:
            raw = yaml.safe_load(config_path.read_text()) or {}
        except (OSError, yaml.YAMLError):
            raw = {}
        data = raw.get("data") if isinstance(raw, dict) else None
        kwargs = data.get("chat_template_kwargs") if isinstance(data, dict) else None
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise EvalError(f"{config_path}: data.chat_template_kwargs: expected a mapping")
    return dict(kwargs)


def chat_template_kwargs(text: str | None, settings: RunSettings) -> dict:
    """--chat-template-kwargs JSON, else the run's data.chat_template_kwargs, else {}."""
    if text is None:
        return settings.chat_template_kwargs
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EvalError(f"--chat-template-kwargs {text}: not valid JSON ({exc.msg})") from None
    if not isinstance(kwargs, dict):
        raise EvalError(
            f"--chat-template-kwargs {text}: expected a JSON object, e.g. "
            "'{\"enable_thinking\": false}'"
        )
    return kwargs


def drafter_keys_given(config: Path, overrides: Sequence[str]) -> set[str]:
    """The drafter keys the run config (or a --set) gives: launch's run.yaml gives them all."""
    try:
        raw = yaml.safe_load(config.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        raw = {}
    section = raw.get("drafter") if isinstance(raw, dict) else None
    given = set(section) if isinstance(section, dict) else set()
    sets = (item.split("=", 1)[0].strip() for item in overrides)
    return given | {key.removeprefix("drafter.") for key in sets if key.startswith("drafter.")}
