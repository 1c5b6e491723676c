"""A run's config: run.yaml's text from a file or a template with --set overrides applied, and a
run's run.yaml read back (with --set applied) for its evaluation."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from dflashops import bundle
from dflashops.errors import NotFoundError, UsageError
from dflashops.remote import layout
from dflashops.runs.reading.view import RunView
from dflashops.yamlfile import YamlFileError, load_located, load_value

KEY_PART = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
# The header line that lists a launch's --set items: one JSON line (a newline or any other
# character of a value stays inside it), which the trainer's config loader reads to name the
# --set a key came from.
SETS_HEADER = "# --set: "


def sets_header(sets: list[str]) -> str:
    """The --set items as one inert comment line (JSON, ASCII: no YAML line break in it)."""
    return SETS_HEADER + json.dumps(sets)


def resolve_config(spec: str | None, sets: list[str], run: str) -> str:
    """run.yaml's text: a file or a template, with --set overrides applied on the YAML."""
    templates = sorted(p.stem for p in (bundle.templates_dir() / "runs").glob("*.yaml"))
    if not spec:
        raise UsageError(f"give --config FILE or a template name ({', '.join(templates)})")
    path = Path(spec).expanduser()
    if not path.is_file():
        name = spec.removesuffix(".yaml")
        candidate = bundle.templates_dir() / "runs" / f"{name}.yaml"
        if "/" in spec or not candidate.is_file():
            raise UsageError(
                f"--config {spec}: no such file, nor a template (templates: {', '.join(templates)})"
            )
        path = candidate
    try:
        data = load_located(path).data
    except (YamlFileError, OSError) as exc:
        raise UsageError(str(exc)) from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: a run config is a mapping of sections (target:, drafter:, ...)")
    source = json.dumps(str(path))  # a file name may hold a newline too
    header = f"# run.yaml of run {run}, written by `dflashops launch` from {source}"
    if not sets:
        return f"{header}\n{path.read_text()}"
    for item in sets:
        apply_set(data, item)
    body = yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    return f"{header}\n{sets_header(sets)}\n{body}"


def shipped_target_config(spec: str | None) -> Path | None:
    """The copy of the target model's config.json shipped beside a template
    (templates/targets/<template>-config.json), when --config names a template that has one."""
    if not spec or Path(spec).expanduser().is_file() or "/" in spec:
        return None
    copy = bundle.templates_dir() / "targets" / f"{spec.removesuffix('.yaml')}-config.json"
    return copy if copy.is_file() else None


def parse_config(view: RunView, sets: list[str]) -> dict[str, Any]:
    """The run's run.yaml (the one pull-ckpt puts beside the checkpoint), with --set applied."""
    text = (view.raw.get("files") or {}).get(layout.RUN_CONFIG)
    if text is None:
        raise NotFoundError(f"{view.name}: no run.yaml in {view.target}:{view.dir}")
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError:
        raise UsageError(f"{view.name}: its run.yaml is not valid YAML") from None
    if not isinstance(data, dict):
        raise UsageError(f"{view.name}: its run.yaml is not a run config")
    for item in sets:
        apply_set(data, item)
    return data


def one_line(item: str) -> str:
    """An item as it can be shown in a one-line message (JSON-quoted if it holds a newline)."""
    return item if item.isprintable() else json.dumps(item)


def apply_set(data: dict[str, Any], item: str) -> None:
    key, sep, raw = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(KEY_PART.match(p) for p in parts):
        raise UsageError(
            f"--set {one_line(item)}: expected KEY=VALUE with a dotted key, e.g. loss.gamma=7"
        )
    try:
        value = load_value(raw, f"--set {key.strip()}") if raw.strip() else None
    except YamlFileError as exc:
        raise UsageError(str(exc)) from None
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise UsageError(f"--set {one_line(item)}: {where} is a value, not a section")
        node = child
    node[parts[-1]] = value
