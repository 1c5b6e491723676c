"""The public benchmark sets the evaluator reads (workload/eval/prompts.py), fetched inside a
target from the Hugging Face hub by their names: the test split z-lab's benchmark
(`dflash.benchmark`) loads, as the hub ships it, so that a τ compares with the published ones.
The download is remote/hub_fetch.py's (fetch-model's): resumable, every file checked against
the hub's hashes."""

from __future__ import annotations

import posixpath
from typing import Any, NamedTuple

from dflashops import context
from dflashops.errors import OpsError, UsageError
from dflashops.runs.readiness import hub
from dflashops.targets.base import Machine


class PromptSet(NamedTuple):
    repo: str  # a hub dataset
    files: str  # the pattern of its files in the split z-lab's benchmark reads
    measures: str  # what its τ says


SETS: dict[str, PromptSet] = {
    "gsm8k": PromptSet("openai/gsm8k", "main/test-*", "grade-school math, step by step (1,319)"),
    "math500": PromptSet(
        "HuggingFaceH4/MATH-500", "test.jsonl", "competition math, long derivations (500)"
    ),  # fmt: skip
    "humaneval": PromptSet(
        "openai/openai_humaneval",
        "openai_humaneval/test-*",
        "Python functions from a docstring (164)",
    ),  # fmt: skip
    "mbpp": PromptSet(
        "google-research-datasets/mbpp",
        "sanitized/test-*",
        "short Python tasks from a sentence (257)",
    ),  # fmt: skip
    "mt-bench": PromptSet(
        "HuggingFaceH4/mt_bench_prompts",
        "data/train-*",
        "open chat in 8 categories, first turn (80)",
    ),  # fmt: skip
}


def check_sets(names: list[str]) -> None:
    unknown = [n for n in names if n not in SETS]
    if unknown:
        raise UsageError(f"no prompt set {', '.join(map(repr, unknown))}; the sets: "
                         f"{', '.join(SETS)}")  # fmt: skip


def fetch_set(machine: Machine, name: str, root: str, token: str | None) -> dict[str, Any]:
    """SET's files under ROOT/SET in `machine`; what came, with the file to give eval --prompts."""
    found = SETS[name]
    dest = posixpath.join(root, name)
    if not machine.dry_run:
        context.note(f"{machine.target.name}: downloading {name} ({found.repo}) to {dest}")
    done = hub.fetch(machine, hub.HubFetch(found.repo, dest, token=token, repo_type="dataset",
                                           files=(found.files,)))  # fmt: skip
    if machine.dry_run:
        return {"set": name, "repo": found.repo, "dest": dest}
    if done["bad"]:
        raise OpsError(f"{machine.target.name}: {name}: do not match the hub's hashes: "
                       f"{', '.join(done['bad'])}; run fetch-prompts again")  # fmt: skip
    prompts = posixpath.join(dest, sorted(done["names"])[0])
    return {"set": name, "repo": found.repo, "dest": dest, "prompts": prompts, **done}
