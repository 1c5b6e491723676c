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


_MAP, _SEQ = "tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"
MAX_VALUES = 100_000  # values built from one file: past this, aliases are multiplying it
MAX_DEPTH = 100  # levels of nesting in one file; far past any config of ours


def load_located(path: Path, text: str | None = None) -> LocatedYaml:
    """Parse `path` (or `text`, named as `path`). Every problem is one line that names the
    line: a syntax error, a character YAML refuses (NUL), a tag we do not build (`!!python/...`),
    a value its tag refuses (`!!int abc`, `2023-13-45`), an alias inside itself, or aliases
    that multiply a small file into millions of values."""
    if text is None:
        text = _utf8(path, path.read_bytes())
    try:
        return _load(path, text)
    except RecursionError:
        raise YamlFileError(f"{path}: values nested too deeply (more than {MAX_DEPTH} levels); "
                            "write it flatter") from None  # fmt: skip


def _utf8(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise YamlFileError(f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x}); "
                            "save the file as UTF-8") from None  # fmt: skip


def _load(path: Path, text: str) -> LocatedYaml:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.reader.ReaderError as exc:
        line = text[: exc.position].count("\n") + 1
        code = ord(exc.character) if isinstance(exc.character, str) else exc.character
        char = f"character #x{code:04x}" if isinstance(code, int) else "a character"
        raise YamlFileError(f"{path}:{line}: YAML syntax error: {char}: {exc.reason}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise YamlFileError(f"{path}{line}: YAML syntax error: {problem}") from None
    located = LocatedYaml(path=path, data=None)
    if node is not None:
        located.data = _Builder(path, located.lines).build(node, "")
    return located


def load_value(text: str, name: str) -> Any:
    """One YAML value given on a command line (`--set KEY=VALUE`), built as a file's are."""
    return load_located(Path(name), text).data


class _Builder:
    """Plain data from a composed node graph, recording each key's line."""

    def __init__(self, path: Path, lines: dict[str, int]) -> None:
        self.path, self.lines = path, lines
        self.values = 0
        self.open: set[int] = set()  # nodes being built: meeting one again is a cycle

    def error(self, node: yaml.Node, where: str, problem: str) -> YamlFileError:
        key = f"{where}: " if where else ""
        return YamlFileError(f"{self.path}:{node.start_mark.line + 1}: {key}{problem}")

    def build(self, node: yaml.Node, prefix: str, depth: int = 0) -> Any:
        self.values += 1
        if depth > MAX_DEPTH:
            raise self.error(node, "", f"values nested more than {MAX_DEPTH} levels deep; "
                             "write it flatter")  # fmt: skip
        if self.values > MAX_VALUES:
            raise self.error(node, prefix, f"more than {MAX_VALUES} values (aliases repeating "
                             "aliases?); write the values out")  # fmt: skip
        if id(node) in self.open:
            raise self.error(node, prefix, "an alias inside its own anchor (a value that "
                             "contains itself)")  # fmt: skip
        if isinstance(node, yaml.ScalarNode):
            return self.scalar(node, prefix)
        if node.tag not in (_MAP, _SEQ):
            raise self.error(node, prefix, f"YAML tag {_shown(node.tag)} is not supported here")
        self.open.add(id(node))
        try:
            if isinstance(node, yaml.MappingNode):
                return self.mapping(node, prefix, depth)
            return [self.build(item, f"{prefix}[{i}]", depth + 1)
                    for i, item in enumerate(node.value)]  # fmt: skip
        finally:
            self.open.discard(id(node))

    def mapping(self, node: yaml.MappingNode, prefix: str, depth: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise self.error(key_node, prefix, "a key must be a plain value")
            key = str(self.scalar(key_node, prefix))
            dotted = f"{prefix}.{key}" if prefix else key
            if key in out:
                raise self.error(key_node, dotted, "duplicate key")
            self.lines[dotted] = key_node.start_mark.line + 1
            out[key] = self.build(value_node, dotted, depth + 1)
        return out

    def scalar(self, node: yaml.ScalarNode, where: str) -> Any:
        try:
            return _SCALARS.construct_object(node)
        except yaml.constructor.ConstructorError:
            raise self.error(node, where, f"YAML tag {_shown(node.tag)} is not supported here; "
                             "write a plain value") from None  # fmt: skip
        except (ValueError, OverflowError):
            tag = node.tag.rpartition(":")[2]
            raise self.error(node, where, f"{node.value!r} is not a valid {tag}; quote it to "
                             "keep it as text") from None  # fmt: skip


def _shown(tag: str) -> str:
    return tag.replace("tag:yaml.org,2002:", "!!")


def did_you_mean(word: str, choices: list[str]) -> str:
    match = difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean '{match[0]}'?)" if match else ""
