"""bench/gpu_check.py's `drafter_27b` section: the trainer's own steps with the 27B template's
drafter (5 layers, 24/4 heads, head_dim 256, hidden 5120, MLP 17408, fc of 5 taps, sliding
window 2048, block 16, 512 anchors, 4096-token rows, bf16 autocast, layers checkpointed, flex
attention compiled) on a shallow target of the 27B's width and vocabulary (a dense Qwen3 of 8
layers: the drafter's shape is the 27B's, the target's forward is cheaper and needs no fla).

Reported: the first step (flex attention and block masks compiled in it: its time, the shapes
and graphs it compiled; later steps must compile none), the median step split into target forward / drafter forward + backward /
optimizer, and the peak memory torch allocated against workload.plan's estimate of the same run
(the plan's total less the CUDA context and NCCL, which torch's allocator does not count), with
their ratio. --cpu-smoke runs the same code at a tiny size (chunked attention, no peak: the
CPU has no allocator statistics).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

SHALLOW_LAYERS = 8
SMOKE = dict(hidden=64, heads=4, kv=2, head_dim=16, inter=128, vocab=512)
STEPS = {"gpu": (1, 3), "smoke": (1, 1)}  # (warm-up incl. the compiling first step, timed)


def shallow_target(device, smoke: bool):
    """A Qwen3 with the 27B's width, heads, head_dim, MLP and vocab, SHALLOW_LAYERS deep."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from bench.gpu_drafter_flex import TARGET_27B
    from workload.drafter.targets import text_config
    from workload.plan.memory import load_target_config

    t = text_config(load_target_config(TARGET_27B))
    size = SMOKE if smoke else dict(hidden=t.hidden_size, heads=t.num_attention_heads,
                                    kv=t.num_key_value_heads, head_dim=t.head_dim,
                                    inter=t.intermediate_size, vocab=t.vocab_size)  # fmt: skip
    config = Qwen3Config(hidden_size=size["hidden"], intermediate_size=size["inter"],
                         num_hidden_layers=SHALLOW_LAYERS, num_attention_heads=size["heads"],
                         num_key_value_heads=size["kv"], head_dim=size["head_dim"],
                         vocab_size=size["vocab"], max_position_embeddings=8192,
                         tie_word_embeddings=False, eos_token_id=1, pad_token_id=0)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    return model.eval().requires_grad_(False), size


def run_config(size: dict, smoke: bool):
    """The 27B template with the in-memory target's layers and mask token (smaller on CPU)."""
    from bench.gpu_drafter_flex import RUN_27B
    from workload.config import load_config

    sets = ["target.path=in-memory", "data.path=in-memory", "optim.max_steps=100",
            "target.dtype=auto", f"drafter.mask_token_id={size['vocab'] - 1}",
            "drafter.target_layer_ids=[1,2,4,5,6]"]  # fmt: skip
    if smoke:
        sets += ["data.max_length=256", "data.num_anchors=16", "drafter.sliding_window=64",
                 "attention=chunked", "optim.precision=auto"]  # fmt: skip
    return load_config(RUN_27B, sets)


def planned_bytes(cfg, target, device) -> dict:
    from workload.plan import memory as plan

    p = plan.estimate(cfg, target.config, 1, device=device.type)
    allocator = p.per_rank.total - p.per_rank.overhead
    return {"total": p.per_rank.total, "allocator": allocator,
            "parts": {**vars(p.per_rank)}, "activation_parts": p.activation_parts}  # fmt: skip


def steps(run, warmup: int, timed: int, budget) -> dict:
    import torch
    from torch._dynamo.utils import counters

    from workload.drafter import attention as A
    from workload.train import loop as T
    from workload.train.step import StepSums

    cuda = run.device.type == "cuda"
    run.timing = True
    rows, first = [], None
    shapes, graphs = len(A.FLEX_SHAPES), counters["stats"]["unique_graphs"]
    for i in range(warmup + timed):
        if i >= warmup and budget.left() < 20:
            break
        run.times.clear()
        if cuda:
            torch.cuda.synchronize(run.device)
        t0 = time.perf_counter()
        loss, _, _ = T.train_step(run, i, StepSums(run.device))
        if cuda:
            torch.cuda.synchronize(run.device)
        wall = time.perf_counter() - t0
        if i == 0:
            first = {"first_step_s": wall, "flex_shapes": len(A.FLEX_SHAPES) - shapes,
                     "unique_graphs": counters["stats"]["unique_graphs"] - graphs}  # fmt: skip
        elif i >= warmup:
            rows.append({**run.times, "step": wall, "loss": float(loss)})
    out = {**(first or {}), "timed_steps": len(rows)}
    for key in ("target_forward", "drafter_fwd_bwd", "optimizer", "step"):
        if rows:
            out[f"{key}_ms"] = 1000 * sorted(r[key] for r in rows)[len(rows) // 2]
    out["new_graphs_after_the_first_step"] = (
        counters["stats"]["unique_graphs"] - graphs - out.get("unique_graphs", 0)
    )
    return out


def section_drafter_27b(d, smoke: bool, budget) -> dict:
    import torch

    from bench.gpu_check import _examples
    from workload.drafter.attention import resolve_impl
    from workload.train import loop as T

    t0 = time.perf_counter()
    target, size = shallow_target(d.device, smoke)
    cfg = run_config(size, smoke)
    cuda = d.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(d.device)
        torch.cuda.reset_peak_memory_stats(d.device)
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=1, mask_token_id=None)
    examples = _examples({"seq_len": cfg.data.max_length}, size["vocab"])
    run, _ = T.setup(cfg, d, say=lambda m: None, target=target, tokenizer=tok,
                     examples=examples)  # fmt: skip
    built = time.perf_counter() - t0
    out: dict = {"target": {"layers": SHALLOW_LAYERS, **size}, "build_s": built,
                 "seq_len": cfg.data.max_length, "anchors": cfg.data.num_anchors,
                 "drafter_params_m": sum(p.numel() for p in run.drafter.parameters()) / 1e6,
                 "attention": resolve_impl(cfg.attention, d.device)}  # fmt: skip
    out.update(steps(run, *STEPS["smoke" if smoke else "gpu"], budget))
    planned = planned_bytes(cfg, target, d.device)
    out["plan_gib"] = planned["allocator"] / 2**30
    out["plan_parts_gib"] = {k: v / 2**30 for k, v in planned["parts"].items()}
    if cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated(d.device) / 2**30
        out["peak_over_plan"] = out["peak_gib"] / out["plan_gib"]
        out["passed"] = 0.75 <= out["peak_over_plan"] <= 1.25  # the plan's own tolerance
    del run
    if cuda:
        torch.cuda.empty_cache()
    return out
