"""What fits per GPU: the memory plan of the Qwen3.6-27B template over a few settings.

    python bench/memory_plan.py [--config RUN.yaml] [--target-config CONFIG.json] [--nproc 8]
        [--gpu-memory-gib 80 141]

For each sharding (none, zero1), the drafter's layers checkpointed or not
(drafter.activation_checkpointing: null, on for CUDA, or false) and each (max_length,
num_anchors) below, the per-rank total of `workload.plan` (target, drafter, gradients, AdamW
moments, activations, CUDA overhead) and whether it fits each GPU size. No GPU needed: target and drafter are built on the meta device.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROWS = [(4096, 512), (4096, 256), (4096, 128), (2048, 256)]


def main() -> int:
    from workload.config import load_config
    from workload.plan import memory as plan

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(ROOT / "templates/runs/qwen36-27b.yaml"))
    p.add_argument(
        "--target-config", default=str(ROOT / "templates/targets/qwen36-27b-config.json")
    )
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--gpu-memory-gib", type=float, nargs="+", default=[80, 141])
    a = p.parse_args()
    target = plan.load_target_config(a.target_config)
    sizes = " ".join(f"{g:>6.0f}G" for g in a.gpu_memory_gib)
    print(f"{a.nproc} ranks; per-rank GiB (activations in brackets); fits: {sizes}")
    for sharding in ("none", "zero1"):
        for checkpointing in ("null", "false"):
            for length, anchors in ROWS:
                cfg = load_config(a.config, [
                    f"dist.sharding={sharding}", f"data.max_length={length}",
                    f"data.num_anchors={anchors}",
                    f"drafter.activation_checkpointing={checkpointing}"])  # fmt: skip
                t = plan.estimate(cfg, target, a.nproc, device="cuda").per_rank
                fits = " ".join(f"{'yes' if t.total <= g * plan.GIB else 'no':>7}"
                                for g in a.gpu_memory_gib)  # fmt: skip
                ckpt = "ckpt" if checkpointing == "null" else "kept"
                print(f"{sharding:<6} {ckpt} S={length:<5} N={anchors:<4} "
                      f"{t.total / plan.GIB:7.2f} ({t.activations / plan.GIB:5.2f}) {fits}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
