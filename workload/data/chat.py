"""Chat JSONL -> token ids + assistant loss mask, rendered as served (rows into batches:
batches.py).

The trainer reads a tokenized store (token_store.py) through `batches.TokenArrays`;
`load_examples` keeps a small file's examples in memory (tests, tools). Both make rows with
`render_at`.

Input format: one JSON object per line, `{"messages": [{"role": ..., "content": ...}, ...]}`
(ShareGPT's `{"conversations": [{"from": "human"|"gpt", "value": ...}]}` is accepted too); a
datagen record's `turns` (the engine's own prompt and reply ids, CONTRACTS §7) are trained as
they are, with no rendering.

Rows as served (`render_rows`): every assistant turn is trained on the prompt it would be served
with (the turns before it rendered with the generation prompt, the run's template and kwargs),
followed by the tokens of its reply. Where each turn's prompt starts with the row so far (ChatML,
preserve_thinking) one row holds every turn; otherwise (a template that drops earlier reasoning)
a turn starts a row of its own. A turn that cannot be placed is left out and counted, with its
reason, in the store's report: a reply is trained only after its own serving prompt, never found
by a guess (an earlier turn's header in the render is no proof). Rows hold at most
`data.max_length` tokens: a reply that runs past it is trained up to it and counted, with the
supervised tokens lost (`rows_of_turns`); a turn whose prompt alone fills it is left out,
counted. A reply cut at a length limit (datagen's max_new_tokens, or max_length) is trained up
to the cut, with no end-of-turn token (docs/workload-design.md says why).

Error policy of `load_examples`: a line that is not valid JSON, has no message list, or has no
assistant turn is an error (`DataError`, one line, `file:line: reason`): a broken data set
should stop a run before it spends GPU hours, not shrink silently. A conversation with no
eligible anchor within `max_length` (no two consecutive supervised tokens: an empty reply, or a
reply cut off after its first token) can teach nothing and is skipped, with one warning that
counts them (rows, after this: a conversation may give several).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Tokens that end an assistant turn in the chat templates we know; the tokenizer's eos is added.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
}


class DataError(ValueError):
    """A data set problem, reported as one line naming the file and line."""


@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on assistant tokens only
    truncated: bool = False
    source: str = ""  # "file:line" when loaded from a file
    cut: bool = False  # holds a reply cut at the length limit (no end token trained)


# ----------------------------------------------------------------------------- rendering


def resolve_chat_template(chat_template: str | None) -> str | None:
    """A literal Jinja template, or a path to a file holding one (None: the tokenizer's own)."""
    if chat_template is None or "{" in chat_template:
        return chat_template
    path = Path(chat_template)
    if not path.is_file():
        raise DataError(
            f"data.chat_template: {chat_template} is neither a Jinja template nor a file"
        )
    return path.read_text()


def end_of_turn_ids(tokenizer) -> set[int]:
    ids = set()
    for tok in (*_END_OF_TURN, tokenizer.eos_token):
        if tok is None:
            continue
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return ids


@dataclass(frozen=True)
class Turn:
    """One assistant turn as served: the prompt the engine is given, then the reply's tokens
    (its end-of-turn token last, unless the reply was cut at the length limit)."""

    prompt_ids: list[int]
    reply_ids: list[int]
    cut: bool = False


@dataclass
class Rendered:
    """A conversation's rows, and what could not be made of it."""

    rows: list[Example]
    turns: int = 0  # assistant turns placed in the rows
    cut: int = 0  # of them, replies datagen cut at max_new_tokens (trained with no end token)
    unplaced: list[str] = field(default_factory=list)  # one reason per turn left out
    no_reasoning: int = 0  # turns trained without the data's reasoning (the prompt closed it)
    length_cut: int = 0  # placed turns whose reply runs past max_length (trained up to it)
    lost: int = 0  # reply tokens past max_length: supervision the rows do not hold


def _text(tokenizer, messages: list[dict], template: str | None, generation: bool,
          kwargs: dict) -> str:  # fmt: skip
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation,
                                         chat_template=template, **kwargs)  # fmt: skip


def _tokens(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


_THINK = re.compile(r"^\s*(?:<think>)?.*?</think>\s*", re.S)


def without_reasoning(message: dict) -> dict:
    """The assistant message with its reasoning left out (reasoning_content, or a think block at
    the start of its content)."""
    out = {k: v for k, v in message.items() if k != "reasoning_content"}
    if isinstance(out.get("content"), str) and "</think>" in out["content"]:
        out["content"] = _THINK.sub("", out["content"], count=1)
    return out


def _has_reasoning(message: dict) -> bool:
    content = message.get("content")
    return bool(message.get("reasoning_content")) or (
        isinstance(content, str) and "</think>" in content
    )


def serve_turn(tokenizer, messages: list[dict], i: int, template: str | None, kwargs: dict,
               eot: set[int]) -> tuple[Turn, bool]:  # fmt: skip
    """Assistant turn i as served: the turns before it rendered with the generation prompt, then
    its reply: the text the template renders after that prompt when the turn comes last, up to
    and including its end-of-turn token, tokenized on its own (as the target writes it after
    the prompt's last token). When the prompt closes the reasoning (thinking off) and the data
    has reasoning, the reply is the turn without it: (turn, True). ValueError: cannot be placed."""
    prompt = _text(tokenizer, messages[:i], template, True, kwargs)
    bare = _text(tokenizer, messages[:i], template, False, kwargs) if i else ""
    header = prompt[len(bare) :] if prompt.startswith(bare) else ""
    own = _Own(tokenizer, prompt, header, eot)
    dropped = False
    reply = own.reply(_text(tokenizer, messages[: i + 1], template, False, kwargs), messages[i])
    if reply is None and _has_reasoning(messages[i]):
        bare_turn = [*messages[:i], without_reasoning(messages[i])]
        full = _text(tokenizer, bare_turn, template, False, kwargs)
        reply, dropped = own.reply(full, bare_turn[i]), True
    if reply is None:
        raise ValueError(own.why or "the turn's render does not continue its serving prompt")
    return Turn(_tokens(tokenizer, prompt), reply), dropped


@dataclass
class _Own:
    """Finds a turn's own reply in the render of the conversation up to it; `why` says what
    failed last."""

    tokenizer: Any
    prompt: str
    header: str  # the generation header: what the prompt adds to the turns before it
    eot: set[int]
    why: str = ""

    def reply(self, full: str, message: dict) -> list[int] | None:
        """The reply's tokens up to its end-of-turn token: where `full` starts with the prompt,
        what follows; else (a template that rewrites earlier text, such as a count of messages)
        what follows the last generation header, only where that is provably the turn's own:
        it ends the render and holds the turn's answer (an earlier turn's header, such as an
        empty think block kept by preserve_thinking, is no proof). None: not found."""
        if full.startswith(self.prompt):
            return self._split(full[len(self.prompt) :])[0]
        at = full.rfind(self.header) if self.header.strip() else -1
        if at < 0:
            self.why = "the turn's render does not continue its serving prompt"
            return None
        ids, tail = self._split(full[at + len(self.header) :])
        answer = str(without_reasoning(message).get("content") or "").strip()
        if self.tokenizer.decode(tail).strip() or answer not in self.tokenizer.decode(ids):
            self.why = ("the turn's render does not continue its serving prompt, and what follows "
                        "the last generation header is not provably its own reply")  # fmt: skip
            return None
        return ids

    def _split(self, text: str) -> tuple[list[int], list[int]]:
        """(the tokens up to the first end-of-turn token, the rest)."""
        ids = _tokens(self.tokenizer, text)
        end = next((j + 1 for j, t in enumerate(ids) if t in self.eot), 0)
        if not end:
            raise ValueError("no end-of-turn token after the reply")
        return ids[:end], ids[end:]


def _reason(exc: Exception) -> str:
    if isinstance(exc, ValueError) and not type(exc).__module__.startswith("jinja2"):
        return str(exc)
    return f"chat template failed: {' '.join(str(exc).split())[:200]}"


PAST_MAX_LENGTH = "its serving prompt fills max_length: no reply token fits"


def rows_of_turns(turns: list[Turn], max_length: int) -> Rendered:
    """Turns as rows of at most `max_length` tokens: a turn whose prompt starts with the row so
    far (the template renders each prompt as a prefix of the next) extends it, else it starts
    a new row. Supervised: the reply tokens; a cut reply has no end token, so none is trained.
    A reply that runs past max_length is trained up to it and counted (`length_cut`, its lost
    tokens in `lost`); a turn whose prompt alone fills max_length is left out, counted. (With
    a prefix-extending template a later turn's prompt holds the row before it: a new row of its
    own would be no shorter.)"""
    out = Rendered([])
    for t in turns:
        room = max_length - len(t.prompt_ids)
        kept = list(t.reply_ids[: max(room, 0)])
        out.lost += len(t.reply_ids) - len(kept)
        if not kept:
            out.unplaced.append(PAST_MAX_LENGTH)
            continue
        row = out.rows[-1] if out.rows else None
        if row is not None and t.prompt_ids[: len(row.input_ids)] == row.input_ids:
            extra = t.prompt_ids[len(row.input_ids) :]
            row.input_ids += extra + kept
            row.loss_mask += [0] * len(extra) + [1] * len(kept)
        else:
            row = Example(list(t.prompt_ids) + kept, [0] * len(t.prompt_ids) + [1] * len(kept))
            out.rows.append(row)
        row.cut = row.cut or t.cut
        row.truncated = row.truncated or len(kept) < len(t.reply_ids)
        out.turns += 1
        out.cut += t.cut
        out.length_cut += len(kept) < len(t.reply_ids)
    return out


def render_rows(
    tokenizer,
    messages: list[dict],
    *,
    max_length: int,
    chat_template: str | None = None,
    template_kwargs: dict | None = None,
) -> Rendered:
    """Every assistant turn on the prompt it would be served with (`serve_turn`), as rows
    (`rows_of_turns`). A turn that cannot be placed is left out with its reason.
    (A change to what this returns must bump token_store.STORE_FORMAT.)"""
    template = resolve_chat_template(chat_template)
    kwargs = dict(template_kwargs or {})
    eot = end_of_turn_ids(tokenizer)
    turns, unplaced, dropped_reasoning = [], [], 0
    for i, msg in enumerate(messages):
        if msg.get("role") != "assistant":
            continue
        try:
            turn, dropped = serve_turn(tokenizer, messages, i, template, kwargs, eot)
        except Exception as exc:  # the template refused it, or the turn has no place
            unplaced.append(_reason(exc))
            continue
        turns.append(turn)
        dropped_reasoning += dropped
    out = rows_of_turns(turns, max_length)
    out.unplaced[:0] = unplaced
    out.no_reasoning = dropped_reasoning
    return out


def rows_of_record(turns: Any, max_length: int) -> Rendered:
    """A datagen record's `turns` (CONTRACTS §7), the engine's own tokens: no rendering."""
    if not isinstance(turns, list) or not turns:
        raise ValueError("'turns' must be a non-empty list")
    parsed = []
    for k, t in enumerate(turns):
        ok = isinstance(t, dict) and all(
            isinstance(t.get(key), list) and all(type(x) is int for x in t[key])
            for key in ("prompt_ids", "reply_ids")
        )
        if not ok or t.get("finish_reason") not in ("stop", "length"):
            raise ValueError(f"turns[{k}]: expected prompt_ids and reply_ids (lists of token "
                             'ids) and finish_reason "stop" or "length"')  # fmt: skip
        parsed.append(Turn(t["prompt_ids"], t["reply_ids"], t["finish_reason"] == "length"))
    return rows_of_turns(parsed, max_length)


def render_chat(
    tokenizer,
    messages: list[dict],
    *,
    max_length: int,
    chat_template: str | None = None,
    template_kwargs: dict | None = None,
) -> Example:
    """The one row of a conversation whose turns all go in one row (`render_rows`), cut at
    `max_length` (`truncated`: a turn past it is not in the row); DataError when a turn cannot
    be placed or the turns need several rows."""
    r = render_rows(tokenizer, messages, max_length=max_length, chat_template=chat_template,
                    template_kwargs=template_kwargs)  # fmt: skip
    misplaced = [why for why in r.unplaced if why != PAST_MAX_LENGTH]
    if misplaced:
        raise DataError(f"chat template: an assistant turn cannot be placed: {misplaced[0]}")
    if len(r.rows) != 1:
        raise DataError(f"chat template: the turns need {len(r.rows)} rows (render_rows)")
    return r.rows[0]


# ----------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class Record:
    """One line of the data: its messages, and a datagen record's `turns` (CONTRACTS §7)."""

    messages: list[dict]
    turns: list | None = None


def _record_of(record: Any) -> Record:
    if not isinstance(record, dict):
        raise ValueError("expected a JSON object with a 'messages' list")
    if isinstance(record.get("messages"), list):
        msgs = record["messages"]
    elif isinstance(record.get("conversations"), list):
        msgs = [_from_sharegpt(m) for m in record["conversations"]]
    else:
        raise ValueError("expected a 'messages' list (or ShareGPT 'conversations')")
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError("every message needs a 'role'")
    if not any(m["role"] == "assistant" for m in msgs):
        raise ValueError("conversation has no assistant turn")
    return Record(msgs, record.get("turns"))


def _from_sharegpt(m: Any) -> dict:
    if isinstance(m, dict) and "from" in m:
        role = _SHAREGPT_ROLES.get(m["from"])
        if role is None:
            raise ValueError(f"unknown ShareGPT speaker {m['from']!r}")
        return {"role": role, "content": m.get("value", "")}
    return m


def parse_line(raw: bytes, where: str) -> Record | None:
    """The record of one JSONL line (None when blank); DataError naming `where` (file:line)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{where}: not UTF-8 text") from None
    if not line.strip():
        return None
    try:
        return _record_of(json.loads(line))
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: invalid JSON ({e.msg}, column {e.colno})") from None
    except ValueError as e:
        raise DataError(f"{where}: {e}") from None


def read_conversations(path: str | os.PathLike) -> list[tuple[int, Record]]:
    """(line number, record) for each non-blank line; DataError on the first bad line."""
    out = []
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below; its error is one line
    except OSError as e:
        raise DataError(f"{path}: cannot read the data: {e.strerror}") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            record = parse_line(raw, f"{path}:{lineno}")
            if record is not None:
                out.append((lineno, record))
    return out


def render_at(
    tokenizer, record: Record, where: str, *, max_length: int, template: str | None,
    template_kwargs: dict | None = None,
) -> Rendered:  # fmt: skip
    """The rows of one line: a datagen record's own tokens (`rows_of_record`), else its
    messages rendered as served (`render_rows`); a malformed `turns` is one line naming
    `where`."""
    try:
        if record.turns is not None:
            out = rows_of_record(record.turns, max_length)
        else:
            out = render_rows(tokenizer, record.messages, max_length=max_length,
                              chat_template=template, template_kwargs=template_kwargs)  # fmt: skip
    except ValueError as e:
        raise DataError(f"{where}: {e}") from None
    for row in out.rows:
        row.source = where
    return out


def _render_lines(args) -> list[Rendered]:
    path, tokenizer, items, max_length, template, kwargs = args
    return [
        render_at(tokenizer, record, f"{path}:{lineno}", max_length=max_length,
                  template=template, template_kwargs=kwargs)
        for lineno, record in items
    ]  # fmt: skip


def has_anchor(loss_mask: list[int]) -> bool:
    """Whether some position a has loss_mask[a] and loss_mask[a + 1] (an eligible anchor)."""
    return any(a and b for a, b in zip(loss_mask, loss_mask[1:], strict=False))


def _workers(n_items: int, workers: int | None) -> int:
    if workers is None:  # rendering costs ~0.5-5 ms per conversation: parallel when it adds up
        workers = min(16, os.cpu_count() or 1) if n_items >= 20_000 else 1
    return max(1, min(workers, n_items // 1000 or 1))


def check_template(path: str | os.PathLike, tokenizer, template: str | None) -> None:
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{path}: the target's tokenizer has no chat template; set data.chat_template"
        )


def load_examples(
    path: str | os.PathLike,
    tokenizer,
    *,
    max_length: int,
    chat_template: str | None = None,
    workers: int | None = None,
    template_kwargs: dict | None = None,
) -> list[Example]:
    """Render every conversation of a chat JSONL file into memory (see the module doc for the
    error policy); the trainer reads a token store instead (token_store.py). `workers` > 1
    renders in forked processes; the result is the same, in file order."""
    template = resolve_chat_template(chat_template)
    check_template(path, tokenizer, template)
    items = read_conversations(path)
    n = _workers(len(items), workers)
    chunks = [items[i::n] for i in range(n)] if n > 1 else [items]
    jobs = [(str(path), tokenizer, chunk, max_length, template, template_kwargs)
            for chunk in chunks]  # fmt: skip
    if n > 1:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        with multiprocessing.get_context("fork").Pool(n) as pool:
            parts = pool.map(_render_lines, jobs)
        rendered = [parts[i % n][i // n] for i in range(len(items))]
    else:
        rendered = _render_lines(jobs[0])
    rows = [row for r in rendered for row in r.rows]
    examples = [ex for ex in rows if has_anchor(ex.loss_mask)]
    if len(examples) < len(rows):
        log.warning(
            "%s: skipped %d rows with no eligible anchor (two consecutive supervised tokens) "
            "within max_length=%d",
            path,
            len(rows) - len(examples),
            max_length,
        )
    unplaced = [(lineno, why) for (lineno, _), r in zip(items, rendered, strict=True)
                for why in r.unplaced]  # fmt: skip
    if unplaced:
        lineno, why = unplaced[0]
        log.warning("%s: %d assistant turns left out (first: line %d: %s)", path,
                    len(unplaced), lineno, why)  # fmt: skip
    if not examples:
        raise DataError(f"{path}: no usable conversations")
    return examples
