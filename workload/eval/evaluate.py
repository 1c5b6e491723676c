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
SIGTERM and SIGHUP interrupt as Ctrl-C does (the vLLM engines started are ended first).
Exit status: 0 done, 1 the engine failed, 2 bad input, 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers.utils import logging

from workload.common.jsonfile import write_json_atomic
from workload.eval.arguments import subject_parser
from workload.eval.errors import EngineError, EvalError
from workload.eval.evaluation import DEFAULT_BUDGETS, Evaluation
from workload.eval.inputs import parity_check
from workload.eval.summary import fmt, say
from workload.eval.vllm_offline import run_vllm


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = subject_parser("python -m workload.eval", __doc__.split("\n")[0])
    p.add_argument("--reference", type=Path, help="a reference drafter directory (e.g. z-lab's)")
    p.add_argument(
        "--budgets",
        default="",
        help="DDTree budgets (nodes besides the root) to add to "
        + ",".join(map(str, DEFAULT_BUDGETS)),
    )
    p.add_argument("--allow-incomplete", action="store_true", help="accept a missing manifest")
    p.add_argument(
        "--check-real",
        type=int,
        default=0,
        metavar="N",
        help="also run the real draft-and-verify loop on the first N prompts",
    )
    p.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    p.add_argument("--engine-timeout", type=float, default=10800.0, metavar="S")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:i]")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    evaluation = Evaluation(args)  # the inputs checked first
    checked = parity_check(args)
    result = run_vllm(evaluation) if args.engine == "vllm" else evaluation.run()
    return {**result, "parity": checked}


def _quiet_transformers() -> None:
    """No weight-loading progress bars: stderr carries our progress lines only."""
    logging.disable_progress_bar()


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for sig in (signal.SIGTERM, signal.SIGHUP):  # as Ctrl-C: the engines started are ended
        signal.signal(sig, _interrupt)
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
        f"eval: tau {fmt(result['tau'])}, ddtree "
        + ", ".join(f"{b}: {fmt(t)}" for b, t in result["ddtree"].items())
        + (f"; reference tau {fmt(result['reference']['tau'])}" if "reference" in result else "")
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
        f"; vllm {result['engine']['version']}: simulated tau {fmt(sim['tau'])}, rounds as "
        f"simulated on {sim['prompts_identical']}/{sim['prompts']} prompts, output equals "
        f"greedy on {greedy['equal']}/{greedy['prompts']}, {fmt(result['tokens_per_s']['spec'])} "
        f"tokens/s vs {fmt(result['tokens_per_s']['plain'])} plain"
    )


def _real_summary(check: dict | None) -> str:
    if not check:
        return ""
    return (
        f"; real loop: {check['rounds_equal']}/{check['rounds_checked']} rounds as simulated, "
        f"{fmt(check['real_tokens_per_s'])} tokens/s vs {fmt(check['ar_tokens_per_s'])} "
        "autoregressive"
    )
