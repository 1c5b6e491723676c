"""The eval's prompts against the run's training data (`data.path`): a prompt whose question (its
last user turn, or its text) is, whitespace aside, a user turn of a training conversation was
trained on, and a τ or speedup on it measures recall. Counted on every eval and serving result
(`training_overlap`); more than LIMIT of the prompts refuses the eval unless --force.

Training data that is not on this machine (an eval target other than the training one) or that
cannot be read is said and recorded as not checked, never refused: the check guards a figure,
it is not the figure.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from workload.data.chat import DataError, parse_line
from workload.data.source import open_source, raw_lines
from workload.eval.errors import EvalError
from workload.eval.summary import say

# the share of prompts found in the training data above which the eval is refused: a set of
# few prompts (8 of the tiny build's, whose phrase and spelling tasks have few distinct
# questions) may hold one by chance; every overlap is counted, said and recorded all the same
LIMIT = 0.25
SHOWN = 3  # overlapping prompts named in the refusal
PROGRESS_S = 10.0


def question_of(item: dict) -> str | None:
    """What a prompt asks: its last user turn's text, or its raw text."""
    if "prompt" in item:
        return _norm(item["prompt"])
    users = [m for m in item.get("messages") or [] if m.get("role") == "user"]
    return _norm(users[-1].get("content")) if users else None


def _norm(content: object) -> str | None:
    if content is None:
        return None
    text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
    return " ".join(text.split()) or None


def training_overlap(items: list[dict], data: Path | None, force: bool) -> dict:
    """{"data", "prompts", "overlapping", "share", "limit", "where": [...]} or, not checked,
    {"data", "not_checked": why}. EvalError above LIMIT unless `force` (then "forced")."""
    wanted: dict[str, list[str]] = {}
    for item in items:
        q = question_of(item)
        if q is not None:
            wanted.setdefault(q, []).append(item["where"])
    if data is None:
        return {"data": None, "not_checked": "data.path is unset"}
    try:
        found = _found_in(data, set(wanted))
    except DataError as exc:
        say(f"eval: the prompts were not checked against the training data: {exc}")
        return {"data": str(data), "not_checked": str(exc)}
    where = [w for q in wanted if q in found for w in wanted[q]]
    share = len(where) / len(items) if items else 0.0
    out = {"data": str(data), "prompts": len(items), "overlapping": len(where),
           "share": share, "limit": LIMIT, "where": where}  # fmt: skip
    if share > LIMIT and not force:
        named = ", ".join(where[:SHOWN]) + (", ..." if len(where) > SHOWN else "")
        raise EvalError(
            f"{len(where)} of {len(items)} prompts ({share:.0%}) are verbatim user turns of the "
            f"training data ({data}): {named}; above {LIMIT:.0%} the figures measure recall, not "
            "drafting: evaluate on held-out prompts (--prompts FILE), or --force (the overlap "
            "is recorded in the result)"
        )
    if where:
        out["forced"] = share > LIMIT
        say(f"eval: {len(where)} of {len(items)} prompts are in the training data ({share:.0%})")
    return out


def _found_in(data: Path, wanted: set[str]) -> set[str]:
    """The wanted questions that are a user turn somewhere in the training data."""
    source = open_source(data)
    total, done, found = source.bytes, 0, set()
    last = time.monotonic()
    for index, lineno, raw in raw_lines(source):
        done += len(raw)
        record = parse_line(raw, f"{source.files[index]}:{lineno}")
        for m in record.messages if record is not None else []:
            q = _norm(m.get("content")) if m.get("role") == "user" else None
            if q in wanted:
                found.add(q)
        if time.monotonic() - last > PROGRESS_S:
            last = time.monotonic()
            say(f"eval: checking the prompts against the training data: {done / 2**20:.0f} of "
                f"{total / 2**20:.0f} MiB")  # fmt: skip
    return found
