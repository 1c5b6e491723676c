"""Dense-mask vs chunked block attention: forward+backward time and peak memory on CPU.

    python bench/attention.py [--runs 5] [--threads 1]

Each (case, level, impl) runs in its own subprocess. Peak memory is the growth of the process's
peak resident set (getrusage ru_maxrss) across the first forward+backward, measured after the
inputs exist: what that step needed on top of its inputs. Times are medians of --runs further
forward+backward passes: wall clock and process CPU time (the latter barely moves when other
work shares the machine; one torch thread by default for the same reason). Levels: `attention` = block_attention alone; `drafter` = a 2-layer
DFlashDrafter.forward_blocks + backward (context projection included, target features given).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

CASES = [(2048, 256, 16), (1024, 128, 16)]  # (row length S, anchors N, block size K)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 256, 4, 2, 64
IMPLS = ("dense", "chunked")
LEVELS = ("attention", "drafter")


def _attention_step(seq_len: int, anchors: int, block: int, impl: str):
    import torch

    from workload.drafter.attention import block_attention

    g = torch.Generator().manual_seed(0)
    pos = torch.sort(torch.randperm(seq_len - 1, generator=g)[:anchors]).values[None]
    valid = torch.ones_like(pos, dtype=torch.bool)
    total = anchors * block

    def leaf(heads, length):
        return torch.randn(1, heads, length, HEAD_DIM, generator=g).requires_grad_(True)

    q = leaf(HEADS, total)
    kv = [leaf(KV_HEADS, seq_len), leaf(KV_HEADS, seq_len), leaf(KV_HEADS, total),
          leaf(KV_HEADS, total)]  # fmt: skip

    def step():
        out = block_attention(q, *kv, anchors=pos, anchor_valid=valid, block_size=block,
                              scaling=HEAD_DIM**-0.5, impl=impl)  # fmt: skip
        out.sum().backward()

    return step


def _drafter_step(seq_len: int, anchors: int, block: int, impl: str):
    import torch
    from transformers import Qwen3Config

    from workload.drafter.model import DFlashDrafter, build_drafter_config

    target = Qwen3Config(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         head_dim=HEAD_DIM, num_hidden_layers=8, intermediate_size=3 * HIDDEN,
                         vocab_size=4096)  # fmt: skip
    cfg = build_drafter_config(target, num_layers=2, block_size=block, mask_token_id=1,
                               target_layer_ids=[1, 3, 5])  # fmt: skip
    torch.manual_seed(0)
    model = DFlashDrafter(cfg)
    g = torch.Generator().manual_seed(0)
    pos = torch.sort(torch.randperm(seq_len - 1, generator=g)[:anchors]).values[None]
    valid = torch.ones_like(pos, dtype=torch.bool)
    feats = torch.randn(1, seq_len, 3 * HIDDEN, generator=g)
    embeds = torch.randn(1, anchors * block, HIDDEN, generator=g)
    positions = torch.arange(seq_len)[None]

    def step():
        ctx = model.project_context(feats)
        out = model.forward_blocks(embeds, ctx, pos, valid, positions, attention=impl)
        out.square().mean().backward()

    return step


def child(spec: dict) -> dict:
    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    make = _attention_step if spec["level"] == "attention" else _drafter_step
    step = make(spec["seq_len"], spec["anchors"], spec["block"], spec["impl"])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    wall, cpu = [], []
    for _ in range(spec["runs"]):
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {"ms": 1000 * statistics.median(wall), "cpu_ms": 1000 * statistics.median(cpu),
            "peak_mib": peak_kib / 1024, "threads": torch.get_num_threads()}  # fmt: skip


def measure(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                          capture_output=True, text=True, check=False)  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"case {spec} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch default)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    print(f"head config: hidden {HIDDEN}, {HEADS} heads, {KV_HEADS} kv heads, head_dim {HEAD_DIM};"
          f" fp32; medians of {args.runs} fwd+bwd; peak = ru_maxrss growth over the first fwd+bwd;"
          f" one subprocess per cell; load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    header = (f"{'case':<21}{'level':<10}{'wall ms dense':>14}{'chunked':>9}{'x':>6}"
              f"{'cpu ms dense':>14}{'chunked':>9}{'x':>6}{'MiB dense':>11}{'chunked':>9}{'x':>6}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for seq_len, anchors, block in CASES:
        for level in LEVELS:
            res = {}
            for impl in IMPLS:
                spec = dict(seq_len=seq_len, anchors=anchors, block=block, impl=impl, level=level,
                            runs=args.runs, threads=args.threads)  # fmt: skip
                res[impl] = measure(spec)
            print(_row(f"S={seq_len} N={anchors} K={block}", level, res["dense"], res["chunked"]),
                  flush=True)  # fmt: skip
    print(f"torch threads: {res['dense']['threads']}")


def _row(case: str, level: str, d: dict, c: dict) -> str:
    cells = [f"{case:<21}{level:<10}"]
    for key, width in (("ms", 14), ("cpu_ms", 14), ("peak_mib", 11)):
        ratio = d[key] / max(c[key], 1e-3)
        cells.append(f"{d[key]:>{width}.0f}{c[key]:>9.0f}{ratio:>6.1f}")
    return "".join(cells)


if __name__ == "__main__":
    main()
