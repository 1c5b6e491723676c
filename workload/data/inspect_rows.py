"""`python -m workload.inspect_data --config RUN.yaml [--n 2] [--index I] [--json]`

Answers "are we training on inputs?": prints samples with the supervised tokens marked (bold
green and inside [[ ]]; the rest dim), per-sample counts, and a summary over the data set.
Needs only the tokenizer of the target, not the model. Reads the data through the token store
the trainer uses (tokenized once, then reused; token_store.py), so any data.path the trainer
takes works here and a large one is never held in memory.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from workload.data.batches import eligible_anchors
from workload.data.chat import DataError, Example, resolve_chat_template
from workload.data.source import open_source
from workload.data.token_store import RenderSettings, TokenStore, find_or_build, store_root

BOLD_GREEN, DIM, RESET = "\033[1;32m", "\033[2m", "\033[0m"


@dataclass
class DataSettings:
    target_path: str
    data_path: str
    max_length: int
    chat_template: str | None
    num_anchors: int
    chat_template_kwargs: dict | None = None
    cache_dir: str | None = None


def read_settings(path: str, overrides: list[str]) -> DataSettings:
    """The data-related settings of a run config (workload.config when present)."""
    try:
        from workload.config import load_config
    except ImportError:
        load_config = None
    if load_config is not None:
        cfg = load_config(path, overrides)
        t, d = cfg.target, cfg.data
        return DataSettings(t.path, d.path, d.max_length, d.chat_template, d.num_anchors,
                            d.chat_template_kwargs, d.cache_dir)  # fmt: skip
    import yaml

    raw = yaml.safe_load(Path(path).read_text()) or {}
    t, d = raw.get("target") or {}, raw.get("data") or {}
    return DataSettings(t.get("path"), d.get("path"), int(d.get("max_length", 4096)),
                        d.get("chat_template"), int(d.get("num_anchors", 512)))  # fmt: skip


def spans(ex: Example) -> list[tuple[list[int], int]]:
    """Runs of consecutive tokens with the same mask value."""
    out: list[tuple[list[int], int]] = []
    for tok, m in zip(ex.input_ids, ex.loss_mask, strict=True):
        if out and out[-1][1] == m:
            out[-1][0].append(tok)
        else:
            out.append(([tok], m))
    return out


def marked(tokenizer, ex: Example, color: bool) -> str:
    parts = []
    for ids, m in spans(ex):
        text = tokenizer.decode(ids)
        if color:
            parts.append(f"{BOLD_GREEN}[[{text}]]{RESET}" if m else f"{DIM}{text}{RESET}")
        else:
            parts.append(f"[[{text}]]" if m else text)
    return "".join(parts)


def n_eligible(ex: Example) -> int:
    mask = torch.tensor(ex.loss_mask, dtype=torch.bool)[None]
    return int(eligible_anchors(mask).sum())


def _opener(tokenizer) -> int | None:
    opener = tokenizer.convert_tokens_to_ids("<|im_start|>")
    if not isinstance(opener, int) or opener == tokenizer.unk_token_id:
        return None
    return opener


DOCS_AT_A_TIME = 10_000


def store_counts(tokenizer, store: TokenStore) -> tuple[np.ndarray, int]:
    """(eligible anchors per example, supervised turn openers: template structure that should
    never be supervised), read a slice of the store at a time."""
    opener = _opener(tokenizer)
    offsets, ids, mask = store.offsets, store.arrays.ids, store.arrays.mask
    eligible = np.zeros(len(store), dtype=np.int64)
    leaks = 0
    for lo in range(0, len(store), DOCS_AT_A_TIME):
        hi = min(lo + DOCS_AT_A_TIME, len(store))
        start, end = int(offsets[lo]), int(offsets[hi])
        m = np.asarray(mask[start:end], dtype=bool)
        pair = np.zeros(len(m), dtype=np.int64)
        pair[:-1] = m[:-1] & m[1:]
        pair[offsets[lo + 1 : hi + 1] - start - 1] = 0  # a pair never spans two examples
        eligible[lo:hi] = np.add.reduceat(pair, offsets[lo:hi] - start)
        if opener is not None:
            leaks += int((m & (np.asarray(ids[start:end]) == opener)).sum())
    return eligible, leaks


def sample_report(tokenizer, ex: Example, index: int, s: DataSettings, color: bool) -> str:
    sup, total, elig = sum(ex.loss_mask), len(ex.input_ids), n_eligible(ex)
    head = (f"--- example {index} ({ex.source}){' TRUNCATED' if ex.truncated else ''}: "
            f"{total} tokens, {sup} supervised ({sup / total:.0%}), {elig} eligible anchors "
            f"(samples {min(elig, s.num_anchors)} of num_anchors {s.num_anchors})")  # fmt: skip
    return f"{head}\n{marked(tokenizer, ex, color)}\n"


def summary(tokenizer, store: TokenStore, s: DataSettings) -> str:
    lengths = store.arrays.lengths()
    elig, leaks = store_counts(tokenizer, store)
    n, skipped = len(store), store.header["skipped"]
    lines = [
        f"data: {s.data_path}",
        f"rows: {n} ({skipped} more skipped: nothing to learn within max_length {s.max_length})",
        f"store: {store.summary()}",
        f"tokens: mean {lengths.mean():.1f}, max {lengths.max()}, total {lengths.sum()}",
        f"supervised: {store.header['supervised'] / lengths.sum():.1%} of tokens",
        f"truncated: {store.truncated_count()} examples longer than {s.max_length}",
        f"eligible anchors per example: mean {elig.mean():.1f}, min {elig.min()}; "
        f"{int((elig < s.num_anchors).sum())} examples have fewer than num_anchors "
        f"{s.num_anchors}",
        f"supervised turn openers (<|im_start|>): {leaks} (should be 0)",
    ]
    return "\n".join(lines)


def open_store(tokenizer, s: DataSettings) -> TokenStore:
    source = open_source(s.data_path)
    settings = RenderSettings(s.max_length, resolve_chat_template(s.chat_template),
                              dict(s.chat_template_kwargs or {}))  # fmt: skip
    root = store_root(source, None, s.cache_dir)
    return find_or_build(source, tokenizer, settings, root=root,
                         say=lambda m: print(m, file=sys.stderr, flush=True))  # fmt: skip


def print_rows(store: TokenStore) -> None:
    """The trainer's rows as JSON lines (CONTRACTS §6): {"source", "ids", "supervised"}."""
    out = sys.stdout
    for i in range(len(store)):
        ex = store.example(i)
        row = {"source": ex.source, "ids": ex.input_ids, "supervised": ex.loss_mask}
        out.write(json.dumps(row, separators=(",", ":")) + "\n")
    out.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workload.inspect_data", description=__doc__)
    p.add_argument("--config", required=True, help="run config (YAML)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="KEY=VALUE", help="override a config key")  # fmt: skip
    p.add_argument("--n", type=int, default=2, help="samples to print (random, see --seed)")
    p.add_argument("--index", type=int, action="append", help="print this example (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    p.add_argument("--json", action="store_true",
                   help="every row, one JSON line each: source, ids, supervised")  # fmt: skip
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    try:
        s = read_settings(a.config, a.overrides)
        if not s.target_path or not s.data_path:
            raise DataError(f"{a.config}: target.path and data.path are required")
        tokenizer = AutoTokenizer.from_pretrained(s.target_path, local_files_only=True)
        store = open_store(tokenizer, s)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print_rows(store)
        return 0
    color = a.color == "always" or (a.color == "auto" and sys.stdout.isatty())
    n = len(store)
    picks = a.index or random.Random(a.seed).sample(range(n), min(a.n, n))
    for i in picks:
        if not 0 <= i < n:
            print(f"error: --index {i} outside 0..{n - 1}", file=sys.stderr)
            return 2
        print(sample_report(tokenizer, store.example(i), i, s, color))
    print(summary(tokenizer, store, s))
    return 0
