"""Acceptance length (τ) of a DFlash drafter: simulated from one target forward, or in vLLM.

    python -m workload.eval --config RUN.yaml --checkpoint DIR [--prompts FILE]
        [--max-new-tokens N] [--max-prompts N] [--reference DIR] [--budgets 8,16,32]
        [--chat-template-kwargs JSON] [--engine sim|vllm] [--vllm-python PATH]
        [--vllm-arg KEY=VALUE]... [--engine-timeout S] [--check-real N] --out FILE.json

`--engine sim` (the default): each prompt's greedy continuation is decoded by the target
(Hugging Face, one token a forward), the target runs once over prompt + continuation, and the
drafter's rounds are replayed on it (workload/eval/decode.py: the simulation equals z-lab's
dflash_generate round for round). `--check-real N` also runs the real draft-and-verify loops on
the first N prompts against the simulated rounds.

`--engine vllm` (workload/eval/vllm_offline.py): the checkpoint is served by vLLM as the target's DFlash
speculator, all prompts in one batch, greedy; the same prompts go through the target alone too.
`tau`, `per_position` and `histogram` come from vLLM's per-step accepted counts (cut at the stop
token and the length limit); `ddtree` from the simulation, run on vLLM's plain greedy output.
The engines run in a child process of `--vllm-python` (else $DFLASHOPS_VLLM_PYTHON, else this
python if it has vllm), `python -m workload.eval.vllm_engine`, which has exited before the
simulation loads the target: one accelerator holds one of them at a time, and the simulation
runs on the workload's own stack (its transformers, fla), as `--engine sim` does.
`--vllm-arg KEY=VALUE` passes an engine argument (VALUE as JSON where it parses), e.g.
gpu_memory_utilization=0.85, tensor_parallel_size=2, enforce_eager=false (eager is the default
on CPU only); `--engine-timeout` bounds the engines' process (default 10800 s).

Prompts (workload/eval/prompts.py): our JSONL ({"messages": [...]} or {"prompt": text}), or GSM8K,
MATH-500, HumanEval, MBPP and MT-Bench (first turn) files as JSONL or parquet. They are rendered
with the chat template and `--chat-template-kwargs JSON` (else the run's
data.chat_template_kwargs, else {}), each record's own kwargs over those.

The result (CONTRACTS §6): tau, ddtree, per_position, histogram, n_prompts, max_new_tokens,
checkpoint, reference; engine {name, version}; fingerprint (workload/eval/fingerprint.py) and
checkpoint_sha256; prompt_set {name, kind, format, path, n_prompts}. With vLLM also
engine_mean_acceptance_length, tokens_per_s {spec, plain}, speedup, greedy (the speculative
output against the plain engine's, per prompt) and simulation (the simulated chain's figures,
on how many prompts vLLM's rounds equal the simulated ones, and the first difference).
Exit status: 0 done, 1 the engine failed, 2 bad input, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workload.common.jsonfile import write_json_atomic
from workload.common.layout import MANIFEST
from workload.drafter.checkpoint import read_manifest, verify
from workload.eval.decode import (
    PromptResult,
    Round,
    evaluate_drafter,
    greedy_continuation,
    real_generate,
    real_tree_generate,
    sync_device,
    target_hidden_states,
)
from workload.eval.fingerprint import (
    checkpoint_sha256,
    fingerprint,
    target_identity,
    template_sha256,
)
from workload.eval.prompts import PromptsError, PromptSet, prompts_sha256, read_prompt_set, render

OFFICIAL_BUDGETS = (16, 32, 64)  # the smallest of the official DDTree benchmark's budgets
TRAINING_BUDGET = 8  # training's dds8, for a side-by-side
DEFAULT_BUDGETS = (TRAINING_BUDGET, *OFFICIAL_BUDGETS)


class EvalError(Exception):
    """A refusal the user can fix; printed as one line, exit status 2."""


class EngineError(Exception):
    """The serving engine failed (not the input); printed as one line, exit status 1."""


# ----------------------------------------------------------------------------- summaries


def _tau(rounds: list[Round]) -> float | None:
    return float(statistics.mean(r.produced for r in rounds)) if rounds else None


def _mean_over_prompts(per_prompt: list[list[Round]]) -> float | None:
    taus = [t for t in map(_tau, per_prompt) if t is not None]
    return float(statistics.mean(taus)) if taus else None


def summarize(results: list[PromptResult], block_size: int, budgets: Sequence[int]) -> dict:
    """Contract keys: tau, ddtree, per_position, histogram (rounds by accepted + 1, 0..K)."""
    chain = [r.chain for r in results]
    rounds = [x for rs in chain for x in rs]
    histogram = [0] * (block_size + 1)
    for x in rounds:
        histogram[x.produced] += 1
    per_position = []
    for k in range(1, block_size):
        drafted = [x for x in rounds if x.size > k]
        hits = sum(x.accepted >= k for x in drafted)
        per_position.append(hits / len(drafted) if drafted else None)
    return {
        "tau": _mean_over_prompts(chain),
        "ddtree": {str(b): _mean_over_prompts([r.trees[b] for r in results]) for b in budgets},
        "per_position": per_position,
        "histogram": histogram,
        "rounds": len(rounds),
        "block_size": block_size,
    }


def prompt_record(result: PromptResult) -> dict:
    return {
        "tau": _tau(result.chain),
        "rounds": [x.produced for x in result.chain],
        "accepted": [x.accepted for x in result.chain],
        "ddtree": {
            str(b): {"tau": _tau(rs), "rounds": [x.produced for x in rs]}
            for b, rs in result.trees.items()
        },
        "draft_s": round(result.draft_s, 4),
    }


# ----------------------------------------------------------------------------- inputs


@dataclass
class RunSettings:
    target_path: Path
    dtype: str
    attn_implementation: str
    chat_template: str | None
    data_path: Path | None
    chat_template_kwargs: dict = field(default_factory=dict)


def _resolve(path: str | None, base: Path) -> Path | None:
    if path is None:
        return None
    p = Path(path).expanduser()
    if not p.is_absolute() and (base / p).exists():
        return base / p
    return p


def load_run_settings(config_path: Path, overrides: Sequence[str] = ()) -> RunSettings:
    from workload.config import ConfigError, load_config

    if not config_path.is_file():
        raise EvalError(f"{config_path}: no such config file")
    try:
        cfg = load_config(config_path, overrides)
    except ConfigError as exc:
        raise EvalError(str(exc)) from None
    base = config_path.resolve().parent
    template = cfg.data.chat_template
    if template is not None and "{" not in template:
        template = str(_resolve(template, base))
    return RunSettings(
        target_path=_resolve(cfg.target.path, base),
        dtype=cfg.target.dtype,
        attn_implementation=cfg.target.attn_implementation,
        chat_template=template,
        data_path=_resolve(cfg.data.path, base),
        chat_template_kwargs=_config_kwargs(cfg, config_path),
    )


def _config_kwargs(cfg: Any, config_path: Path) -> dict:
    """data.chat_template_kwargs of the run config (read from the YAML where the config object
    has no such field), {} when unset."""
    if hasattr(cfg.data, "chat_template_kwargs"):
        kwargs = cfg.data.chat_template_kwargs
    else:
        import yaml

        try:
            raw = yaml.safe_load(config_path.read_text()) or {}
        except (OSError, yaml.YAMLError):
            raw = {}
        data = raw.get("data") if isinstance(raw, dict) else None
        kwargs = data.get("chat_template_kwargs") if isinstance(data, dict) else None
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise EvalError(f"{config_path}: data.chat_template_kwargs: expected a mapping")
    return dict(kwargs)


def chat_template_kwargs(text: str | None, settings: RunSettings) -> dict:
    """--chat-template-kwargs JSON, else the run's data.chat_template_kwargs, else {}."""
    if text is None:
        return settings.chat_template_kwargs
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EvalError(f"--chat-template-kwargs {text}: not valid JSON ({exc.msg})") from None
    if not isinstance(kwargs, dict):
        raise EvalError(
            f"--chat-template-kwargs {text}: expected a JSON object, e.g. "
            "'{\"enable_thinking\": false}'"
        )
    return kwargs


def read_prompts(path: Path) -> list[dict]:
    """The prompts of `path` (workload/eval/prompts.py: ours or a benchmark's, JSONL or parquet)."""
    return read_prompt_set(path).items


def _read_prompt_set(path: Path) -> PromptSet:
    try:
        return read_prompt_set(path)
    except PromptsError as exc:
        raise EvalError(str(exc)) from None


def render_prompt(
    tokenizer: Any, item: dict, chat_template: str | None, kwargs: dict | None = None
) -> list[int]:
    ids = render(tokenizer, item, chat_template, kwargs or {})
    if not ids:
        raise EvalError(f"{item['where']}: the prompt renders to no tokens")
    return ids


def stop_token_ids(target: torch.nn.Module, tokenizer: Any) -> list[int]:
    """The generation config's eos ids, else the tokenizer's eos (z-lab's benchmark rule)."""
    return stop_ids_of(getattr(target, "generation_config", None), tokenizer)


def stop_ids_of(generation_config: Any, tokenizer: Any) -> list[int]:
    ids = getattr(generation_config, "eos_token_id", None) or tokenizer.eos_token_id
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


def _generation_config(path: Path) -> Any:
    """The target's generation config as transformers gives a loaded model one: its
    generation_config.json, else one made from its config.json."""
    from transformers import AutoConfig, GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        pass
    try:
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(path))
    except (OSError, ValueError):
        return None


def check_manifest(directory: Path, *, required: bool) -> None:
    """Refuse a checkpoint whose MANIFEST.sha256 is missing (if required) or does not match."""
    if not directory.is_dir():
        raise EvalError(f"{directory}: no such checkpoint directory")
    manifest = directory / MANIFEST
    if not manifest.exists():
        if required:
            raise EvalError(
                f"{manifest}: missing, the checkpoint is incomplete "
                "(pass --allow-incomplete to evaluate it anyway)"
            )
        return
    if read_manifest(directory) is None:
        raise EvalError(f"{manifest}: malformed (expected sha256sum lines)")
    if not verify(directory, hashes=True):
        raise EvalError(f"{manifest}: does not match the files beside it (partial or changed copy)")


def load_drafter(directory: Path, *, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """Our DFlashDrafter (parameter-compatible with z-lab's published drafters)."""
    from workload.drafter.model import DFlashDrafter

    if not (directory / "config.json").is_file():
        raise EvalError(f"{directory / 'config.json'}: missing (not a drafter directory)")
    try:
        model = DFlashDrafter.from_pretrained(directory, dtype=dtype, local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EvalError(f"{directory}: cannot load the drafter: {first}") from None
    if model.mask_token_id is None:
        raise EvalError(f"{directory / 'config.json'}: dflash_config has no mask_token_id")
    return model.to(device).eval().requires_grad_(False)


# ----------------------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m workload.eval", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, type=Path, help="the run config (YAML)")
    p.add_argument("--checkpoint", required=True, type=Path, help="a drafter checkpoint directory")
    p.add_argument(
        "--prompts",
        type=Path,
        help="prompts: ours (JSONL) or GSM8K, MATH-500, HumanEval, MBPP, MT-Bench files, JSONL "
        "or parquet (default: prompts.jsonl beside data)",
    )
    p.add_argument("--max-new-tokens", type=int, default=2048)
    p.add_argument("--max-prompts", type=int, default=None, help="evaluate only the first N")
    p.add_argument("--reference", type=Path, help="a reference drafter directory (e.g. z-lab's)")
    p.add_argument(
        "--budgets",
        default="",
        help="DDTree budgets (nodes besides the root) to add to "
        + ",".join(map(str, DEFAULT_BUDGETS)),
    )
    p.add_argument("--out", required=True, type=Path, help="where to write the result JSON")
    p.add_argument("--allow-incomplete", action="store_true", help="accept a missing manifest")
    p.add_argument(
        "--force", action="store_true", help="evaluate despite train-to-serve parity mismatches"
    )
    p.add_argument(
        "--check-real",
        type=int,
        default=0,
        metavar="N",
        help="also run the real draft-and-verify loop on the first N prompts",
    )
    p.add_argument(
        "--chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="chat template kwargs, e.g. '{\"enable_thinking\": false}' "
        "(default: the run's data.chat_template_kwargs)",
    )
    p.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    p.add_argument(
        "--vllm-python",
        default=None,
        metavar="PATH",
        help="the python of a vLLM environment (default: $DFLASHOPS_VLLM_PYTHON, else this one)",
    )
    p.add_argument(
        "--vllm-arg",
        dest="vllm_args",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a vLLM engine argument, e.g. gpu_memory_utilization=0.85",
    )
    p.add_argument("--engine-timeout", type=float, default=10800.0, metavar="S")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:i]")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a run-config key, e.g. --set target.path=/models/x",
    )
    return p.parse_args(argv)


def _budgets(text: str) -> list[int]:
    try:
        budgets = sorted({*DEFAULT_BUDGETS, *(int(x) for x in text.split(",") if x.strip())})
    except ValueError:
        raise EvalError(
            f"--budgets {text}: expected comma-separated integers, e.g. 128,256"
        ) from None
    if any(b < 1 for b in budgets):
        raise EvalError(f"--budgets {text}: budgets must be >= 1")
    return budgets


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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


def drafter_block_size(directory: Path) -> int:
    """dflash_config.block_size of a drafter directory (read before any model loads)."""
    where = directory / "config.json"
    try:
        config = json.loads(where.read_text())
        return int((config.get("dflash_config") or {}).get("block_size") or config["block_size"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise EvalError(f"{where}: no dflash_config.block_size (not a drafter directory)") from None


def _prompts_path(args: argparse.Namespace, settings: RunSettings) -> Path:
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
        from transformers import AutoTokenizer

        self.t_start = time.perf_counter()
        self.args = args
        self.budgets = _budgets(args.budgets)
        if args.max_new_tokens < 1:
            raise EvalError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
        self.settings = load_run_settings(args.config, args.overrides)
        self.kwargs = chat_template_kwargs(args.chat_template_kwargs, self.settings)
        self.prompts_path = _prompts_path(args, self.settings)
        self.prompt_set = _read_prompt_set(self.prompts_path).head(args.max_prompts)
        self.prompts = self.prompt_set.items
        check_manifest(args.checkpoint, required=not args.allow_incomplete)
        if args.reference is not None:
            check_manifest(args.reference, required=False)  # z-lab's drafters have none
        named = [("checkpoint", args.checkpoint), ("reference", args.reference)]
        self.subjects = [Subject(name, path) for name, path in named if path is not None]
        self.device = _device(args.device)
        self.target = None
        target_path = self.settings.target_path
        if not (target_path / "config.json").is_file():
            raise EvalError(f"target.path {target_path}: no config.json (not a model directory)")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(target_path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise EvalError(f"target.path {target_path}: {str(exc).splitlines()[0]}") from None
        self.template = _chat_template(self.settings.chat_template)
        self.stops = stop_ids_of(_generation_config(target_path), self.tokenizer)
        self.ids = [
            render_prompt(self.tokenizer, item, self.template, self.kwargs) for item in self.prompts
        ]
        self.timing = {"load_s": time.perf_counter() - self.t_start}
        self.timing.update(generate_s=0.0, forward_s=0.0, draft_s=0.0)

    def load_models(self) -> None:
        t0 = time.perf_counter()
        self.target, _ = _load_target(self.settings, self.device)
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
            running = _mean_over_prompts([r.chain for r in s.results])
            parts.append(f"{s.name} tau {_fmt(record[s.name]['tau'])} (running {_fmt(running)})")
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
                {"index": i, **_compare(real, subject.results[i].chain), "new_tokens": len(tokens)}
            )
            for b in self.budgets:
                trees[b].append(_compare(self._real_tree(subject.drafter, ids, b),
                                         subject.results[i].trees[b]))  # fmt: skip
            d = details[-1]
            say(
                f"check-real {i + 1}/{len(items)}: real tau {_fmt(d['real_tau'])}, simulated "
                f"{_fmt(d['simulated_tau'])}, rounds equal: {d['equal']} "
                f"({d['rounds_equal']}/{d['rounds']}); ddtree real/simulated "
                + ", ".join(
                    f"{b}: {_fmt(t[-1]['real_tau'])}/{_fmt(t[-1]['simulated_tau'])}"
                    for b, t in trees.items()
                )
            )
        real_tps = _rate(clock["real_tokens"], clock["real_s"])
        ar_tps = _rate(clock["ar_tokens"], clock["ar_s"])
        ddtree = {str(b): _totals(t) for b, t in trees.items()}
        chain = _totals(details)
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


def run(args: argparse.Namespace) -> dict:
    evaluation = Evaluation(args)  # the inputs checked first
    checked = parity_check(args)
    if args.engine == "vllm":
        from workload.eval.vllm_offline import run_vllm

        result = run_vllm(evaluation)
    else:
        result = evaluation.run()
    return {**result, "parity": checked}


def parity_check(args: argparse.Namespace) -> dict:
    """Train-to-serve parity before anything loads (workload/eval/parity.py): each mismatch is
    a refusal line, unless --force (then recorded in the result)."""
    from workload.eval.parity import ParityError, before_eval

    vllm = None
    if args.engine == "vllm":
        from workload.eval.vllm_offline import vllm_python

        vllm = vllm_python(args.vllm_python)
    try:
        lines = before_eval(args.config, args.checkpoint, args.chat_template_kwargs,
                            args.overrides, vllm)  # fmt: skip
    except ParityError as exc:
        raise EvalError(f"parity: {exc}") from None
    if lines and not args.force:
        raise EvalError(
            "\neval: error: ".join(f"parity: {line}" for line in lines)
            + "\neval: error: (--force evaluates anyway, the mismatches recorded in the result)"
        )
    return {"mismatches": lines, "forced": bool(lines)}


def sim_engine() -> dict:
    """The simulation's engine: its numbers come from torch and transformers."""
    import transformers

    return {
        "name": "sim",
        "version": f"transformers {transformers.__version__}, torch {torch.__version__}",
    }


def _load_target(settings: RunSettings, device: torch.device):
    from workload.drafter.targets import load_target

    try:
        return load_target(
            settings.target_path,
            dtype=settings.dtype,
            device=device,
            attn_implementation=settings.attn_implementation,
        )
    except (OSError, ValueError) as exc:
        raise EvalError(f"target.path {settings.target_path}: {str(exc).splitlines()[0]}") from None


def _chat_template(template: str | None) -> str | None:
    from workload.data.chat import DataError, resolve_chat_template

    try:
        return resolve_chat_template(template)
    except DataError as exc:
        raise EvalError(str(exc)) from None


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _compare(real: list[int], simulated: list[Round]) -> dict:
    """One prompt's real rounds (accepted + 1 each) against the simulated ones."""
    sim = [x.produced for x in simulated]
    return {
        "real_tau": _tau_of(real),
        "simulated_tau": _tau_of(sim),
        "equal": real == sim,
        "rounds": len(real),
        "rounds_equal": sum(a == b for a, b in zip(real, sim, strict=False)),
    }


def _totals(compared: list[dict]) -> dict:
    """Mean taus over prompts and round counts of `_compare` results."""
    taus = {k: [c[k] for c in compared if c[k] is not None] for k in ("real_tau", "simulated_tau")}
    return {
        **{k: statistics.mean(v) if v else None for k, v in taus.items()},
        "rounds_checked": sum(c["rounds"] for c in compared),
        "rounds_equal": sum(c["rounds_equal"] for c in compared),
    }


def _rate(count: int, seconds: float) -> float | None:
    return count / seconds if seconds > 0 else None


def _tau_of(lengths: list[int]) -> float | None:
    return float(statistics.mean(lengths)) if lengths else None


def _quiet_transformers() -> None:
    """No weight-loading progress bars: stderr carries our progress lines only."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _quiet_transformers()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        result = run(args)
        write_json_atomic(args.out, result)
    except EvalError as exc:
        print(f"eval: error: {exc}", file=sys.stderr)
        return 2
    except EngineError as exc:
        print(f"eval: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("eval: interrupted", file=sys.stderr)
        return 130
    say(
        f"eval: tau {_fmt(result['tau'])}, ddtree "
        + ", ".join(f"{b}: {_fmt(t)}" for b, t in result["ddtree"].items())
        + (f"; reference tau {_fmt(result['reference']['tau'])}" if "reference" in result else "")
        + _real_summary(result.get("check_real"))
        + _engine_summary(result)
        + f" -> {args.out}"
    )
    return 0


def _engine_summary(result: dict) -> str:
    if result["engine"]["name"] != "vllm":
        return ""
    sim, greedy = result["simulation"], result["greedy"]
    return (
        f"; vllm {result['engine']['version']}: simulated tau {_fmt(sim['tau'])}, rounds as "
        f"simulated on {sim['prompts_identical']}/{sim['prompts']} prompts, output equals "
        f"greedy on {greedy['equal']}/{greedy['prompts']}, {_fmt(result['tokens_per_s']['spec'])} "
        f"tokens/s vs {_fmt(result['tokens_per_s']['plain'])} plain"
    )


def _real_summary(check: dict | None) -> str:
    if not check:
        return ""
    return (
        f"; real loop: {check['rounds_equal']}/{check['rounds_checked']} rounds as simulated, "
        f"{_fmt(check['real_tokens_per_s'])} tokens/s vs {_fmt(check['ar_tokens_per_s'])} "
        "autoregressive"
    )
