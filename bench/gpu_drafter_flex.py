"""bench/gpu_check.py's `drafter_flex` section: flex block attention at the 27B template's own
drafter shape (heads, kv heads and head_dim of its target, sliding window 2048, block 16, 512
anchors, 4096-token rows), as the trainer runs it: padded to the run's most rows and anchors
(`pad_to`), compiled on CUDA. Per layer kind (sliding + causal in block, full) and dtype:
flex against the chunked reference in float32 on the same rounded inputs (output and the
gradients of q, context K/V, block K/V; max |flex - ref| / max |ref|), the first call's time
(its compile) and the median forward + backward after it, peak memory; then a second batch
with fewer rows and anchors must compile nothing new (one shape per layer kind)."""

from __future__ import annotations

import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_27B = ROOT / "templates" / "runs" / "qwen36-27b.yaml"
TARGET_27B = ROOT / "templates" / "targets" / "qwen36-27b-config.json"
TOL = {"float32": 1e-4, "bfloat16": 3e-2}


def drafter_shape() -> dict:
    """The 27B template's drafter attention shape, from its configs (what the trainer builds)."""
    from workload.config import load_config
    from workload.drafter.targets import text_config

    cfg = load_config(RUN_27B, [])
    text = text_config_of(TARGET_27B, text_config)
    d = cfg.drafter
    return {"heads": text.num_attention_heads, "kv_heads": text.num_key_value_heads,
            "head_dim": getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
            "window": d.sliding_window, "block": d.block_size, "anchors": cfg.data.num_anchors,
            "seq_len": cfg.data.max_length}  # fmt: skip


def text_config_of(path: Path, text_config):
    from workload.plan.memory import load_target_config

    return text_config(load_target_config(path))


def _inputs(shape: dict, seq: int, n: int, device, dtype, seed: int, grads: bool = True):
    import torch

    g = torch.Generator().manual_seed(seed)
    h, kv, dim, k = shape["heads"], shape["kv_heads"], shape["head_dim"], shape["block"]
    anchors = torch.sort(torch.randperm(seq - 1, generator=g)[:n]).values[None]
    valid = torch.rand(1, n, generator=g) > 0.05
    sizes = [(h, n * k), (kv, seq), (kv, seq), (kv, n * k), (kv, n * k)]
    tensors = [torch.randn(1, a, b, dim, generator=g).to(device, dtype) for a, b in sizes]
    return [t.requires_grad_(grads) for t in tensors], anchors.to(device), valid.to(device)


def _run(impl, qkv, anchors, valid, shape, window, causal, pad_to, grads: bool):
    import torch

    from workload.drafter.attention import block_attention

    out = block_attention(*qkv, anchors=anchors, anchor_valid=valid, block_size=shape["block"],
                          sliding_window=window, causal_in_block=causal,
                          scaling=shape["head_dim"] ** -0.5, impl=impl, pad_to=pad_to)  # fmt: skip
    if not grads:
        return [out.detach().float()]
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device)
    return [out.detach().float(), *(g.float() for g in
                                    torch.autograd.grad((out.float() * weight).sum(), qkv))]  # fmt: skip


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def section_drafter_flex(device, smoke: bool, budget) -> dict:
    import torch
    from torch._dynamo.utils import counters

    import workload.drafter.attention as A

    shape = drafter_shape()
    seq, n = (256, 16) if smoke else (shape["seq_len"], shape["anchors"])
    pad_to = (seq, n * shape["block"])
    A.COMPILE_FLEX = device.type == "cuda"  # CPU smoke: eager forward (no flex backward there)
    grads = device.type == "cuda"
    kinds = {"sliding": (shape["window"], True), "full": (None, False)}
    out: dict = {"shape": shape, "rows": seq, "anchors_run": n, "compiled": A.COMPILE_FLEX,
                 "tolerance": TOL, "cases": [], "passed": True}  # fmt: skip
    for dtype_name in ("bfloat16", "float32") if grads else ("float32",):
        dtype = getattr(torch, dtype_name)
        for kind, (window, causal) in kinds.items():
            if budget.left() < 30:
                out["cases"].append({"kind": kind, "dtype": dtype_name, "skipped": "budget"})
                continue
            qkv, anchors, valid = _inputs(shape, seq, n, device, dtype, len(out["cases"]), grads)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            got = _run("flex", qkv, anchors, valid, shape, window, causal, pad_to, grads)
            _sync(device)
            first = time.perf_counter() - t0
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                _run("flex", qkv, anchors, valid, shape, window, causal, pad_to, grads)
                _sync(device)
                times.append(time.perf_counter() - t0)
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if grads else None
            exact = [t.detach().float().requires_grad_(grads) for t in qkv]
            ref = _run("chunked", exact, anchors, valid, shape, window, causal, None, grads)
            errors = {name: float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                      for name, a, b in zip(("out", "dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"),
                                            got, ref, strict=False)}  # fmt: skip
            ok = max(errors.values()) <= TOL[dtype_name]
            out["passed"] &= ok
            out["cases"].append({"kind": kind, "dtype": dtype_name, "passed": ok, "errors": errors,
                                 "first_call_s": first, "fwd_bwd_ms": 1000 * sorted(times)[1],
                                 "peak_gib": peak})  # fmt: skip
    before = counters["stats"]["unique_graphs"]
    shapes = len(A.FLEX_SHAPES)
    if budget.left() > 30:  # fewer rows and anchors, padded to the same run maxima
        qkv, anchors, valid = _inputs(shape, seq * 3 // 4, n * 3 // 4, device, torch.float32, 99,
                                      grads)  # fmt: skip
        _run("flex", qkv, anchors, valid, shape, *kinds["full"], pad_to, grads)
    out["flex_shapes"] = len(A.FLEX_SHAPES)
    out["new_shapes_for_a_smaller_batch"] = len(A.FLEX_SHAPES) - shapes
    out["new_graphs_for_a_smaller_batch"] = counters["stats"]["unique_graphs"] - before
    out["passed"] &= out["new_shapes_for_a_smaller_batch"] == 0
    return out


if __name__ == "__main__":  # python bench/gpu_drafter_flex.py: the shape it would run
    import sys

    sys.path.insert(0, str(ROOT))
    print(json.dumps(drafter_shape()))
