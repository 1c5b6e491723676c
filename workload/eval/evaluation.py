"""One evaluation's state and its simulation: the prompts rendered, the target and drafters
once loaded, every prompt's simulated rounds, the real loops (`--check-real`), the result."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from transformers import AutoTokenizer

from workload.eval.decode import (
    PromptResult,
    evaluate_drafter,
    greedy_continuation,
    real_generate,
    real_tree_generate,
    sync_device,
    target_hidden_states,
)
from workload.eval.errors import EvalError
from workload.eval.fingerprint import (
    checkpoint_sha256,
    fingerprint,
    target_identity,
    template_sha256,
)
from workload.eval.inputs import (
    chat_template,
    check_manifest,
    drafter_block_size,
    generation_config,
    load_drafter,
    load_target_of,
    prompt_set_of,
    render_prompt,
    stop_ids_of,
)
from workload.eval.overlap import training_overlap
from workload.eval.prompts import prompts_sha256
from workload.eval.run_settings import RunSettings, chat_template_kwargs, load_run_settings
from workload.eval.summary import (
    compare_rounds,
    fmt,
    mean_over_prompts,
    prompt_record,
    rate,
    say,
    summarize,
    totals,
)

OFFICIAL_BUDGETS = (16, 32, 64)  # the smallest of the official DDTree benchmark's budgets
TRAINING_BUDGET = 8  # training's dds8, for a side-by-side
DEFAULT_BUDGETS = (TRAINING_BUDGET, *OFFICIAL_BUDGETS)


def budgets_of(text: str) -> list[int]:
    try:
        budgets = sorted({*DEFAULT_BUDGETS, *(int(x) for x in text.split(",") if x.strip())})
    except ValueError:
        raise EvalError(
            f"--budgets {text}: expected comma-separated integers, e.g. 128,256"
        ) from None
    if any(b < 1 for b in budgets):
        raise EvalError(f"--budgets {text}: budgets must be >= 1")
    return budgets


def device_of(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class Subject:
    name: str  # "checkpoint" or "reference"
    path: Path
    drafter: torch.nn.Module | None = None
    results: list[PromptResult] = field(default_factory=list)

    @property
    def block_size(self) -> int:
        if self.drafter is not None:
            return int(self.drafter.block_size)
        return drafter_block_size(self.path)


def prompts_path(args: argparse.Namespace, settings: RunSettings) -> Path:
    if args.prompts is not None:
        return args.prompts
    if settings.data_path is None:
        raise EvalError(f"{args.config}: data.path is unset; pass --prompts FILE")
    return settings.data_path.parent / "prompts.jsonl"


class Evaluation:
    """One command's state: the prompts (rendered), the target and drafters once loaded, the
    running timings. The tokenizer comes first: an engine may need the accelerator before the
    simulation loads the target (`load_models`)."""

    def __init__(self, args: argparse.Namespace) -> None:

        self.t_start = time.perf_counter()
        self.args = args
        self.budgets = budgets_of(args.budgets)
        if args.max_new_tokens < 1:
            raise EvalError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
        self.settings = load_run_settings(args.config, args.overrides)
        self.kwargs = chat_template_kwargs(args.chat_template_kwargs, self.settings)
        self.prompts_path = prompts_path(args, self.settings)
        self.prompt_set = prompt_set_of(self.prompts_path).head(args.max_prompts)
        self.prompts = self.prompt_set.items
        check_manifest(args.checkpoint, required=not args.allow_incomplete)
        if args.reference is not None:
            check_manifest(args.reference, required=False)  # z-lab's drafters have none
        named = [("checkpoint", args.checkpoint), ("reference", args.reference)]
        self.subjects = [Subject(name, path) for name, path in named if path is not None]
        self.device = device_of(args.device)
        self.target = None
        target_path = self.settings.target_path
        if not (target_path / "config.json").is_file():
            raise EvalError(f"target.path {target_path}: no config.json (not a model directory)")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(target_path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise EvalError(f"target.path {target_path}: {str(exc).splitlines()[0]}") from None
        self.template = chat_template(self.settings.chat_template)
        self.stops = stop_ids_of(generation_config(target_path), self.tokenizer)
        self.ids = [
            render_prompt(self.tokenizer, item, self.template, self.kwargs) for item in self.prompts
        ]
        self.overlap = training_overlap(self.prompts, self.settings.data_path, args.force)
        self.timing = {"load_s": time.perf_counter() - self.t_start}
        self.timing.update(generate_s=0.0, forward_s=0.0, draft_s=0.0)

    def load_models(self) -> None:
        t0 = time.perf_counter()
        self.target, _ = load_target_of(self.settings, self.device)
        dtype = self.target.get_input_embeddings().weight.dtype
        for s in self.subjects:
            s.drafter = load_drafter(s.path, dtype=dtype, device=self.device)
        self.timing["load_s"] += time.perf_counter() - t0

    @property
    def dtype(self) -> str:
        return str(self.target.get_input_embeddings().weight.dtype).removeprefix("torch.")

    def run(self) -> dict:
        self.load_models()
        say(
            f"eval: {len(self.prompts)} prompts from {self.prompts_path}, max "
            f"{self.args.max_new_tokens} new tokens, budgets {self.budgets}, on {self.device} "
            f"({self.timing['load_s']:.1f}s to load)"
        )
        records = self.simulate_all()
        result = self.assemble(records)
        result["engine"] = sim_engine()
        result["fingerprint"] = self.fingerprint(result["engine"], self.dtype)
        return self.finish(result)

    def simulate_all(self, continuations: list[list[int]] | None = None) -> list[dict]:
        """Every prompt's record: its continuation (given, else decoded by the target), one
        target forward, every drafter simulated on it."""
        records = []
        for i, item in enumerate(self.prompts):
            new = continuations[i] if continuations is not None else None
            records.append({"index": i, **self.prompt(item, self.ids[i], new)})
            self.progress(i, records[-1])
        return records

    def finish(self, result: dict) -> dict:
        if self.args.check_real:
            result["check_real"] = self.check_real(self.prompts[: self.args.check_real])
        result["real_loop_rounds_checked"] = result.get("check_real", {}).get("rounds_checked", 0)
        self.timing["total_s"] = time.perf_counter() - self.t_start
        result["timing"] = {k: round(v, 3) for k, v in self.timing.items()}
        return result

    def prompt(self, item: dict, prompt: list[int], new: list[int] | None = None) -> dict:
        """Decode the continuation (unless given), one forward, then simulate every drafter."""
        t0 = time.perf_counter()
        if new is None:
            new = greedy_continuation(self.target, prompt, self.args.max_new_tokens, self.stops)
        sync_device(self.device)
        t1 = time.perf_counter()
        hidden_states = target_hidden_states(self.target, prompt + new)
        sync_device(self.device)
        self.timing["generate_s"] += t1 - t0
        self.timing["forward_s"] += time.perf_counter() - t1
        record = {
            "where": item["where"],
            "prompt_tokens": len(prompt),
            "new_tokens": len(new),
            "stopped": bool(new) and new[-1] in set(self.stops),
        }
        for s in self.subjects:
            res = evaluate_drafter(
                s.drafter,
                self.target,
                hidden_states,
                prompt + new,
                len(prompt),
                self.args.max_new_tokens,
                self.stops,
                self.budgets,
            )
            self.timing["draft_s"] += res.draft_s
            s.results.append(res)
            record[s.name] = prompt_record(res)
        return record

    def progress(self, i: int, record: dict) -> None:
        parts = [
            f"prompt {i + 1}/{len(self.prompts)}: "
            f"{record['prompt_tokens']}+{record['new_tokens']} tokens"
        ]
        for s in self.subjects:
            running = mean_over_prompts([r.chain for r in s.results])
            parts.append(f"{s.name} tau {fmt(record[s.name]['tau'])} (running {fmt(running)})")
        say(", ".join(parts))

    def summary(self, s: Subject) -> dict:
        return {
            **summarize(s.results, s.block_size, self.budgets),
            "n_prompts": len(s.results),
            "max_new_tokens": self.args.max_new_tokens,
            "checkpoint": str(s.path.resolve()),
            "checkpoint_sha256": checkpoint_sha256(s.path),
        }

    def assemble(self, records: list[dict]) -> dict:
        result = self.summary(self.subjects[0])
        result["budgets"] = self.budgets
        result["prompts_file"] = str(self.prompts_path.resolve())
        result["prompt_set"] = self.prompt_set.describe()
        result["training_overlap"] = self.overlap
        result["prompts"] = records
        if len(self.subjects) > 1:
            result["reference"] = self.summary(self.subjects[1])
        return result

    def fingerprint(self, engine: dict, dtype: str) -> dict:
        return fingerprint(
            prompts_sha256=prompts_sha256(self.prompts),
            chat_template_sha256=template_sha256(self.template, self.tokenizer),
            chat_template_kwargs=self.kwargs,
            max_new_tokens=self.args.max_new_tokens,
            block_size=self.subjects[0].block_size,
            target=target_identity(self.settings.target_path),
            engine=engine,
            dtype=dtype,
        )

    def check_real(self, items: list[dict]) -> dict:
        """The real loops on a few prompts (chain, and DDTree per budget) against the simulated
        rounds, and the chain loop's tokens per second against plain greedy decoding."""
        subject, details = self.subjects[0], []
        clock = {"real_s": 0.0, "real_tokens": 0, "ar_s": 0.0, "ar_tokens": 0}
        trees: dict[int, list[dict]] = {b: [] for b in self.budgets}
        for i in range(len(items)):
            ids = self.ids[i]
            real, tokens = self._timed_real(subject.drafter, ids, clock)
            details.append(
                {
                    "index": i,
                    **compare_rounds(real, subject.results[i].chain),
                    "new_tokens": len(tokens),
                }
            )
            for b in self.budgets:
                trees[b].append(compare_rounds(self._real_tree(subject.drafter, ids, b),
                                         subject.results[i].trees[b]))  # fmt: skip
            d = details[-1]
            say(
                f"check-real {i + 1}/{len(items)}: real tau {fmt(d['real_tau'])}, simulated "
                f"{fmt(d['simulated_tau'])}, rounds equal: {d['equal']} "
                f"({d['rounds_equal']}/{d['rounds']}); ddtree real/simulated "
                + ", ".join(
                    f"{b}: {fmt(t[-1]['real_tau'])}/{fmt(t[-1]['simulated_tau'])}"
                    for b, t in trees.items()
                )
            )
        real_tps = rate(clock["real_tokens"], clock["real_s"])
        ar_tps = rate(clock["ar_tokens"], clock["ar_s"])
        ddtree = {str(b): totals(t) for b, t in trees.items()}
        chain = totals(details)
        return {
            "prompts": len(details),
            "equal": sum(d["equal"] for d in details),
            **chain,
            "rounds_checked": chain["rounds_checked"]
            + sum(t["rounds_checked"] for t in ddtree.values()),
            "rounds_equal": chain["rounds_equal"] + sum(t["rounds_equal"] for t in ddtree.values()),
            "ddtree": ddtree,
            "real_tokens_per_s": real_tps,
            "ar_tokens_per_s": ar_tps,
            "speedup": real_tps / ar_tps if real_tps and ar_tps else None,
            "details": details,
        }

    def _real_tree(self, drafter, ids: list[int], budget: int) -> list[int]:
        prompt = torch.tensor([ids], device=self.device)
        max_new = self.args.max_new_tokens
        return real_tree_generate(drafter, self.target, prompt, max_new, self.stops, budget)[1]

    def _timed_real(self, drafter, ids: list[int], clock: dict) -> tuple[list[int], list[int]]:
        """(round lengths, new tokens) of the real loop; both loops' times added to `clock`."""
        prompt = torch.tensor([ids], device=self.device)
        t0 = time.perf_counter()
        ar = greedy_continuation(self.target, ids, self.args.max_new_tokens, self.stops)
        sync_device(self.device)
        t1 = time.perf_counter()
        try:
            tokens, real = real_generate(
                drafter, self.target, prompt, self.args.max_new_tokens, self.stops
            )
        except ValueError as exc:
            raise EvalError(f"--check-real: {exc}") from None
        sync_device(self.device)
        clock["ar_s"] += t1 - t0
        clock["real_s"] += time.perf_counter() - t1
        clock["ar_tokens"] += len(ar)
        clock["real_tokens"] += len(tokens)
        return real, tokens


def sim_engine() -> dict:
    """The simulation's engine: its numbers come from torch and transformers."""
    return {
        "name": "sim",
        "version": f"transformers {transformers.__version__}, torch {torch.__version__}",
    }
