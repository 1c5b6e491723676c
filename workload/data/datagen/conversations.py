"""Chat conversations for `workload.datagen`: reading and checking the input, and where replies go.

The input is JSONL, one conversation a line: `{"messages": [{"role", "content"}, ...]}` (our
training data format; roles system, user, assistant, tool; other keys of a message, such as
`tool_calls` or `name`, are kept) or ShareGPT's `{"conversations": [{"from", "value"}, ...]}`
(`from`: human, gpt, system, tool) or Alpaca's `{"instruction", "input", "output"}` (CodeAlpaca's
too: the user turn is the instruction, then the input after a blank line where there is one;
the output is the assistant turn the target answers anew). Blank lines are ignored: they are not conversations. A line
is named `FILE:LINE` (LINE counts every physical line from 1).

Which turns the target answers (`reply_points`): every assistant message after the first user
message, given the messages before it (an assistant message before any user message is kept,
like a system prompt); and, when the conversation ends with a user message, one more reply appended after
it (so a conversation with only user turns gets one reply at the end). System and tool messages
are kept as they are. A conversation without any user message has nothing to answer: skipped.

No torch here: `--check-only` runs with the standard library alone.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool"}  # fmt: skip
NO_USER_TURN = "no user turn"
MAX_LINE_BYTES = 16 << 20  # one conversation a line; a longer line is not one we can generate for


class InputError(Exception):
    """A malformed input line or an unreadable input: the message starts with FILE[:LINE]."""


@dataclass(frozen=True)
class Conversation:
    index: int  # position among the input's conversations, from 0
    line: int  # physical line number, from 1
    messages: list[dict[str, Any]]


@dataclass(frozen=True)
class Source:
    """The checked input: how many conversations, its digest, where every chunk starts."""

    path: Path
    total: int
    sha256: str
    chunk: int
    chunk_starts: tuple[tuple[int, int], ...]  # (byte offset, line) of conversation k * chunk

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def chunks(self) -> int:
        return len(self.chunk_starts)

    def chunk_size(self, k: int) -> int:
        return min(self.chunk, self.total - k * self.chunk)


def _where(path: Path | str, line: int) -> str:
    return f"{path}:{line}"


def _messages_of(record: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object with \"messages\" (a list of "
                         f"{{role, content}}), got {type(record).__name__}")  # fmt: skip
    if "messages" in record:
        return _check_messages(record["messages"], where)
    if "conversations" in record:
        return _from_sharegpt(record["conversations"], where)
    if "instruction" in record:
        return _from_alpaca(record, where)
    raise InputError(f"{where}: no \"messages\" (a list of {{role, content}}), no ShareGPT "
                     f"\"conversations\" and no Alpaca \"instruction\" in this object")  # fmt: skip


def _check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise InputError(f'{where}: "messages" must be a non-empty list of {{role, content}}')
    for i, m in enumerate(messages):
        at = f"{where}: messages[{i}]"
        if not isinstance(m, dict):
            raise InputError(f"{at}: expected an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise InputError(f"{at}.role: {role!r} is not one of {', '.join(ROLES)}")
        content = m.get("content")
        # an assistant turn is replaced by the target's reply: it may hold only tool_calls
        if not isinstance(content, str) and not (role == "assistant" and content is None):
            raise InputError(f"{at}.content: expected a string, got {type(content).__name__}")
    return messages


def _from_sharegpt(turns: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(turns, list) or not turns:
        raise InputError(f'{where}: "conversations" must be a non-empty list of {{from, value}}')
    messages = []
    for i, t in enumerate(turns):
        at = f"{where}: conversations[{i}]"
        if not isinstance(t, dict):
            raise InputError(f"{at}: expected an object with from and value")
        role = SHAREGPT_ROLES.get(t.get("from"))  # type: ignore[arg-type]
        if role is None:
            raise InputError(f"{at}.from: {t.get('from')!r} is not one of "
                             f"{', '.join(SHAREGPT_ROLES)}")  # fmt: skip
        if not isinstance(t.get("value"), str):
            raise InputError(f"{at}.value: expected a string, got {type(t.get('value')).__name__}")
        messages.append({"role": role, "content": t["value"]})
    return messages


def _from_alpaca(record: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """An Alpaca record: the instruction (and its input) asked, the output to be answered anew."""
    for key in ("instruction", "input", "output"):
        value = record.get(key)
        if value is not None and not isinstance(value, str):
            raise InputError(f"{where}: {key}: expected a string, got {type(value).__name__}")
    if not (record.get("instruction") or "").strip():
        raise InputError(f'{where}: "instruction" is empty: nothing to ask the target')
    ask = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
    asked = [{"role": "user", "content": ask}]
    return asked + (
        [{"role": "assistant", "content": record["output"]}] if record.get("output") else []
    )


def parse_line(raw: bytes, where: str) -> list[dict[str, Any]] | None:
    """The messages of one input line (None for a blank line); InputError names `where`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{where}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column "
                         f"{exc.start + 1})") from None  # fmt: skip
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise InputError(f"{where}: JSON nested too deeply to be a conversation") from None
    return _messages_of(record, where)


def lines(f: Any, path: Path | str, number: int = 1) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of an open binary file, each at most MAX_LINE_BYTES (else
    InputError naming it): a huge line is refused before it is held whole."""
    while raw := f.readline(MAX_LINE_BYTES + 1):
        if len(raw) > MAX_LINE_BYTES:
            raise InputError(f"{_where(path, number)}: a line longer than "
                             f"{MAX_LINE_BYTES >> 20} MiB; one conversation a line")  # fmt: skip
        yield number, raw
        number += 1


def scan(path: str | Path, chunk: int) -> Source:
    """Check every line (the first error raises InputError), hash the file and index its
    chunks, in one pass."""
    path = Path(path)
    digest = hashlib.sha256()
    starts: list[tuple[int, int]] = []
    total = offset = 0
    try:
        with open(path, "rb") as f:
            for number, raw in lines(f, path):
                digest.update(raw)
                if parse_line(raw.rstrip(b"\r\n"), _where(path, number)) is not None:
                    if total % chunk == 0:
                        starts.append((offset, number))
                    total += 1
                offset += len(raw)
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror}") from None
    if total == 0:
        raise InputError(f"{path}: no conversations in the file")
    return Source(path, total, digest.hexdigest(), chunk, tuple(starts))


def read_chunk(source: Source, k: int) -> list[Conversation]:
    """The conversations of chunk k: input conversations [k * chunk, (k + 1) * chunk)."""
    first, want = k * source.chunk, source.chunk_size(k)
    offset, number = source.chunk_starts[k]
    out: list[Conversation] = []
    with open(source.path, "rb") as f:
        f.seek(offset)
        for at, raw in lines(f, source.path, number):
            messages = parse_line(raw.rstrip(b"\r\n"), _where(source.path, at))
            if messages is not None:
                out.append(Conversation(first + len(out), at, messages))
                if len(out) == want:
                    break
    return out


def has_user_turn(messages: list[dict[str, Any]]) -> bool:
    return any(m["role"] == "user" for m in messages)


def reply_points(messages: list[dict[str, Any]]) -> list[int]:
    """Indices where the target's replies go, in order: each assistant message after the
    first user message, and len(messages) when the last message is a user's (a reply
    appended at the end)."""
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    points = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > first_user]
    if messages and messages[-1]["role"] == "user":
        points.append(len(messages))
    return points
