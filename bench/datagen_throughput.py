"""Regeneration throughput of `workload.datagen` on the tiny target: vLLM and transformers side by side.

    python bench/datagen_throughput.py [--tiny DIR] [--conversations 256] [--chunk 256]
        [--max-new-tokens 96] [--vllm-python PATH] [--batch-size 64]

Each engine runs the same datagen job (the tiny target's chat data, one- and two-turn
conversations, greedy) in its own process: vLLM with --vllm-python (default /opt/vllm-venv's,
or $DFLASHOPS_VLLM_PYTHON), transformers with this python. Reported per engine: the engine's
start (from its state.json), generation time (the sum of the chunks' own seconds), conversations
and generated tokens per second of generation, the whole command's wall time, and whether the
two engines wrote the same conversations. DIR: a `python -m workload.tiny` build; default the
test suite's cached dense build (built when missing, a few minutes).
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
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def tiny_build(given: str | None) -> Path:
    if given:
        return Path(given)
    from tests.workload.conftest import FIXTURE_BUILDS, cached_tiny

    return cached_tiny(FIXTURE_BUILDS["dense"])


def write_input(data: Path, n: int, path: Path) -> None:
    lines = [line for line in data.read_text().splitlines() if line.strip()]
    path.write_text("\n".join(lines[i % len(lines)] for i in range(n)) + "\n")


def run_engine(python: str, engine: str, prompts: Path, target: Path, out: Path,
               a: argparse.Namespace) -> dict:  # fmt: skip
    argv = [python, "-m", "workload.datagen", "--prompts", str(prompts), "--target", str(target),
            "--out", str(out), "--engine", engine, "--chunk", str(a.chunk),
            "--max-new-tokens", str(a.max_new_tokens), "--batch-size", str(a.batch_size)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error"}  # fmt: skip
    t0 = time.time()
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    if r.returncode != 0:
        raise SystemExit(f"{engine}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    records = [json.loads(p.read_text()) for p in sorted((out / "chunks").glob("chunk_*.json"))]
    gen_s = sum(rec["seconds"] for rec in records)
    convs = sum(rec["count"] for rec in records)
    tokens = sum(rec["generated_tokens"] for rec in records)
    state = json.loads((out / "state.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    return {"engine": f"{engine} {manifest['engine']['version']}", "start_s": state["engine_start_s"],
            "gen_s": gen_s, "conv_s": convs / gen_s, "tok_s": tokens / gen_s, "wall_s": wall,
            "tokens": tokens, "convs": convs, "done": manifest["done"],
            "out": out}  # fmt: skip  # noqa: E501


def conversations(out: Path) -> dict[str, list]:
    recs = [json.loads(line) for f in sorted(out.glob("chunk_*.jsonl")) for line in f.open()]
    return {r["source"]: r["messages"] for r in recs}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", help="a `python -m workload.tiny` build directory")
    p.add_argument("--conversations", type=int, default=256)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=64, help="transformers' generate batch")
    p.add_argument("--vllm-python",
                   default=os.environ.get("DFLASHOPS_VLLM_PYTHON", "/opt/vllm-venv/bin/python"))  # fmt: skip
    a = p.parse_args()
    tiny = tiny_build(a.tiny)
    rows = []
    with tempfile.TemporaryDirectory(prefix="datagen-bench-") as tmp:
        prompts = Path(tmp) / "prompts.jsonl"
        write_input(tiny / "data.jsonl", a.conversations, prompts)
        engines = [("transformers", sys.executable)]
        if Path(a.vllm_python).is_file():
            engines.insert(0, ("vllm", a.vllm_python))
        else:
            print(f"no vLLM python at {a.vllm_python}: transformers only", file=sys.stderr)
        for engine, python in engines:
            print(f"running {engine} ...", file=sys.stderr, flush=True)
            rows.append(run_engine(python, engine, prompts, tiny / "target",
                                   Path(tmp) / engine, a))  # fmt: skip
        same = len(rows) == 2 and conversations(rows[0]["out"]) == conversations(rows[1]["out"])
    cpus = len(os.sched_getaffinity(0))
    print(f"tiny target {tiny.name}, {a.conversations} conversations, chunk {a.chunk}, "
          f"max_new_tokens {a.max_new_tokens}, greedy, CPU ({cpus} cores, load "
          f"{os.getloadavg()[0]:.1f})")  # fmt: skip
    head = f"{'engine':<22}{'start s':>9}{'gen s':>9}{'conv/s':>9}{'tok/s':>9}{'tokens':>9}{'wall s':>9}"
    print(head)
    for r in rows:
        print(f"{r['engine']:<22}{r['start_s']:>9.1f}{r['gen_s']:>9.2f}{r['conv_s']:>9.2f}"
              f"{r['tok_s']:>9.0f}{r['tokens']:>9}{r['wall_s']:>9.1f}")  # fmt: skip
    if len(rows) == 2:
        print(f"vLLM / transformers: conv/s x{rows[0]['conv_s'] / rows[1]['conv_s']:.2f}; "
              f"the same conversations: {'yes' if same else 'NO'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
