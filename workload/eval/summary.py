"""An evaluation's figures from its rounds: τ (chain and DDTree), per-position acceptance, the
histogram (CONTRACTS §6), real rounds against simulated ones, and the progress lines."""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence

from workload.eval.decode import PromptResult, Round


def tau(rounds: list[Round]) -> float | None:
    return float(statistics.mean(r.produced for r in rounds)) if rounds else None


def mean_over_prompts(per_prompt: list[list[Round]]) -> float | None:
    taus = [t for t in map(tau, per_prompt) if t is not None]
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
        "tau": mean_over_prompts(chain),
        "ddtree": {str(b): mean_over_prompts([r.trees[b] for r in results]) for b in budgets},
        "per_position": per_position,
        "histogram": histogram,
        "rounds": len(rounds),
        "block_size": block_size,
    }


def prompt_record(result: PromptResult) -> dict:
    return {
        "tau": tau(result.chain),
        "rounds": [x.produced for x in result.chain],
        "accepted": [x.accepted for x in result.chain],
        "ddtree": {
            str(b): {"tau": tau(rs), "rounds": [x.produced for x in rs]}
            for b, rs in result.trees.items()
        },
        "draft_s": round(result.draft_s, 4),
    }


def compare_rounds(real: list[int], simulated: list[Round]) -> dict:
    """One prompt's real rounds (accepted + 1 each) against the simulated ones."""
    sim = [x.produced for x in simulated]
    return {
        "real_tau": tau_of(real),
        "simulated_tau": tau_of(sim),
        "equal": real == sim,
        "rounds": len(real),
        "rounds_equal": sum(a == b for a, b in zip(real, sim, strict=False)),
    }


def totals(compared: list[dict]) -> dict:
    """Mean taus over prompts and round counts of `compare_rounds` results."""
    taus = {k: [c[k] for c in compared if c[k] is not None] for k in ("real_tau", "simulated_tau")}
    return {
        **{k: statistics.mean(v) if v else None for k, v in taus.items()},
        "rounds_checked": sum(c["rounds"] for c in compared),
        "rounds_equal": sum(c["rounds_equal"] for c in compared),
    }


def tau_of(lengths: list[int]) -> float | None:
    return float(statistics.mean(lengths)) if lengths else None


def rate(count: int, seconds: float) -> float | None:
    return count / seconds if seconds > 0 else None


def fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
