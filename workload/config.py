"""The one typed run config: YAML + `--set section.key=value`, validation, and the recipe audit.

Every option of a training run is a field below. `load_config` reads a YAML file, applies
overrides, checks types and ranges, and raises `ConfigError` with one line that names the file,
the line (when known), the key and what to do. `audit` lists every setting that differs from the
recipe (docs: shared/reference/dflash-recipe.md) and the combinations that are bugs. This module
imports no torch, so it can be used anywhere.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from workload.common.provenance import same_target

LOSS_TYPES = ("ce", "kl", "blend")
WEIGHTINGS = ("decay", "dpace", "uniform")
TEACHERS = ("logits", "last_layer")
FC_LAYERS = ("all", "all_but_last")
ATTENTIONS = ("auto", "flex", "chunked", "dense")
PRECISIONS = ("auto", "bf16", "fp32")
FC_PRECISIONS = ("auto", "fp32", "tf32", "bf16")  # the drafter's fc (bench/gpu_fc_precision.py)
SHARDINGS = ("auto", "none", "zero1", "hybrid")
GRAD_COMM_DTYPES = ("auto", "fp32", "bf16")
DTYPES = ("auto", "bfloat16", "float16", "float32")
LAYER_TYPES = ("full_attention", "sliding_attention")
WANDB_MODES = ("online", "offline", "disabled")
# Target attentions that keep packed documents apart from position_ids alone (checked against
# per-document forwards in tests, sliding windows included). flash_attention_2/3 only detect
# packing for a batch of one row, and are not verified here.
PACKED_ATTENTION = ("sdpa", "eager", "flex_attention")


class ConfigError(ValueError):
    """A config the trainer refuses; the message is one line naming where and what to do."""


class UsageError(Exception):
    """Bad input found at start (config, run dir, data, target, checkpoint): one line, exit 2."""


@dataclass
class TargetConfig:
    path: str | None = None  # a Hugging Face model directory (required)
    dtype: str = "auto"
    attn_implementation: str = "sdpa"


@dataclass
class DrafterConfig:
    num_layers: int = 5
    block_size: int = 16
    target_layer_ids: list[int] | None = None  # z-lab convention; null = spread over 1..N-3
    mask_token_id: int | None = None  # null = the tokenizer's mask token, else an error
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    intermediate_size: int | None = None
    # null = the target's (the published drafters keep its heads, KV heads and head dim)
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    # a published drafter's directory (or its config.json) whose layout this run takes: the
    # keys of LAYOUT_KEYS; one also set here must agree
    layout_from: str | None = None
    init_from: str | None = None  # a drafter checkpoint directory to start from
    fc_layers: str = "all"  # all | all_but_last (old runs only)
    # recompute each drafter layer in backward (torch.utils.checkpoint): null = on for CUDA
    activation_checkpointing: bool | None = None


@dataclass
class DataConfig:
    # a chat JSONL file, a directory of *.jsonl shards, or a datagen dataset (required)
    path: str | None = None
    max_length: int = 4096
    pack: bool = False
    num_anchors: int = 512  # per document of a row
    max_anchors_per_row: int | None = None  # hard cap per row (packed rows of many documents)
    chat_template: str | None = None
    # given to the chat template when rendering, e.g. {enable_thinking: false}; part of the
    # token store's key, and compared with a datagen dataset's by the audit
    chat_template_kwargs: dict[str, Any] | None = None
    # conversations kept out of training for val_*: a fraction in (0, 1), a count, 0 for none;
    # null = min(64, a tenth of the data)
    holdout: int | float | None = None
    cache_dir: str | None = None  # where token stores go; null = beside the data if writable
    workers: int | None = None  # tokenizer processes per node; null = its CPUs (at most 16)
    seed: int = 0


@dataclass
class LossConfig:
    type: str = "ce"  # ce | kl | blend (kl and blend reproduce old runs)
    gamma: float = 7.0
    weighting: str = "decay"  # decay | dpace | uniform
    dpace_alpha: float = 0.5
    kl_temperature: float = 2.0
    kl_weight: float = 0.7  # blend = kl_weight * KL + (1 - kl_weight) * CE
    teacher: str = "logits"  # logits | last_layer (old runs: lm_head(norm(last configured layer)))
    # slots after the first data token that is not the target's greedy token are invalid: the
    # verifier never reaches that prefix (false trains on it, and streak no longer matches tau)
    on_trajectory: bool = True


@dataclass
class NoiseConfig:
    start: float = 0.05
    end: float = 0.05
    steps: int = 0  # linear from start to end over this many steps; 0 = constant start
    # always on the fc inputs only, added after the teacher: labels never see noise


@dataclass
class OptimConfig:
    lr: float = 6.0e-4
    min_lr: float = 0.0
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0
    batch_size: int = 1  # rows per rank per micro-step
    grad_accum: int = 1
    max_steps: int | None = 1000
    epochs: float | None = None  # when set too, training stops at whichever comes first
    precision: str = "auto"  # auto = bf16 autocast on GPU, fp32 on CPU
    fc_precision: str = "auto"  # the drafter's fc: auto = tf32 on GPU, fp32 on CPU


@dataclass
class WandbConfig:
    project: str | None = None
    entity: str | None = None
    name: str | None = None
    mode: str | None = None  # online | offline | disabled; null = wandb's own default


@dataclass
class LogConfig:
    log_every: int = 10
    val_every: int | None = 500  # val_* over data.holdout at steps that are multiples; null: never
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class CheckpointConfig:
    every: int = 500
    keep_last: int = 3
    keep_every: int | None = None


@dataclass
class DistConfig:
    """How ranks work together (torchrun sets the world; these set how it behaves)."""

    # auto | none | zero1 | hybrid (zero1 within each node, replicated across nodes); auto:
    # hybrid when the ranks span several nodes, zero1 with several ranks on one, else none
    sharding: str = "auto"
    # the dtype DDP all-reduces gradients in: auto | fp32 | bf16 (auto: bf16 on GPUs over
    # several nodes, where the link is slow; fp32 on one node and on CPU)
    grad_comm_dtype: str = "auto"
    timeout_s: float = 900.0  # process-group timeout: a dead or stuck peer ends the run after this


@dataclass
class RunConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    attention: str = "auto"
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def get(self, dotted: str) -> Any:
        obj: Any = self
        for part in dotted.split("."):
            obj = getattr(obj, part)
        return obj


# ---------------------------------------------------------------- reading YAML with line numbers


class _Source:
    """Where each dotted key came from: `file:line` for YAML keys, `--set k=v` for overrides."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.where: dict[str, str] = {}

    def of(self, dotted: str) -> str:
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            hit = self.where.get(".".join(parts[:n]))
            if hit:
                return hit
        return self.name


def _record_lines(node: yaml.Node, prefix: str, name: str, src: _Source) -> None:
    if not isinstance(node, yaml.MappingNode):
        return
    for key_node, value_node in node.value:
        key = f"{prefix}{key_node.value}"
        src.where[key] = f"{name}:{key_node.start_mark.line + 1}"
        _record_lines(value_node, f"{key}.", name, src)


def _read_yaml(path: Path, src: _Source) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config: {exc.strerror}") from exc
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path.name}:{mark.line + 1}" if mark else path.name
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}: not valid YAML: {problem}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path.name}: the config must be a mapping of sections, not a list")
    _record_lines(node, "", path.name, src)
    _record_sets(text, src)
    return data


def _record_sets(text: str, src: _Source) -> None:
    """A run.yaml written by `dflashops launch` lists its --set items in one JSON comment line
    (`# --set: [...]`): a key set there is named by its --set, not by a line the user never
    wrote."""
    for line in text.splitlines()[:4]:
        if line.startswith("# --set: "):
            try:
                items = json.loads(line[len("# --set: ") :])
            except ValueError:
                return
            for item in items if isinstance(items, list) else []:
                if isinstance(item, str) and "=" in item:
                    shown = item if item.isprintable() else json.dumps(item)
                    src.where[item.split("=", 1)[0].strip()] = f"--set {shown}"


def _apply_override(data: dict[str, Any], item: str, src: _Source) -> None:
    if "=" not in item:
        raise ConfigError(f"--set {item}: expected KEY=VALUE, e.g. --set loss.gamma=7")
    key, raw = item.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {item}: the value is not valid YAML") from exc
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        nxt = node.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            node[part] = nxt
        node = nxt
    node[parts[-1]] = value
    src.where[key] = f"--set {item}"


# ---------------------------------------------------------------- typed conversion


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}s"
    if origin is dict:
        return "a mapping"
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def _convert(value: Any, tp: Any, key: str, src: _Source) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for i, arg in enumerate(inner):  # the first that takes it (int | float: 64 stays 64)
            try:
                return _convert(value, arg, key, src)
            except ConfigError:
                if i == len(inner) - 1:
                    if len(inner) == 1:
                        raise
                    raise ConfigError(f"{src.of(key)}: {key}: expected {_type_name(tp)}, "
                                      f"got {value!r}") from None  # fmt: skip
    bad = ConfigError(f"{src.of(key)}: {key}: expected {_type_name(tp)}, got {value!r}")
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise bad
        return dict(value)
    if origin is list:
        if not isinstance(value, list):
            raise bad
        (item_tp,) = typing.get_args(tp)
        return [_convert(v, item_tp, key, src) for v in value]
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, f"{key}.", src)
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise bad from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad
        return value
    raise TypeError(f"unsupported config type {tp!r} for {key}")


def _build(cls: type, data: Any, prefix: str, src: _Source) -> Any:
    section = prefix.rstrip(".") or "the config"
    if not isinstance(data, dict):
        raise ConfigError(f"{src.of(section)}: {section}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in known:
            dotted = f"{prefix}{key}"
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = (
                f"did you mean {prefix}{close[0]}?" if close else f"known keys: {', '.join(known)}"
            )
            raise ConfigError(f"{src.of(dotted)}: {dotted}: unknown key; {hint}")
    kwargs = {k: _convert(v, hints[k], f"{prefix}{k}", src) for k, v in data.items()}
    return cls(**kwargs)


# ---------------------------------------------------------------- validation


def _check(cfg: RunConfig, src: _Source) -> None:
    def fail(key: str, message: str) -> None:
        raise ConfigError(f"{src.of(key)}: {key}: {message}")

    def one_of(key: str, allowed: tuple[str, ...]) -> None:
        value = cfg.get(key)
        if value not in allowed:
            fail(key, f"{value!r} is not one of {', '.join(allowed)}")

    def at_least(key: str, low: float, *, optional: bool = False) -> None:
        value = cfg.get(key)
        if value is None and optional:
            return
        if value is None or value < low:
            fail(key, f"must be >= {low}, got {value!r}")

    def within(key: str, low: float, high: float) -> None:
        value = cfg.get(key)
        if not low <= value <= high:
            fail(key, f"must be between {low} and {high}, got {value!r}")

    for key, allowed in [
        ("target.dtype", DTYPES),
        ("drafter.fc_layers", FC_LAYERS),
        ("loss.type", LOSS_TYPES),
        ("loss.weighting", WEIGHTINGS),
        ("loss.teacher", TEACHERS),
        ("optim.precision", PRECISIONS),
        ("optim.fc_precision", FC_PRECISIONS),
        ("attention", ATTENTIONS),
        ("dist.sharding", SHARDINGS),
        ("dist.grad_comm_dtype", GRAD_COMM_DTYPES),
    ]:
        one_of(key, allowed)
    if cfg.log.wandb.mode is not None:
        one_of("log.wandb.mode", WANDB_MODES)
    for key in ("target.path", "data.path"):
        if not cfg.get(key):
            fail(key, "required: set it to a path (python -m workload.tiny writes a complete one)")
    at_least("drafter.num_layers", 1)
    at_least("drafter.block_size", 2)
    at_least("drafter.mask_token_id", 0, optional=True)
    at_least("drafter.sliding_window", 1, optional=True)
    at_least("drafter.intermediate_size", 1, optional=True)
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim"):
        at_least(f"drafter.{key}", 1, optional=True)
    _check_layers(cfg, fail)
    at_least("data.num_anchors", 1)
    at_least("data.max_anchors_per_row", 1, optional=True)
    at_least("data.workers", 1, optional=True)
    holdout = cfg.data.holdout
    if holdout is not None and (holdout < 0 or (holdout >= 1 and holdout != int(holdout))):
        fail("data.holdout", f"a fraction in (0, 1) or a count of conversations (0: none), "
                             f"got {holdout!r}")  # fmt: skip
    if cfg.data.pack and cfg.target.attn_implementation not in PACKED_ATTENTION:
        fail(
            "data.pack",
            f"true needs target.attn_implementation {' or '.join(PACKED_ATTENTION)} (with "
            f"{cfg.target.attn_implementation!r} packed documents could see each other); "
            "set data.pack: false or change the attention",
        )
    if cfg.data.max_length < cfg.drafter.block_size + 1:
        fail("data.max_length", f"must be > drafter.block_size ({cfg.drafter.block_size})")
    if cfg.loss.gamma <= 0:
        fail("loss.gamma", f"must be > 0, got {cfg.loss.gamma}")
    within("loss.dpace_alpha", 0.0, 1.0)
    within("loss.kl_weight", 0.0, 1.0)
    if cfg.loss.kl_temperature <= 0:
        fail("loss.kl_temperature", f"must be > 0, got {cfg.loss.kl_temperature}")
    at_least("noise.start", 0.0)
    at_least("noise.end", 0.0)
    at_least("noise.steps", 0)
    if cfg.optim.lr <= 0:
        fail("optim.lr", f"must be > 0, got {cfg.optim.lr}")
    within("optim.min_lr", 0.0, cfg.optim.lr)
    if not 0.0 <= cfg.optim.warmup_ratio < 1.0:
        fail("optim.warmup_ratio", f"must be in [0, 1), got {cfg.optim.warmup_ratio}")
    at_least("optim.weight_decay", 0.0)
    betas = cfg.optim.betas
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        fail("optim.betas", f"expected two numbers in [0, 1), got {betas}")
    if cfg.optim.grad_clip <= 0:
        fail("optim.grad_clip", f"must be > 0, got {cfg.optim.grad_clip}")
    at_least("optim.batch_size", 1)
    at_least("optim.grad_accum", 1)
    at_least("optim.max_steps", 1, optional=True)
    if cfg.optim.epochs is not None and cfg.optim.epochs <= 0:
        fail("optim.epochs", f"must be > 0, got {cfg.optim.epochs}")
    if cfg.optim.max_steps is None and cfg.optim.epochs is None:
        fail("optim.max_steps", "set optim.max_steps or optim.epochs (both null never ends)")
    at_least("log.log_every", 1)
    at_least("log.val_every", 1, optional=True)
    at_least("checkpoint.every", 1)
    at_least("checkpoint.keep_last", 1)
    at_least("checkpoint.keep_every", 1, optional=True)
    if cfg.dist.timeout_s < 10:
        fail("dist.timeout_s", f"must be >= 10 seconds, got {cfg.dist.timeout_s}")
    _check_bug_combinations(cfg, fail)


def _check_layers(cfg: RunConfig, fail: typing.Callable[[str, str], None]) -> None:
    d = cfg.drafter
    ids = d.target_layer_ids
    if ids is not None:
        if not ids:
            fail("drafter.target_layer_ids", "must list at least one layer id (or be null)")
        if any(i < 0 for i in ids):
            fail("drafter.target_layer_ids", f"layer ids are >= 0 (z-lab convention), got {ids}")
        if len(set(ids)) != len(ids):
            fail("drafter.target_layer_ids", f"duplicate layer ids in {ids}")
        if d.fc_layers == "all_but_last" and len(ids) < 2:
            fail("drafter.fc_layers", "all_but_last needs at least two target_layer_ids")
    if d.layer_types is not None:
        if len(d.layer_types) != d.num_layers:
            fail(
                "drafter.layer_types",
                f"has {len(d.layer_types)} entries for {d.num_layers} drafter layers",
            )
        for t in d.layer_types:
            if t not in LAYER_TYPES:
                fail("drafter.layer_types", f"{t!r} is not one of {', '.join(LAYER_TYPES)}")
        if "sliding_attention" in d.layer_types and d.sliding_window is None:
            fail("drafter.sliding_window", "required when drafter.layer_types has sliding layers")


def _check_bug_combinations(cfg: RunConfig, fail: typing.Callable[[str, str], None]) -> None:
    """Combinations known to train a drafter into a plateau: refused, with the reason."""
    if cfg.loss.teacher == "last_layer" and cfg.drafter.fc_layers == "all":
        fail(
            "loss.teacher",
            "last_layer with drafter.fc_layers: all puts the teacher layer inside the drafter's "
            "input (it trains into a plateau); set drafter.fc_layers: all_but_last or loss.teacher: logits",
        )


# ---------------------------------------------------------------- public API


# Keys that no longer exist, with the one value the trainer ever implemented: that value is
# dropped (configs stored in older checkpoints still load), any other is refused.
_REMOVED = {
    "noise.scope": (
        "fc_inputs",
        "was removed: noise goes on the fc inputs only, after the teacher, so labels never see "
        "noise (all_layers, with loss.teacher: last_layer, was never implemented); "
        "delete the key",
    ),
}


def _drop_removed(data: dict[str, Any], src: _Source) -> None:
    for dotted, (kept, note) in _REMOVED.items():
        section, key = dotted.split(".")
        part = data.get(section)
        if isinstance(part, dict) and key in part:
            value = part.pop(key)
            if value != kept:
                raise ConfigError(f"{src.of(dotted)}: {dotted}: {value!r} {note}")


def load_config(path: str | Path | None, overrides: typing.Sequence[str] = ()) -> RunConfig:
    """Read `path` (YAML; None = defaults only), apply `--set` overrides, validate."""
    src = _Source(Path(path).name if path else "defaults")
    data = _read_yaml(Path(path), src) if path else {}
    for item in overrides:
        _apply_override(data, item, src)
    _drop_removed(data, src)
    cfg = _build(RunConfig, data, "", src)
    _apply_layout(cfg, src, Path(path).parent if path else Path.cwd())
    _check(cfg, src)
    return cfg


# drafter key -> where a published drafter's config.json holds it
LAYOUT_KEYS = {
    "num_layers": ("num_hidden_layers",),
    "block_size": ("dflash_config.block_size", "block_size"),
    "target_layer_ids": ("dflash_config.target_layer_ids",),
    "mask_token_id": ("dflash_config.mask_token_id",),
    "layer_types": ("layer_types",),
    "sliding_window": ("sliding_window",),
    "intermediate_size": ("intermediate_size",),
    "num_attention_heads": ("num_attention_heads",),
    "num_key_value_heads": ("num_key_value_heads",),
    "head_dim": ("head_dim",),
}


def published_layout(where: Path) -> dict[str, Any]:
    """The drafter keys a published drafter's config.json fixes (those it holds)."""
    path = where / "config.json" if where.is_dir() else where
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"drafter.layout_from: {path}: not a drafter's config.json ({exc})"
        ) from None
    out: dict[str, Any] = {}
    for key, paths in LAYOUT_KEYS.items():
        for dotted in paths:
            value: Any = doc
            for part in dotted.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            if value is not None:
                out[key] = value
                break
    if "sliding_attention" not in (out.get("layer_types") or []):
        out["sliding_window"] = None  # a window no layer uses (Qwen3 configs carry one)
    return out


def _apply_layout(cfg: RunConfig, src: _Source, base: Path) -> None:
    """drafter.layout_from: the published layout's keys into the config; a key the run also
    sets must agree (named with both values)."""
    given = cfg.drafter.layout_from
    if not given:
        return
    where = Path(given).expanduser()
    if not where.is_absolute() and (base / where).exists():
        where = base / where
    for key, value in published_layout(where).items():
        ours = getattr(cfg.drafter, key)
        if f"drafter.{key}" in src.where and ours is not None and ours != value:
            raise ConfigError(
                f"{src.of('drafter.' + key)}: drafter.{key}: {ours!r} here, {value!r} in the "
                f"published layout {where} (drafter.layout_from): drop one"
            )
        setattr(cfg.drafter, key, value)


def from_dict(data: dict[str, Any], name: str = "config") -> RunConfig:
    """Build and validate a config from a plain dict (e.g. one stored in a checkpoint)."""
    src = _Source(name)
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    _drop_removed(data, src)
    cfg = _build(RunConfig, data, "", src)
    _check(cfg, src)
    return cfg


def dump(cfg: RunConfig, path: str | Path | None = None) -> str:
    """The resolved config as YAML; written to `path` when given."""
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False)
    if path is not None:
        Path(path).write_text(text)
    return text


# Keys that change what is trained (not where it is logged or how often it is saved).
_TRAINING_SECTIONS = ("target", "drafter", "data", "loss", "noise", "optim", "attention", "seed")


def config_hash(cfg: RunConfig) -> str:
    d = cfg.to_dict()
    payload = {k: d[k] for k in _TRAINING_SECTIONS}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def diff(a: RunConfig, b: RunConfig) -> list[tuple[str, Any, Any]]:
    """Dotted keys whose values differ, as (key, a value, b value)."""
    out: list[tuple[str, Any, Any]] = []

    def walk(x: Any, y: Any, prefix: str) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            for k in x:
                walk(x[k], y.get(k), f"{prefix}{k}.")
        elif x != y:
            out.append((prefix.rstrip("."), x, y))

    walk(a.to_dict(), b.to_dict(), "")
    return out


# ---------------------------------------------------------------- the recipe audit


@dataclass(frozen=True)
class TargetFacts:
    """What the audit needs to know about the target (read by the trainer after loading it)."""

    num_layers: int
    embedding_rows: int
    pad_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class AuditItem:
    key: str
    value: Any
    recipe: Any
    note: str
    level: str = "info"  # info | warn | error

    def line(self) -> str:
        outside = self.recipe is None and all(self.key != k for k, _, _ in _RECIPE)
        recipe = "" if outside else f" (recipe: {self.recipe!r})"  # outside: no recipe value
        return f"[{self.level}] {self.key} = {self.value!r}{recipe}: {self.note}"


def recipe_layer_ids(num_target_layers: int, n: int | None = None) -> list[int]:
    """z-lab's default taps: n ids spread evenly over 1..N-3 (n == 1 -> [N // 2]); n defaults
    to 5, fewer for targets too shallow for 5 distinct ids."""
    if n is None:
        n = min(5, max(1, num_target_layers - 3))
    if n == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (n - 1)) for i in range(n)]


# (key, recipe value, note when different)
_RECIPE: list[tuple[str, Any, str]] = [
    ("drafter.block_size", 16, "published drafters use block 16"),
    ("drafter.num_layers", 5, "published Qwen3 drafters have 5 layers"),
    ("drafter.fc_layers", "all", "old-run ablation: the last configured layer is not an fc input"),
    (
        "loss.type",
        "ce",
        "soft targets (an older recipe); the recipe trains hard CE on greedy tokens",
    ),
    ("loss.teacher", "logits", "old-run teacher: lm_head(norm(last configured layer)), clean"),
    ("loss.gamma", 7.0, "decay exp(-(k-1)/gamma); an older recipe used 10"),
    (
        "loss.weighting",
        "decay",
        "streak-aware weights (an older recipe); the recipe decays by slot",
    ),
    (
        "loss.on_trajectory",
        True,
        "trains slots past the first data token off the target's greedy path, prefixes the "
        "verifier never reaches; streak then overstates tau",
    ),
    ("noise.start", 0.05, "uniform +-std on fc inputs"),
    ("noise.end", 0.05, "uniform +-std on fc inputs"),
    ("noise.steps", 0, "noise schedule length"),
    ("data.num_anchors", 512, "anchors per document per row"),
    ("data.max_anchors_per_row", None, "hard cap on anchors per row"),
    ("data.max_length", 4096, "training context of the published drafters"),
    ("optim.lr", 6.0e-4, "SpecForge DFlash default"),
    ("optim.warmup_ratio", 0.04, "SpecForge DFlash default"),
    ("optim.weight_decay", 0.0, "SpecForge DFlash default"),
    ("optim.grad_clip", 1.0, "grad-norm clip of every trainer"),
]


# (key, our recipe's value, the peers' defaults, why ours): where the recipe departs from the
# peers' trainers (SpecForge, vLLM speculators; dflash-recipe-sources.md), the audit says so
_PEERS: list[tuple[str, Any, str, str]] = [
    ("optim.betas", [0.9, 0.95], "SpecForge (0.9, 0.999) (AdamW's), speculators Muon + AdamW",
     "a second moment of ~20 steps follows the loss scale as anchors are drawn anew each step"),
    ("optim.lr", 6.0e-4, "speculators 1e-4 (AdamW; Muon 1e-3), linear",
     "SpecForge's DFlash default, with its cosine schedule"),
    ("optim.weight_decay", 0.0, "speculators 0.01 (AdamW), 0.1 (Muon)", "SpecForge's: none"),
    ("loss.gamma", 7.0, "speculators 4.0", "SpecForge's examples for block 16 (the paper's)"),
    ("noise.start", 0.05, "SpecForge none", "speculators' uniform noise on the fc inputs"),
    ("loss.on_trajectory", True, "SpecForge and speculators train every slot",
     "a slot past the first one off the target's greedy path is never verified when served"),
    ("loss.type", "ce", "SpecForge CE on the data's tokens, speculators CE + D-PACE",
     "CE on the target's own greedy tokens: what the verifier accepts"),
    ("data.max_length", 4096, "SpecForge 3072 (2048 in its schema), speculators 8192 packed",
     "the published drafters' training context"),
    ("optim.epochs", 1.0, "SpecForge's examples 6, speculators' 20 (examples 5)",
     "one pass over regenerated data; more where the plan's time allows"),
]  # fmt: skip


@dataclass(frozen=True)
class DataFacts:
    """What the audit needs to know about the data (read by the trainer from data.path)."""

    kind: str  # file | shards | datagen
    manifest: dict[str, Any] | None = None  # a datagen dataset's manifest.json
    target_digest: str | None = None  # provenance.target_digest(target.path)


def audit(
    cfg: RunConfig, facts: TargetFacts | None = None, data: DataFacts | None = None
) -> list[AuditItem]:
    """Every setting that differs from the recipe, plus the target-dependent errors and, with
    `data`, whether the data is this target's own greedy output."""
    items: list[AuditItem] = []
    for key, recipe, note in _RECIPE:
        value = cfg.get(key)
        if value != recipe:
            items.append(AuditItem(key, value, recipe, note))
    if cfg.loss.type == "ce":
        for key in ("loss.kl_temperature", "loss.kl_weight"):
            if cfg.get(key) != dataclasses.asdict(LossConfig())[key.split(".")[1]]:
                items.append(AuditItem(key, cfg.get(key), "unused", "only used by kl and blend"))
    if cfg.loss.weighting == "dpace" and cfg.loss.type != "ce":
        items.append(
            AuditItem(
                "loss.weighting",
                "dpace",
                "decay",
                f"D-PACE is defined for CE; here q_i = exp(-CE_i) weights the {cfg.loss.type} loss",
                "warn",
            )
        )
    if cfg.data.pack and cfg.data.max_anchors_per_row is None:
        note = (
            "packed rows of short documents can get up to max_length anchors (num_anchors is "
            "per document): drafter memory grows with them; set a cap such as num_anchors"
        )
        items.append(AuditItem("data.max_anchors_per_row", None, "a cap", note, "warn"))
    if cfg.optim.precision == "fp32":
        items.append(AuditItem("optim.precision", "fp32", "auto", "fp32 on GPU is slow", "warn"))
    if facts is not None:
        items.extend(_audit_target(cfg, facts))
    if data is not None:
        items.extend(_audit_data(cfg, data))
    said = {i.key for i in items}
    items.extend(p for p in peer_departures(cfg) if p.key not in said)
    return items


def peer_departures(cfg: RunConfig) -> list[AuditItem]:
    """The recipe's settings this run keeps where the peers' trainers default otherwise."""
    return [AuditItem(key, ours, ours, f"departs from peers ({peers}): {why}", "peer")
            for key, ours, peers, why in _PEERS if cfg.get(key) == ours]  # fmt: skip


_OFF_PATH = (
    "on_trajectory drops every slot past a block's first data token off this target's greedy "
    "path (at 80% agreement about half the weighted loss); `kept` in the log shows the share "
    "left"
)


def _audit_data(cfg: RunConfig, data: DataFacts) -> list[AuditItem]:
    items: list[AuditItem] = []
    on = cfg.loss.on_trajectory
    m = data.manifest
    if m is None:
        if on:
            note = (f"data.path ({data.kind}) has no datagen manifest: nothing says its replies "
                    f"are this target's; where they are not, {_OFF_PATH}")  # fmt: skip
            items.append(AuditItem("loss.on_trajectory", True, True, note))
        return items
    recorded = m.get("target") if isinstance(m.get("target"), dict) else {}
    same = same_target(recorded, cfg.target.path, data.target_digest)
    temperature = (m.get("sampling") or {}).get("temperature")
    reasons = []
    if same is False:
        reasons.append(
            f"made by target {recorded.get('path')} (digest {str(recorded.get('digest'))[:12]}), "
            f"not this one ({cfg.target.path}, digest {str(data.target_digest)[:12]})"
        )
    elif same is None:
        reasons.append("its manifest does not name the target that made it")
    if temperature != 0:
        reasons.append(f"its manifest records temperature {temperature!r}, not 0 (greedy)")
    if reasons:
        note = "; ".join(reasons) + ": the drafter learns replies this target would not give"
        items.append(AuditItem("data.path", cfg.data.path, "this target at temperature 0",
                               note, "warn"))  # fmt: skip
        if on:
            items.append(AuditItem("loss.on_trajectory", True, True,
                                   f"on, with data not made by this target: {_OFF_PATH}",
                                   "warn"))  # fmt: skip
    items.extend(_audit_cut(m))
    made_with = m.get("chat_template_kwargs") or {}
    trained_with = cfg.data.chat_template_kwargs or {}
    if made_with != trained_with:
        note = (f"the dataset was generated with chat template kwargs {made_with!r} and "
                f"training renders with {trained_with!r}: the drafter trains on prompts laid "
                "out otherwise than the replies were made (and served)")  # fmt: skip
        items.append(AuditItem("data.chat_template_kwargs", trained_with, made_with, note,
                               "warn"))  # fmt: skip
    return items


CUT_WARN_SHARE = 0.05  # replies cut at the length limit above which the audit warns


def _audit_cut(m: dict[str, Any]) -> list[AuditItem]:
    """A warning when many replies ended at datagen's max_new_tokens: each is trained up to
    the cut (no end token), and what the target writes after the cut is never learned."""
    cut, replies = m.get("cut"), m.get("replies")
    if not isinstance(cut, int) or not isinstance(replies, int) or not replies:
        return []
    if cut / replies <= CUT_WARN_SHARE:
        return []
    limit = (m.get("sampling") or {}).get("max_new_tokens")
    note = (f"{cut} of {replies} replies ({cut / replies:.0%}) were cut at max_new_tokens "
            f"{limit}: they train with no end token and their endings are never learned; "
            "generate again with a larger --max-new-tokens")  # fmt: skip
    return [AuditItem("dataset.cut", f"{cut / replies:.0%} cut", f"<= {CUT_WARN_SHARE:.0%} cut",
                      note, "warn")]  # fmt: skip


def _audit_target(cfg: RunConfig, facts: TargetFacts) -> list[AuditItem]:
    items: list[AuditItem] = []
    d = cfg.drafter
    n = facts.num_layers
    default_ids = recipe_layer_ids(n)
    ids = d.target_layer_ids
    if ids is None:
        items.append(AuditItem("drafter.target_layer_ids", None, default_ids, "null -> default"))
        ids = default_ids
    elif ids != default_ids:
        items.append(AuditItem("drafter.target_layer_ids", ids, default_ids, "configured taps"))
    if any(i >= n for i in ids):
        items.append(
            AuditItem(
                "drafter.target_layer_ids",
                ids,
                default_ids,
                f"the target has {n} decoder layers (ids 0..{n - 1}); fix the list",
                "error",
            )
        )
    fc_ids = ids[:-1] if d.fc_layers == "all_but_last" else ids
    if n - 1 in fc_ids:
        note = (
            f"id {n - 1} is the target's last layer, which Hugging Face gives after the final "
            f"norm (hidden_states[-1]); an engine that serves with layer {n - 1}'s raw output "
            "feeds the drafter other features than it trained on"
        )
        items.append(AuditItem("drafter.target_layer_ids", ids, default_ids, note, "warn"))
    if cfg.loss.teacher == "last_layer" and ids[-1] != n - 1:
        items.append(
            AuditItem(
                "loss.teacher",
                "last_layer",
                "logits",
                f"teacher = lm_head(norm(layer {ids[-1]})) of a {n}-layer target: labels are not "
                "the target's greedy tokens",
                "warn",
            )
        )
    items.extend(_audit_mask(d.mask_token_id, facts))
    return items


def _audit_mask(mask: int | None, facts: TargetFacts) -> list[AuditItem]:
    rows = facts.embedding_rows
    key = "drafter.mask_token_id"
    if mask is None:
        note = "no mask token: set drafter.mask_token_id to a real embedding row of the target"
        return [AuditItem(key, None, "a real row", note, "error")]
    if not 0 <= mask < rows:
        note = f"not a row of the target embedding (0..{rows - 1}); pick a real, unused token id"
        return [AuditItem(key, mask, "a real row", note, "error")]
    special = {"pad": [facts.pad_token_id], "eos": list(facts.eos_token_ids)}
    for name, ids in special.items():
        if mask in ids:
            note = (
                f"equals the {name} token: the drafter cannot tell a mask slot from a real "
                f"{name} and acceptance degrades quietly; pick a dedicated mask token"
            )
            return [AuditItem(key, mask, "a dedicated token", note, "error")]
    return []


def audit_errors(items: typing.Iterable[AuditItem]) -> list[AuditItem]:
    return [i for i in items if i.level == "error"]


def audit_json(items: typing.Iterable[AuditItem]) -> list[dict[str, Any]]:
    return [
        {"key": i.key, "value": i.value, "recipe": i.recipe, "note": i.note, "level": i.level}
        for i in items
    ]
