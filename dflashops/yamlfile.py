"""YAML loading that remembers the line of every key, for errors that say `file:line: key: ...`."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

_SCALARS = yaml.constructor.SafeConstructor()


class YamlFileError(Exception):
    """A located problem in a YAML file; `str()` is the one-line message."""


@dataclass
class LocatedYaml:
    """Plain Python data loaded from a file, with the line of each key path (`a.b.c`)."""

    path: Path
    data: Any
    lines: dict[str, int] = field(default_factory=dict)

    def line(self, key: str) -> int | None:
        while key:
            if key in self.lines:
                return self.lines[key]
            key = key.rpartition(".")[0]
        return None

    def where(self, key: str) -> str:
        line = self.line(key)
        return f"{self.path}:{line}" if line else str(self.path)

    def error(self, key: str, problem: str) -> YamlFileError:
        return YamlFileError(f"{self.where(key)}: {key}: {problem}")


def load_located(path: Path, text: str | None = None) -> LocatedYaml:
    """Parse `path` (or `text`, named as `path`); syntax errors name the line."""
    if text is None:
        text = path.read_text(encoding="utf-8")
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise YamlFileError(f"{path}{line}: YAML syntax error: {problem}") from None
    located = LocatedYaml(path=path, data=None)
    if node is not None:
        located.data = _construct(node, "", located.lines, path)
    return located


def _construct(node: yaml.Node, prefix: str, lines: dict[str, int], path: Path) -> Any:
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = str(_SCALARS.construct_object(key_node))
            dotted = f"{prefix}.{key}" if prefix else key
            if key in out:
                raise YamlFileError(
                    f"{path}:{key_node.start_mark.line + 1}: {dotted}: duplicate key"
                )
            lines[dotted] = key_node.start_mark.line + 1
            out[key] = _construct(value_node, dotted, lines, path)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [
            _construct(item, f"{prefix}[{i}]", lines, path) for i, item in enumerate(node.value)
        ]
    return _SCALARS.construct_object(node)


def did_you_mean(word: str, choices: list[str]) -> str:
    match = difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean '{match[0]}'?)" if match else ""
