"""Eval wall time of one checkpoint on the same prompts: `--engine sim` against `--engine vllm`.

    python bench/eval_engines.py --config RUN.yaml --checkpoint DIR [--prompts FILE]
        [--max-prompts 32] [--max-new-tokens 256] [--vllm-python PATH] [--out DIR]

Runs `python -m workload.eval` twice, one engine after the other (never together: they would
share the cores), and prints their wall times and where each spends it side by side: the sim's
Hugging Face greedy decoding (one token a forward), its one forward a prompt, the drafter's
simulated rounds; vLLM's engine starts (plain and speculative), its batched generation, and the
simulation it runs after for DDTree. Also both taus, the rounds in agreement and vLLM's tokens
per second. Default inputs: the tests' cached tiny target and trained drafter
($DFLASHOPS_TEST_CACHE, else the temp dir's dflashops-tests), 32 prompts of its kind.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cache() -> Path:
    root = os.environ.get("DFLASHOPS_TEST_CACHE") or Path(tempfile.gettempdir()) / "dflashops-tests"
    return Path(root)


def _newest(pattern: str) -> Path | None:
    done = [
        p for p in _cache().glob(pattern) if p.is_dir() and "." not in p.name
    ]  # no locks, temps
    found = sorted(done, key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def _prompts(n: int, out: Path) -> Path:
    """n eval prompts of the tiny target's tasks (workload.tiny's generator)."""
    sys.path.insert(0, str(ROOT))
    from workload.tiny import make_corpus

    _, evals = make_corpus(0, 1200, n)
    out.write_text("".join(json.dumps(e) + "\n" for e in evals))
    return out


def run_eval(engine: str, args: argparse.Namespace, prompts: Path, out: Path) -> dict:
    argv = [sys.executable, "-m", "workload.eval", "--config", str(args.config),
            "--checkpoint", str(args.checkpoint), "--prompts", str(prompts),
            "--max-prompts", str(args.max_prompts), "--max-new-tokens", str(args.max_new_tokens),
            "--engine", engine, "--out", str(out)]  # fmt: skip
    if engine == "vllm":
        argv += ["--vllm-python", args.vllm_python]
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=7200)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"eval --engine {engine} failed: {done.stderr.strip().splitlines()[-1:]}")
    result = json.loads(out.read_text())
    result["wall_s"] = wall
    return result


def _row(name: str, sim: object, vllm: object) -> str:
    def fmt(x: object) -> str:
        if x is None:
            return "-"
        return f"{x:.3f}" if isinstance(x, float) else str(x)

    return f"{name:<34}{fmt(sim):>14}{fmt(vllm):>14}"


def report(sim: dict, vllm: dict) -> None:
    ts, tv = sim["timing"], vllm["timing"]
    new = sum(p["new_tokens"] for p in sim["prompts"])
    print(f"{sim['n_prompts']} prompts x {sim['max_new_tokens']} new tokens max "
          f"({new} generated), block {sim['block_size']}")  # fmt: skip
    print(_row("", "--engine sim", "--engine vllm"))
    print(_row("wall (s)", sim["wall_s"], vllm["wall_s"]))
    print(_row("  loads: target, drafter (s)", ts["load_s"], tv["load_s"]))
    print(_row("  greedy decoding, HF (s)", ts["generate_s"], None))
    print(_row("  vLLM engine starts (s)", None, tv["plain_start_s"] + tv["checkpoint_start_s"]))
    print(_row("  vLLM generation, plain (s)", None, tv["plain_generate_s"]))
    print(_row("  vLLM generation, spec (s)", None, tv["checkpoint_generate_s"]))
    print(_row("  vLLM process in all (s)", None, tv["engine_s"]))
    print(_row("  one target forward a prompt (s)", ts["forward_s"], tv["forward_s"]))
    print(_row("  simulated drafts (s)", ts["draft_s"], tv["draft_s"]))
    print(_row("tau", sim["tau"], vllm["tau"]))
    print(_row("tau simulated", sim["tau"], vllm["simulation"]["tau"]))
    print(_row("ddtree 16", sim["ddtree"]["16"], vllm["ddtree"]["16"]))
    s = vllm["simulation"]
    print(_row("prompts with identical rounds", None, f"{s['prompts_identical']}/{s['prompts']}"))
    g = vllm["greedy"]
    print(_row("spec output equals greedy", None, f"{g['equal']}/{g['prompts']}"))
    print(_row("engine pooled acceptance length", None, vllm["engine_mean_acceptance_length"]))
    print(
        _row("tokens/s spec, plain", None, "{spec:.0f}, {plain:.0f}".format(**vllm["tokens_per_s"]))
    )
    print(_row("wall ratio sim / vllm", sim["wall_s"] / vllm["wall_s"], None))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path)
    p.add_argument("--checkpoint", type=Path)
    p.add_argument("--prompts", type=Path)
    p.add_argument("--max-prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument(
        "--vllm-python",
        default=os.environ.get("DFLASHOPS_VLLM_PYTHON", "/opt/vllm-venv/bin/python"),
    )
    p.add_argument("--out", type=Path, default=None, help="keep both results here")
    args = p.parse_args()
    if args.config is None:
        tiny = _newest("tiny-dense-*")
        args.config = tiny / "run.yaml" if tiny else None
    if args.checkpoint is None:
        run = _newest("drafter-*")
        steps = sorted((run / "checkpoints").glob("step_*")) if run else []
        args.checkpoint = steps[-1] if steps else None
    if args.config is None or args.checkpoint is None:
        sys.exit("no cached tiny build or drafter: pass --config and --checkpoint "
                 "(or run tests/workload/test_eval_vllm.py once)")  # fmt: skip
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-eval-"))
    out.mkdir(parents=True, exist_ok=True)
    prompts = args.prompts or _prompts(args.max_prompts, out / "prompts.jsonl")
    sim = run_eval("sim", args, prompts, out / "sim.json")
    vllm = run_eval("vllm", args, prompts, out / "vllm.json")
    report(sim, vllm)


if __name__ == "__main__":
    main()
