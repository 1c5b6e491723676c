"""The command-line options of every program that measures a checkpoint against its run
(`workload.eval`, `workload.serve_bench`): one definition, each program adding its own."""

from __future__ import annotations

import argparse
from pathlib import Path


def subject_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser with the shared options: the run, the checkpoint, the prompts and how they
    render, the vLLM environment, parity's --force and where the result goes."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", required=True, type=Path, help="the run config (YAML)")
    p.add_argument("--checkpoint", required=True, type=Path, help="a drafter checkpoint directory")
    p.add_argument(
        "--prompts",
        type=Path,
        help="prompts: ours (JSONL) or GSM8K, MATH-500, HumanEval, MBPP, MT-Bench files, JSONL "
        "or parquet (default: prompts.jsonl beside data)",
    )
    p.add_argument("--max-new-tokens", type=int, default=2048)
    p.add_argument("--max-prompts", type=int, default=None, help="only the first N prompts")
    p.add_argument(
        "--chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="chat template kwargs, e.g. '{\"enable_thinking\": false}' "
        "(default: the run's data.chat_template_kwargs)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a run-config key, e.g. --set target.path=/models/x",
    )
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
        help="a vLLM engine or server argument, e.g. gpu_memory_utilization=0.85",
    )
    p.add_argument("--force", action="store_true",
                   help="despite train-to-serve parity mismatches or prompts found in the "
                   "training data")  # fmt: skip
    p.add_argument("--out", required=True, type=Path, help="where to write the result JSON")
    return p
