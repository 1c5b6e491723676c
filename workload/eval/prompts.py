"""Eval prompts: our JSONL, and the public files of the usual benchmarks, as JSONL or parquet.

A prompt file is read whole, nothing fetched. Its kind is that of its first record, and every
record must be of that kind:

| kind        | a record has                               | the user turn                          |
| ----------- | ------------------------------------------ | -------------------------------------- |
| `chat`      | `messages` ([{role, content}]) or `prompt` (text): ours | the messages as they are; a `prompt` is the text itself, no chat template |
| `gsm8k`     | `question`                                 | question + z-lab's reasoning request   |
| `math500`   | `problem`                                  | problem + z-lab's reasoning request    |
| `humaneval` | `prompt` with `task_id` / `entry_point`    | z-lab's "Write a solution..." wrapper  |
| `mbpp`      | `prompt` (sanitized) or `text`, with `task_id` / `test_list` | the text as it is |
| `mt-bench`  | `turns` (FastChat), or `prompt` as a list (Hugging Face) | the first turn           |

The benchmark prompts are rendered as z-lab's benchmark (`dflash.benchmark`) renders them, so a
τ is comparable with the published figures. MT-Bench: only the first turn is evaluated. The
second turn's context holds the target's own reply to the first, so its prompt would come from a
generation and differ between engines and precisions wherever their replies differ; the first
turn is fixed by the file, as every other benchmark's prompt is.

A record's `category` (MT-Bench's) or `task` (the tiny build's), where it has one, is kept as the
prompt's category: the serving benchmark gives τ per category (else per file kind).

Files: `.jsonl` (one JSON object a line; `.jsonl.gz` too), `.json` (an array of objects) and
`.parquet` (needs pyarrow). A record can carry `chat_template_kwargs`, applied over the run's.
A malformed file is one `PromptsError` naming FILE:LINE (the 1-based line, array item or row).
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REASON = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL = (
    "Write a solution to the following problem and make sure that it passes the tests:\n"
    "```python\n{prompt}\n```"
)


class PromptsError(Exception):
    """A prompt file that cannot be used; the message names FILE[:LINE]."""


@dataclass(frozen=True)
class PromptSet:
    """The prompts of one file: `items` as {"messages"|"prompt", "where", ...}."""

    path: Path
    kind: str
    format: str
    items: list[dict]

    @property
    def name(self) -> str:
        stem = self.path.name
        for suffix in (".gz", ".jsonl", ".json", ".parquet"):
            stem = stem.removesuffix(suffix)
        return stem

    def describe(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "format": self.format,
            "path": str(self.path.resolve()),
            "n_prompts": len(self.items),
        }

    def head(self, n: int | None) -> PromptSet:
        return PromptSet(self.path, self.kind, self.format, self.items[:n])


# ----------------------------------------------------------------------------- kinds


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _text(record: dict, key: str) -> str | None:
    value = record.get(key)
    return value if isinstance(value, str) and value.strip() else None


def _chat(record: dict) -> dict | str:
    messages = record.get("messages")
    if isinstance(messages, list) and messages:
        if not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            return "every message needs 'role' and 'content'"
        return {"messages": messages}
    text = _text(record, "prompt")
    if text:
        return {"prompt": text}
    return "expected 'messages' (a list of {role, content}) or 'prompt' (text)"


def _gsm8k(record: dict) -> dict | str:
    text = _text(record, "question")
    return {"messages": _user(text + REASON)} if text else "expected 'question' (text)"


def _math500(record: dict) -> dict | str:
    text = _text(record, "problem")
    return {"messages": _user(text + REASON)} if text else "expected 'problem' (text)"


def _humaneval(record: dict) -> dict | str:
    text = _text(record, "prompt")
    if not text:
        return "expected 'prompt' (text)"
    return {"messages": _user(HUMANEVAL.format(prompt=text))}


def _mbpp(record: dict) -> dict | str:
    text = _text(record, "prompt") or _text(record, "text")
    return {"messages": _user(text)} if text else "expected 'prompt' or 'text' (text)"


def _turns(record: dict) -> list | None:
    turns = record.get("turns")
    if turns is None and isinstance(record.get("prompt"), list):
        turns = record["prompt"]  # Hugging Face's mt_bench_prompts
    return turns if isinstance(turns, list) else None


def _mt_bench(record: dict) -> dict | str:
    turns = _turns(record)
    if not turns or not isinstance(turns[0], str) or not turns[0].strip():
        return "expected 'turns' (a list of texts)"
    return {"messages": _user(turns[0]), "turns": len(turns)}


KINDS: dict[str, Callable[[dict], dict | str]] = {
    "chat": _chat,
    "gsm8k": _gsm8k,
    "math500": _math500,
    "humaneval": _humaneval,
    "mbpp": _mbpp,
    "mt-bench": _mt_bench,
}


def kind_of(record: dict) -> str | None:
    """The kind a record looks like (by its keys), None when none fits."""
    if "messages" in record:
        return "chat"
    if _turns(record) is not None:
        return "mt-bench"
    if "question" in record:
        return "gsm8k"
    if "problem" in record:
        return "math500"
    if "prompt" in record and ("entry_point" in record or "canonical_solution" in record):
        return "humaneval"
    if ("prompt" in record or "text" in record) and (
        "test_list" in record or "code" in record or "task_id" in record
    ):
        return "mbpp"
    if "prompt" in record:
        return "chat"
    return None


EXPECTED = (
    "expected an object with 'messages' or 'prompt' (ours), or a record of GSM8K ('question'), "
    "MATH-500 ('problem'), HumanEval ('prompt', 'task_id'), MBPP ('text'/'prompt', 'task_id') "
    "or MT-Bench ('turns')"
)


def _prompt(record: Any, kind: str | None, where: str) -> tuple[str, dict]:
    if not isinstance(record, dict):
        raise PromptsError(f"{where}: {EXPECTED}")
    found = kind_of(record)
    if kind is None:
        if found is None:
            raise PromptsError(f"{where}: {EXPECTED}")
        kind = found
    item = KINDS[kind](record)
    if isinstance(item, str):
        raise PromptsError(f"{where}: {item} (a {kind} file, as its first record)")
    kwargs = record.get("chat_template_kwargs", {})
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise PromptsError(f"{where}: chat_template_kwargs must be an object")
    if kwargs:
        item["chat_template_kwargs"] = kwargs
    category = record.get("category") or record.get("task")
    if isinstance(category, str) and category.strip():
        item["category"] = category.strip()  # τ per category (serve_bench); not hashed
    return kind, {**item, "where": where}


# ----------------------------------------------------------------------------- files


def _records_jsonl(path: Path) -> list[tuple[str, Any]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise PromptsError(f"{path}: cannot read prompts: {_reason(exc)}") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            records.append((where, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise PromptsError(f"{where}: not valid JSON ({exc.msg})") from None
        except RecursionError:
            raise PromptsError(f"{where}: JSON nested too deeply to be a prompt") from None
    return records


def _records_json(path: Path) -> list[tuple[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptsError(f"{path}: cannot read prompts: {_reason(exc)}") from None
    except json.JSONDecodeError as exc:
        raise PromptsError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(data, list):
        raise PromptsError(f"{path}: expected a JSON array of prompt records")
    return [(f"{path}:{i}", record) for i, record in enumerate(data, 1)]


def _records_parquet(path: Path) -> list[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PromptsError(
            f"{path}: reading parquet needs pyarrow (pip install pyarrow), or convert it to JSONL"
        ) from None
    try:
        rows = pq.read_table(path).to_pylist()
    except OSError as exc:
        raise PromptsError(f"{path}: cannot read prompts: {_reason(exc)}") from None
    except Exception as exc:  # pyarrow's ArrowInvalid and kin: not a parquet file
        raise PromptsError(f"{path}: not a readable parquet file ({_reason(exc)})") from None
    return [(f"{path}:{i}", row) for i, row in enumerate(rows, 1)]


def _reason(exc: BaseException) -> str:
    text = getattr(exc, "strerror", None) or str(exc).strip().splitlines()[0:1]
    return text if isinstance(text, str) else (text[0] if text else type(exc).__name__)


def file_format(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".json"):
        return "json"
    return "jsonl"


READERS = {"jsonl": _records_jsonl, "json": _records_json, "parquet": _records_parquet}


def read_prompt_set(path: Path) -> PromptSet:
    """Every prompt of `path`, checked; PromptsError names the first bad FILE:LINE."""
    if not path.is_file():
        raise PromptsError(f"{path}: no such prompts file")
    fmt = file_format(path)
    kind, items = None, []
    for where, record in READERS[fmt](path):
        kind, item = _prompt(record, kind, where)
        items.append(item)
    if not items:
        raise PromptsError(f"{path}: no prompts in the file")
    return PromptSet(path, kind, fmt, items)


# ----------------------------------------------------------------------------- rendering


def render(tokenizer: Any, item: dict, template: str | None, kwargs: dict) -> list[int]:
    """Token ids of one prompt: its messages through the chat template (with the run's kwargs,
    then the record's own), or its text as it is."""
    if item.get("messages"):
        text = tokenizer.apply_chat_template(
            item["messages"],
            tokenize=False,
            add_generation_prompt=True,
            chat_template=template,
            **{**kwargs, **item.get("chat_template_kwargs", {})},
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(item["prompt"])["input_ids"])


def prompts_sha256(items: list[dict]) -> str:
    """sha256 of what decides the prompts: each one's messages or text and its own kwargs, in
    order (not the file's bytes, path or format: the same prompts in parquet hash the same)."""
    h = hashlib.sha256()
    for item in items:
        keep = {k: item[k] for k in ("messages", "prompt", "chat_template_kwargs") if k in item}
        h.update(json.dumps(keep, sort_keys=True, ensure_ascii=False).encode())
        h.update(b"\n")
    return h.hexdigest()
