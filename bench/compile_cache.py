"""A restart's compiles with torch's compile caches kept (what `launch` and `resume` give a run:
TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR in the workspace) against the first start's.

    python bench/compile_cache.py [--starts 3] [--seq 512] [--blocks 32]

What a first training step compiles on a GPU is the drafter's flex block attention and its
block masks, one shape per layer kind (workload/drafter/attention.py). On CPU the trainer runs
flex eagerly (flex has no CPU backward), so this bench runs the same compiled functions
forward, at the 27B drafter's head shape, in fresh processes (as restarts are) that share one
cache directory: each start's first call (compile or cache read) and its graphs from the cache.
The first start fills the cache; later ones read it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

START = """
import json, sys, time, torch
import workload.drafter.attention as A
from torch._dynamo.utils import counters
A.COMPILE_FLEX = True
seq, blocks, K, HQ, HKV, D = (int(x) for x in sys.argv[1:7])
g = torch.Generator().manual_seed(0)
anchors = torch.sort(torch.randperm(seq - 1, generator=g)[:blocks]).values[None]
valid = torch.ones(1, blocks, dtype=torch.bool)
docs = torch.zeros(1, seq, dtype=torch.long)
shapes = [(HQ, blocks * K), (HKV, seq), (HKV, seq), (HKV, blocks * K), (HKV, blocks * K)]
qkv = [torch.randn(1, h, n, D, generator=g) for h, n in shapes]
t0 = time.perf_counter()
with torch.no_grad():
    for window, causal in ((None, False), (seq // 4, True)):  # the two layer kinds
        A.block_attention(*qkv, anchors=anchors, anchor_valid=valid, block_size=K,
                          doc_ids=docs, sliding_window=window, causal_in_block=causal,
                          scaling=D**-0.5, impl="flex")
inductor = counters["inductor"]
print(json.dumps({"first_call_s": time.perf_counter() - t0,
                  "from_cache": inductor["fxgraph_cache_hit"],
                  "compiled": inductor["fxgraph_cache_miss"]}))
"""


def start(cache: Path, shape: list[int]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
           "TRITON_CACHE_DIR": str(cache / "triton")}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", START, *map(str, shape)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=3600)  # fmt: skip
    if done.returncode:
        raise SystemExit(f"start exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--starts", type=int, default=3, help="fresh processes sharing one cache")
    p.add_argument("--seq", type=int, default=512, help="context rows")
    p.add_argument("--blocks", type=int, default=32, help="anchors (blocks of 16)")
    a = p.parse_args()
    shape = [a.seq, a.blocks, 16, 40, 8, 128]  # Qwen3.6-27B's drafter: 40 q heads, 8 kv, 128
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for k in range(a.starts):
            rows.append(start(Path(tmp) / "cache", shape))
            print(f"start {k + 1}: {rows[-1]}", file=sys.stderr, flush=True)
    base = rows[0]["first_call_s"]
    print(f"{'start':<7}{'first call s':>13}{'from cache':>12}{'compiled':>10}{'vs first':>10}")
    for k, r in enumerate(rows):
        print(f"{k + 1:<7}{r['first_call_s']:>13.2f}{r['from_cache']:>12}{r['compiled']:>10}"
              f"{r['first_call_s'] / base:>10.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
