"""`python -m workload.inspect_data --config RUN.yaml [--n 2] [--index I]`

Answers "are we training on inputs?": prints samples with the supervised tokens marked (bold
green and inside [[ ]]; the rest dim), per-sample counts, and a summary over the data set.
Needs only the tokenizer of the target, not the model.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from workload.data import DataError, Example, eligible_anchors, load_examples, read_conversations

BOLD_GREEN, DIM, RESET = "\033[1;32m", "\033[2m", "\033[0m"


@dataclass
class DataSettings:
    target_path: str
    data_path: str
    max_length: int
    chat_template: str | None
    num_anchors: int


def read_settings(path: str, overrides: list[str]) -> DataSettings:
    """The data-related settings of a run config (workload.config when present)."""
    try:
        from workload.config import load_config
    except ImportError:
        load_config = None
    if load_config is not None:
        cfg = load_config(path, overrides)
        t, d = cfg.target, cfg.data
        return DataSettings(t.path, d.path, d.max_length, d.chat_template, d.num_anchors)
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


def header_leaks(tokenizer, examples: list[Example]) -> int:
    """Supervised tokens that can only be template structure (a turn opener): should be 0."""
    opener = tokenizer.convert_tokens_to_ids("<|im_start|>")
    if not isinstance(opener, int) or opener == tokenizer.unk_token_id:
        return 0
    return sum(
        1 for e in examples for t, m in zip(e.input_ids, e.loss_mask, strict=True)
        if m and t == opener
    )  # fmt: skip


def sample_report(tokenizer, ex: Example, index: int, s: DataSettings, color: bool) -> str:
    sup, total, elig = sum(ex.loss_mask), len(ex.input_ids), n_eligible(ex)
    head = (f"--- example {index} ({ex.source}){' TRUNCATED' if ex.truncated else ''}: "
            f"{total} tokens, {sup} supervised ({sup / total:.0%}), {elig} eligible anchors "
            f"(samples {min(elig, s.num_anchors)} of num_anchors {s.num_anchors})")  # fmt: skip
    return f"{head}\n{marked(tokenizer, ex, color)}\n"


def summary(tokenizer, examples: list[Example], n_lines: int, s: DataSettings) -> str:
    lengths = [len(e.input_ids) for e in examples]
    sup = sum(sum(e.loss_mask) for e in examples)
    elig = [n_eligible(e) for e in examples]
    lines = [
        f"data: {s.data_path}",
        f"examples: {len(examples)} of {n_lines} conversations "
        f"({n_lines - len(examples)} skipped: nothing supervised within max_length {s.max_length})",
        f"tokens: mean {sum(lengths) / len(lengths):.1f}, max {max(lengths)}, total {sum(lengths)}",
        f"supervised: {sup / sum(lengths):.1%} of tokens",
        f"truncated: {sum(e.truncated for e in examples)} examples longer than {s.max_length}",
        f"eligible anchors per example: mean {sum(elig) / len(elig):.1f}, min {min(elig)}; "
        f"{sum(x < s.num_anchors for x in elig)} examples have fewer than num_anchors "
        f"{s.num_anchors}",
        f"supervised turn openers (<|im_start|>): {header_leaks(tokenizer, examples)} "
        "(should be 0)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workload.inspect_data", description=__doc__)
    p.add_argument("--config", required=True, help="run config (YAML)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="KEY=VALUE", help="override a config key")  # fmt: skip
    p.add_argument("--n", type=int, default=2, help="samples to print (random, see --seed)")
    p.add_argument("--index", type=int, action="append", help="print this example (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    try:
        s = read_settings(a.config, a.overrides)
        if not s.target_path or not s.data_path:
            raise DataError(f"{a.config}: target.path and data.path are required")
        tokenizer = AutoTokenizer.from_pretrained(s.target_path, local_files_only=True)
        examples = load_examples(s.data_path, tokenizer, max_length=s.max_length,
                                 chat_template=s.chat_template)  # fmt: skip
        n_lines = len(read_conversations(s.data_path))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    color = a.color == "always" or (a.color == "auto" and sys.stdout.isatty())
    picks = a.index or random.Random(a.seed).sample(range(len(examples)), min(a.n, len(examples)))
    for i in picks:
        if not 0 <= i < len(examples):
            print(f"error: --index {i} outside 0..{len(examples) - 1}", file=sys.stderr)
            return 2
        print(sample_report(tokenizer, examples[i], i, s, color))
    print(summary(tokenizer, examples, n_lines, s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
