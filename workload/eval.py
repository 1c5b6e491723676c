"""Acceptance length (τ) of a DFlash drafter, by simulation from one target forward.

    python -m workload.eval --config RUN.yaml --checkpoint DIR [--prompts FILE]
        [--max-new-tokens N] [--reference DIR] [--budgets 8,16,32] --out FILE.json

Greedy speculative decoding is lossless: it emits the target's greedy continuation. So for each
prompt we decode that continuation once, run the target once over prompt + continuation for its
hidden states, and replay the rounds of z-lab's `dflash_generate`: at committed position
`start` the drafter sees the features of positions < start and the block [token at start,
MASK x K-1]; the accepted length is the number of leading draft argmaxes equal to the
continuation; the round commits accepted + 1 tokens (cut at the length limit and at a stop
token, as dflash_generate does). DDTree τ replays the same loop with the depth a tree of the
given budget reaches. `real_draft_and_verify` is the real loop, for tests and `--check-real`.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from workload.checkpoint import MANIFEST, read_manifest, verify, write_json_atomic
from workload.ddtree import label_ranks, tree_depth
from workload.model import dflash_setting, select_target_features

DEFAULT_BUDGETS = (8, 16, 32)


class EvalError(Exception):
    """A refusal the user can fix; printed as one line, exit status 2."""


# ----------------------------------------------------------------------------- model plumbing


def _output_head(target: torch.nn.Module) -> torch.nn.Module:
    head = getattr(target, "lm_head", None)
    return head if head is not None else target.get_output_embeddings()


def draft_logits(drafter: torch.nn.Module, hidden: Tensor, head: torch.nn.Module) -> Tensor:
    """The drafter's logits through the target's head (output multiplier and softcap honoured)."""
    if hasattr(drafter, "compute_logits"):
        return drafter.compute_logits(hidden, head)
    logits = head(hidden) * float(dflash_setting(drafter.config, "output_multiplier", 1.0))
    cap = dflash_setting(drafter.config, "final_logit_softcapping")
    if cap is not None and float(cap) > 0:
        logits = torch.tanh(logits / float(cap)) * float(cap)
    return logits


def _new_cache(config: Any):
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()
    return cache


def _crop(cache: Any, length: int) -> None:
    cache.crop(-(cache.get_seq_length() - length))


def _target_call(
    target: torch.nn.Module,
    ids: list[int] | Tensor,
    start: int,
    cache=None,
    hidden: bool = False,
    last_only: bool = False,
):
    """One target forward over `ids` placed at positions start.., optionally with a KV cache."""
    params = _target_params(target)
    device = target.get_input_embeddings().weight.device
    ids = torch.as_tensor(ids, device=device).view(1, -1)
    kwargs: dict[str, Any] = {
        "position_ids": torch.arange(start, start + ids.shape[1], device=device)[None],
        "output_hidden_states": hidden,
    }
    if cache is not None:
        kwargs["cache" if "cache" in params else "past_key_values"] = cache
        kwargs["use_cache"] = True
    else:
        kwargs["use_cache"] = False
    if last_only and "logits_to_keep" in params:
        kwargs["logits_to_keep"] = 1
    return target(ids, **kwargs)


def _target_params(target: torch.nn.Module) -> frozenset[str]:
    cached = getattr(target, "_dflash_eval_params", None)
    if cached is None:
        cached = frozenset(inspect.signature(target.forward).parameters)
        target._dflash_eval_params = cached
    return cached


# ----------------------------------------------------------------------------- drafting


class DraftSession:
    """Drafts blocks like dflash_generate: the drafter's KV cache holds context K/V of positions
    < start; each call feeds the context positions not yet cached plus the block, then crops
    the cache back to start (dropping the block's K/V)."""

    def __init__(self, drafter: torch.nn.Module, target: torch.nn.Module) -> None:
        self.drafter = drafter
        self.embed = target.get_input_embeddings().weight
        self.head = _output_head(target)
        self.scale = float(dflash_setting(drafter.config, "input_embedding_scale", 1.0))
        self.mask_id = int(drafter.mask_token_id)
        self.reset()

    def reset(self) -> None:
        self.cache = _new_cache(self.drafter.config)
        self.cached = 0  # context positions whose K/V the cache holds

    def draft(self, new_context: Tensor, token: int, start: int, size: int) -> Tensor:
        """Logits [size-1, V] of slots 1..size-1; new_context: features of cached..start-1."""
        if self.cached + new_context.shape[1] != start:
            raise ValueError(f"context covers {self.cached}+{new_context.shape[1]}, not {start}")
        device = self.embed.device
        ids = torch.tensor([[token] + [self.mask_id] * (size - 1)], device=device)
        noise = F.embedding(ids, self.embed) * self.scale
        positions = torch.arange(self.cached, start + size, device=device)[None]
        hidden = self.drafter(
            position_ids=positions,
            noise_embedding=noise,
            target_hidden=new_context,
            past_key_values=self.cache,
            use_cache=True,
        )[:, 1 - size :, :]
        _crop(self.cache, start)
        self.cached = start
        return draft_logits(self.drafter, hidden, self.head)[0]


@dataclass
class Draft:
    """What the simulations need of one drafted block."""

    argmax: list[int]  # [size-1]
    top_logprobs: list[list[float]]  # [size-1][top], descending
    top_ids: Tensor  # [size-1, top] on CPU

    @classmethod
    def from_logits(cls, logits: Tensor, top: int) -> Draft:
        logits = logits.float()
        values, ids = torch.log_softmax(logits, dim=-1).topk(min(top, logits.shape[-1]), dim=-1)
        return cls(logits.argmax(dim=-1).tolist(), values.tolist(), ids.cpu())


class DraftOracle:
    """Draft at any committed position of a known sequence, memoised by (start, size)."""

    def __init__(self, session: DraftSession, features: Tensor, seq: list[int], top: int) -> None:
        self.session, self.features, self.seq, self.top = session, features, seq, top
        self.memo: dict[tuple[int, int], Draft] = {}
        self.calls = 0

    def __call__(self, start: int, size: int) -> Draft:
        key = (start, size)
        if key not in self.memo:
            if self.session.cached > start:
                self.session.reset()
            context = self.features[:, self.session.cached : start]
            logits = self.session.draft(context, self.seq[start], start, size)
            self.memo[key] = Draft.from_logits(logits, self.top)
            self.calls += 1
        return self.memo[key]


# ----------------------------------------------------------------------------- simulation


class Round(NamedTuple):
    start: int  # committed position of the block's first token
    size: int  # block length (K, or less at the length limit)
    accepted: int  # draft tokens accepted (leading matches, or tree depth)
    produced: int  # tokens committed: accepted + 1, cut at the limit / a stop token


Accept = Callable[[Draft, list[int]], int]


def leading_matches(guesses: Sequence[int], labels: Sequence[int]) -> int:
    n = 0
    for guess, label in zip(guesses, labels, strict=False):
        if guess != label:
            break
        n += 1
    return n


def chain_accept(draft: Draft, labels: list[int]) -> int:
    return leading_matches(draft.argmax, labels)


def tree_accept(budget: int) -> Accept:
    def accept(draft: Draft, labels: list[int]) -> int:
        if not labels:
            return 0
        ranks = label_ranks(draft.top_ids[: len(labels)], torch.tensor(labels)).tolist()
        return tree_depth(draft.top_logprobs, ranks, len(labels), budget)

    return accept


def simulate(
    oracle: Callable[[int, int], Draft],
    seq: list[int],
    prompt_len: int,
    max_new_tokens: int,
    block_size: int,
    stop_ids: Sequence[int],
    accept: Accept,
) -> list[Round]:
    """Replay dflash_generate's rounds over seq = prompt + the target's greedy continuation."""
    stops = set(stop_ids)
    max_length = prompt_len + max_new_tokens
    start = prompt_len
    stopped = start < len(seq) and seq[start] in stops
    rounds = []
    while start + 1 < max_length and not stopped:
        size = min(block_size, max_length - start)
        labels = seq[start + 1 : start + size]
        accepted = accept(oracle(start, size), labels)
        produced = min(accepted + 1, max_length - start - 1)
        for i in range(produced):
            if seq[start + 1 + i] in stops:
                produced, stopped = i + 1, True
                break
        rounds.append(Round(start, size, accepted, produced))
        start += produced
    return rounds


# ----------------------------------------------------------------------------- target decoding


@torch.inference_mode()
def greedy_continuation(
    target: torch.nn.Module, prompt: list[int], max_new_tokens: int, stop_ids: Sequence[int]
) -> list[int]:
    """The target's greedy tokens after `prompt`: max_new_tokens, or through the first stop."""
    stops = set(stop_ids)
    cache = _new_cache(target.config)
    out = _target_call(target, prompt, 0, cache, last_only=True)
    new = [int(out.logits[0, -1].argmax())]
    while len(new) < max_new_tokens and new[-1] not in stops:
        out = _target_call(target, [new[-1]], len(prompt) + len(new) - 1, cache, last_only=True)
        new.append(int(out.logits[0, -1].argmax()))
    return new


@torch.inference_mode()
def target_hidden_states(target: torch.nn.Module, seq: list[int]) -> tuple[Tensor, ...]:
    return _target_call(target, seq, 0, hidden=True, last_only=True).hidden_states


@torch.inference_mode()
def real_generate(
    drafter: torch.nn.Module,
    target: torch.nn.Module,
    input_ids: Tensor,
    max_new_tokens: int,
    stop_ids: Sequence[int] | None,
) -> tuple[list[int], list[int]]:
    """Greedy draft-and-verify with KV caches: (new tokens, per-round lengths).

    Dense-attention targets only: rejected drafts are removed by cropping the target's cache,
    which cannot undo a hybrid (Gated DeltaNet) layer's recurrent state (ValueError)."""
    stops = set(stop_ids or ())
    tokens = [int(t) for t in input_ids.view(-1).tolist()]
    prompt_len = len(tokens)
    max_length = prompt_len + max_new_tokens
    block, layers = int(drafter.block_size), list(drafter.target_layer_ids)
    tcache, session = _new_cache(target.config), DraftSession(drafter, target)
    out = _target_call(target, tokens, 0, tcache, hidden=True, last_only=True)
    if not getattr(tcache, "is_croppable", True):
        raise ValueError(
            "the real draft-and-verify loop needs a target whose KV cache can be cropped; "
            "this one keeps recurrent (linear-attention) state that a crop cannot roll back"
        )
    tokens.append(int(out.logits[0, -1].argmax()))
    context = select_target_features(out.hidden_states, layers)
    start, lengths = prompt_len, []
    stopped = tokens[start] in stops
    while start + 1 < max_length and not stopped:
        size = min(block, max_length - start)
        guesses = session.draft(context, tokens[start], start, size).argmax(dim=-1).tolist()
        out = _target_call(target, [tokens[start], *guesses], start, tcache, hidden=True)
        posterior = out.logits[0].argmax(dim=-1).tolist()
        accepted = leading_matches(guesses, posterior)
        committed = [*guesses[:accepted], posterior[accepted]]
        produced = min(accepted + 1, max_length - start - 1)
        for i in range(produced):
            if committed[i] in stops:
                produced, stopped = i + 1, True
                break
        tokens.extend(committed[:produced])
        start += produced
        _crop(tcache, start)
        context = select_target_features(out.hidden_states, layers)[:, :produced]
        lengths.append(produced)
    return tokens[prompt_len:], lengths


def real_draft_and_verify(
    drafter: torch.nn.Module,
    target: torch.nn.Module,
    input_ids: Tensor,
    max_new_tokens: int,
    stop_ids: Sequence[int] | None,
) -> list[int]:
    """Per-round acceptance lengths (accepted + 1, as dflash_generate's acceptance_lengths)."""
    return real_generate(drafter, target, input_ids, max_new_tokens, stop_ids)[1]


# ----------------------------------------------------------------------------- one prompt


@dataclass
class PromptResult:
    chain: list[Round]
    trees: dict[int, list[Round]] = field(default_factory=dict)
    draft_s: float = 0.0


def evaluate_drafter(
    drafter: torch.nn.Module,
    target: torch.nn.Module,
    hidden_states: Sequence[Tensor],
    seq: list[int],
    prompt_len: int,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    budgets: Sequence[int],
) -> PromptResult:
    """Chain rounds and DDTree rounds per budget for one prompt's known continuation."""
    t0 = time.perf_counter()
    features = select_target_features(hidden_states, drafter.target_layer_ids)
    top = max([1, *budgets])
    oracle = DraftOracle(DraftSession(drafter, target), features, seq, top)
    block = int(drafter.block_size)
    with torch.inference_mode():
        result = PromptResult(
            simulate(oracle, seq, prompt_len, max_new_tokens, block, stop_ids, chain_accept)
        )
        for b in budgets:
            result.trees[b] = simulate(
                oracle, seq, prompt_len, max_new_tokens, block, stop_ids, tree_accept(b)
            )
    _sync(features.device)
    result.draft_s = time.perf_counter() - t0
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    )


def read_prompts(path: Path) -> list[dict]:
    """JSONL lines {"messages": [...]} or {"prompt": "text"} (optional chat_template_kwargs)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise EvalError(f"{path}: cannot read prompts: {exc.strerror}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EvalError(f"{where}: not valid JSON ({exc.msg})") from None
        prompts.append(_check_prompt(item, where))
    if not prompts:
        raise EvalError(f"{path}: no prompts in the file")
    return prompts


def _check_prompt(item: Any, where: str) -> dict:
    expected = "expected an object with 'messages' (a list of {role, content}) or 'prompt' (text)"
    if not isinstance(item, dict):
        raise EvalError(f"{where}: {expected}")
    messages, text = item.get("messages"), item.get("prompt")
    if isinstance(messages, list) and messages:
        if not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise EvalError(f"{where}: every message needs 'role' and 'content'")
    elif not (isinstance(text, str) and text):
        raise EvalError(f"{where}: {expected}")
    kwargs = item.get("chat_template_kwargs", {})
    if not isinstance(kwargs, dict):
        raise EvalError(f"{where}: chat_template_kwargs must be an object")
    return {**item, "where": where}


def render_prompt(tokenizer: Any, item: dict, chat_template: str | None) -> list[int]:
    if "messages" in item and item["messages"]:
        text = tokenizer.apply_chat_template(
            item["messages"],
            tokenize=False,
            add_generation_prompt=True,
            chat_template=chat_template,
            **item.get("chat_template_kwargs", {}),
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(item["prompt"])["input_ids"]
    if not ids:
        raise EvalError(f"{item['where']}: the prompt renders to no tokens")
    return list(ids)


def stop_token_ids(target: torch.nn.Module, tokenizer: Any) -> list[int]:
    """The generation config's eos ids, else the tokenizer's eos (z-lab's benchmark rule)."""
    gen = getattr(target, "generation_config", None)
    ids = getattr(gen, "eos_token_id", None) or tokenizer.eos_token_id
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


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
    from workload.model import DFlashDrafter

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
        "--prompts", type=Path, help="JSONL prompts (default: prompts.jsonl beside data)"
    )
    p.add_argument("--max-new-tokens", type=int, default=2048)
    p.add_argument("--max-prompts", type=int, default=None, help="evaluate only the first N")
    p.add_argument("--reference", type=Path, help="a reference drafter directory (e.g. z-lab's)")
    p.add_argument("--budgets", default=",".join(map(str, DEFAULT_BUDGETS)))
    p.add_argument("--out", required=True, type=Path, help="where to write the result JSON")
    p.add_argument("--allow-incomplete", action="store_true", help="accept a missing manifest")
    p.add_argument(
        "--check-real",
        type=int,
        default=0,
        metavar="N",
        help="also run the real draft-and-verify loop on the first N prompts",
    )
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
        budgets = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise EvalError(
            f"--budgets {text}: expected comma-separated integers, e.g. 8,16,32"
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
    drafter: torch.nn.Module
    results: list[PromptResult] = field(default_factory=list)


def _prompts_path(args: argparse.Namespace, settings: RunSettings) -> Path:
    if args.prompts is not None:
        return args.prompts
    if settings.data_path is None:
        raise EvalError(f"{args.config}: data.path is unset; pass --prompts FILE")
    return settings.data_path.parent / "prompts.jsonl"


class Evaluation:
    """One command's state: the target, its tokenizer, the drafters, the running timings."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.t_start = time.perf_counter()
        self.args = args
        self.budgets = _budgets(args.budgets)
        if args.max_new_tokens < 1:
            raise EvalError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
        settings = load_run_settings(args.config, args.overrides)
        self.prompts_path = _prompts_path(args, settings)
        self.prompts = read_prompts(self.prompts_path)[: args.max_prompts]
        check_manifest(args.checkpoint, required=not args.allow_incomplete)
        if args.reference is not None:
            check_manifest(args.reference, required=False)  # z-lab's drafters have none
        self.device = _device(args.device)
        self.target, self.tokenizer = _load_target(settings, self.device)
        self.template = _chat_template(settings.chat_template)
        self.stops = stop_token_ids(self.target, self.tokenizer)
        named = [("checkpoint", args.checkpoint), ("reference", args.reference)]
        dtype = self.target.get_input_embeddings().weight.dtype
        self.subjects = [
            Subject(name, path, load_drafter(path, dtype=dtype, device=self.device))
            for name, path in named
            if path is not None
        ]
        self.timing = {"load_s": time.perf_counter() - self.t_start}
        self.timing.update(generate_s=0.0, forward_s=0.0, draft_s=0.0)

    def run(self) -> dict:
        say(
            f"eval: {len(self.prompts)} prompts from {self.prompts_path}, max "
            f"{self.args.max_new_tokens} new tokens, budgets {self.budgets}, on {self.device} "
            f"({self.timing['load_s']:.1f}s to load)"
        )
        records = []
        for i, item in enumerate(self.prompts):
            records.append({"index": i, **self.prompt(item)})
            self.progress(i, records[-1])
        result = self.assemble(records)
        if self.args.check_real:
            result["check_real"] = self.check_real(self.prompts[: self.args.check_real])
        self.timing["total_s"] = time.perf_counter() - self.t_start
        result["timing"] = {k: round(v, 3) for k, v in self.timing.items()}
        return result

    def prompt(self, item: dict) -> dict:
        """Decode the continuation, one forward, then simulate every drafter on it."""
        prompt = render_prompt(self.tokenizer, item, self.template)
        t0 = time.perf_counter()
        new = greedy_continuation(self.target, prompt, self.args.max_new_tokens, self.stops)
        _sync(self.device)
        t1 = time.perf_counter()
        hidden_states = target_hidden_states(self.target, prompt + new)
        _sync(self.device)
        self.timing["generate_s"] += t1 - t0
        self.timing["forward_s"] += time.perf_counter() - t1
        record = {
            "where": item["where"],
            "prompt_tokens": len(prompt),
            "new_tokens": len(new),
            "stopped": new[-1] in set(self.stops),
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
            **summarize(s.results, int(s.drafter.block_size), self.budgets),
            "n_prompts": len(s.results),
            "max_new_tokens": self.args.max_new_tokens,
            "checkpoint": str(s.path.resolve()),
        }

    def assemble(self, records: list[dict]) -> dict:
        result = self.summary(self.subjects[0])
        result["budgets"] = self.budgets
        result["prompts_file"] = str(self.prompts_path.resolve())
        result["prompts"] = records
        if len(self.subjects) > 1:
            result["reference"] = self.summary(self.subjects[1])
        return result

    def check_real(self, items: list[dict]) -> dict:
        """The real draft-and-verify loop on a few prompts, against the simulated rounds."""
        subject, details = self.subjects[0], []
        for i, item in enumerate(items):
            ids = render_prompt(self.tokenizer, item, self.template)
            prompt = torch.tensor([ids], device=self.device)
            try:
                real = real_draft_and_verify(
                    subject.drafter, self.target, prompt, self.args.max_new_tokens, self.stops
                )
            except ValueError as exc:
                raise EvalError(f"--check-real: {exc}") from None
            simulated = [x.produced for x in subject.results[i].chain]
            real_tau, sim_tau = _tau_of(real), _tau_of(simulated)
            equal = real == simulated
            details.append(
                {"index": i, "real_tau": real_tau, "simulated_tau": sim_tau, "equal": equal}
            )
            say(
                f"check-real {i + 1}/{len(items)}: real tau {_fmt(real_tau)}, simulated "
                f"{_fmt(sim_tau)}, rounds equal: {equal}"
            )
        return {
            "prompts": len(details),
            "equal": sum(d["equal"] for d in details),
            "details": details,
        }


def run(args: argparse.Namespace) -> dict:
    return Evaluation(args).run()


def _load_target(settings: RunSettings, device: torch.device):
    from workload.targets import load_target

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
    from workload.data import DataError, resolve_chat_template

    try:
        return resolve_chat_template(template)
    except DataError as exc:
        raise EvalError(str(exc)) from None


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


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
    except KeyboardInterrupt:
        print("eval: interrupted", file=sys.stderr)
        return 130
    say(
        f"eval: tau {_fmt(result['tau'])}, ddtree "
        + ", ".join(f"{b}: {_fmt(t)}" for b, t in result["ddtree"].items())
        + (f"; reference tau {_fmt(result['reference']['tau'])}" if "reference" in result else "")
        + f" -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
