"""`python -m workload.plan --config RUN.yaml --nproc N`: will a run fit, before it starts?

Per rank, in bytes: what a training step keeps alive, computed from the run config and the
target's config.json. Target and drafter are built on the meta device without initialising
them (no weights are read; about a second for a 27B config) to count their parameters; the
activations follow the step's code (workload/train/step.py, train/loss.py, drafter/attention.py, drafter/model.py) term by
term. The test
(tests/workload/test_plan.py) holds the estimate within 25% of the peak torch allocates during
real steps of tiny targets on CPU.

    python -m workload.plan --config RUN.yaml [--set k=v]... --nproc N [--nnodes K]
        [--device cuda|cpu] [--gpu-memory-gib G] [--target-config PATH] [--json]
        [--gpu h200|h100|...|cpu] [--gpu-name NAME] [--peak-tflops T] [--mfu F] [--link-gbps G]

`--json` prints one object; the operator (`dflashops launch`) parses it, so it stays stable:

    {"world": 8, "sharding": "zero1", "device": "cuda",
     "per_rank": {"target_weights": B, "drafter_params": B, "gradients": B, "optimizer": B,
                  "activations": B, "overhead": B, "total": B},     # bytes
     "parameters": {"target": n, "drafter": n},
     "gpu_memory": B or null, "fits": true/false or null, "notes": ["..."],
     "nnodes": K, "comm_bytes": {"intra": B, "inter": B, "grads": B, "params": B},  # per step
     "step_time": {"gpu", "mfu", "link_gbps", "flops", "compute_s", "comm_s", "step_s",
                   "one_node_s", "pays", "accum_to_pay", "link_measured", "grad_accum"}}
                   # step_time.py; one_node_s, pays, accum_to_pay null on one node

`fits` is null without --gpu-memory-gib. Exit codes: 0 (also when it does not fit: read
`fits`), 2 bad input (config, target config), with one line on stderr.

Assumptions (also in `notes`): drafter master weights, gradients and AdamW's two moments in
fp32; the gradients are views of DDP's buckets (gradient_as_bucket_view, as train/build_run.py
builds DDP), one copy; zero1 shards the moments like ZeroRedundancyOptimizer (whole parameters,
largest first, to the emptiest rank); the drafter's layers are checkpointed as
drafter.activation_checkpointing resolves on the device (null: on for cuda); rows are full
(max_length tokens) with the most anchors the config allows; on a GPU, 1 GiB for the CUDA context and workspaces, plus 0.5 GiB for NCCL
when world > 1; the caching allocator's fragmentation is not modelled.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from workload.common.layout import DATASET_MANIFEST
from workload.common.parallel_rules import resolve_grad_comm, resolve_sharding, shard_ranks
from workload.config import ConfigError, RunConfig, load_config, recipe_layer_ids
from workload.eval.parity import ParityError, before_launch
from workload.plan import moves
from workload.plan import step_time as step_plan
from workload.plan.step_time import Comm, StepTime

GIB = 1 << 30
CUDA_CONTEXT = 1 * GIB  # CUDA context, cuBLAS workspaces, allocator slack
NCCL_BUFFERS = GIB // 2  # NCCL communicator buffers, when there is more than one rank
ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, fp32 each
GREEDY_CHUNK = 1024  # rows per lm_head call in loss.greedy_tokens
LOSS_CHUNK_BLOCKS = 64  # blocks per lm_head chunk in loss.objective
METRIC_CHUNK = 1 << 25  # logits elements the draft metrics upcast at a time (metrics.py)
FP32 = 4
LINK_ENV = "DFLASHOPS_LINK_GBPS"  # the link between nodes, Gb/s, for the step-time plan


class PlanError(ValueError):
    """A target config that cannot be read or built: one line."""


@dataclass
class Terms:
    """Bytes one rank holds."""

    target_weights: int = 0
    drafter_params: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    overhead: int = 0

    @property
    def total(self) -> int:
        return sum(asdict(self).values())


@dataclass
class Shape:
    """The sizes a step works with (per rank and micro-batch; rows filled to max_length)."""

    rows: int  # B
    seq: int  # S
    anchors: int  # N per row
    block: int  # K
    hidden: int  # H
    vocab: int  # V
    features: int  # L, fc input layers
    target_layers: int
    q_dim: int  # drafter heads x head_dim
    kv_dim: int
    q_heads: int
    head_dim: int
    intermediate: int  # drafter MLP width
    drafter_layers: list[str]  # layer types
    window: int | None
    target_dtype: int  # bytes per target weight / activation
    compute_dtype: int  # bytes of the drafter's matmul outputs (autocast dtype, else fp32)
    attention: str  # flex | chunked | dense
    checkpointed: bool  # drafter layers under activation checkpointing
    proj_weights: int  # elements of the drafter's linear weights (autocast casts them)
    layer_casts: int  # elements of one layer's linear weights

    @property
    def residual(self) -> int:  # bytes per element of the layers' input stream
        return max(self.target_dtype, self.compute_dtype)

    @property
    def context(self) -> int:  # C, context positions of the micro-batch
        return self.rows * self.seq

    @property
    def queries(self) -> int:  # Q, block positions of the micro-batch
        return self.rows * self.anchors * self.block


@dataclass
class Plan:
    world: int
    sharding: str
    device: str
    per_rank: Terms
    parameters: dict[str, int]
    gpu_memory: int | None = None
    notes: list[str] = field(default_factory=list)
    activation_parts: dict[str, int] = field(default_factory=dict)
    nnodes: int = 1
    comm: Comm = field(default_factory=Comm)
    time: StepTime | None = None
    accum: int = 1
    length: dict[str, Any] = field(default_factory=dict)  # training_length's
    resume: dict[str, Any] = field(default_factory=dict)  # moves.resume_cost's (GPU plans)

    @property
    def fits(self) -> bool | None:
        return None if self.gpu_memory is None else self.per_rank.total <= self.gpu_memory

    def to_json(self) -> dict[str, Any]:
        per_rank = {**asdict(self.per_rank), "total": self.per_rank.total}
        return {
            "world": self.world,
            "sharding": self.sharding,
            "device": self.device,
            "per_rank": per_rank,
            "parameters": self.parameters,
            "gpu_memory": self.gpu_memory,
            "fits": self.fits,
            "notes": self.notes,
            "nnodes": self.nnodes,
            "comm_bytes": asdict(self.comm),
            "step_time": None if self.time is None else self.time.to_json(),
            "length": self.length,
            "resume": self.resume,
        }

    def lines(self) -> list[str]:
        t = self.per_rank
        p = self.parameters
        out = [
            f"{self.world} rank(s) on {self.device}, sharding {self.sharding}; target "
            f"{p['target'] / 1e9:.2f}B parameters, drafter {p['drafter'] / 1e9:.3f}B trainable",
        ]
        for name, value in asdict(t).items():
            out.append(f"  {name:<15} {gib(value):>8}")
        parts = ", ".join(f"{k} {gib(v)}" for k, v in self.activation_parts.items())
        out.append(f"    (activations at their peak: {parts})")
        out.append(f"  {'total per rank':<15} {gib(t.total):>8}")
        if self.gpu_memory is not None:
            margin = self.gpu_memory - t.total
            verdict = "fits" if margin >= 0 else "DOES NOT FIT"
            out.append(
                f"  {verdict} in {gib(self.gpu_memory)} "
                f"({'margin' if margin >= 0 else 'short by'} {gib(abs(margin))})"
            )
        if self.time is not None:
            out += step_plan.lines(self.time, self.comm, self.nnodes, self.accum)
        if self.length:
            out.append(f"  training length: {length_line(self.length)}")
        if self.resume:
            out.append(f"  {moves.resume_line(self.resume)}")
        out += [f"  note: {n}" for n in self.notes]
        return out


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


# ---------------------------------------------------------------- building on the meta device


def load_target_config(path: str | os.PathLike) -> Any:
    """A Hugging Face config from a config.json file or a model directory (PlanError if not)."""
    from transformers import AutoConfig

    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise PlanError(f"{file}: no such file (a target config.json is needed)")
    try:
        return AutoConfig.from_pretrained(str(file))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise PlanError(f"{file}: not a usable model config: {first}") from None


def dtype_bytes(name: str, device: str) -> int:
    """Bytes per target weight: target.dtype, auto as workload.drafter.targets resolves it."""
    if name == "auto":  # bf16 on GPU, fp32 on CPU
        return 2 if device == "cuda" else FP32
    return {"bfloat16": 2, "float16": 2, "float32": FP32}[name]


def compute_bytes(precision: str, device: str) -> int:
    """Bytes of the drafter's matmul outputs: autocast bf16 (auto on GPU, bf16), else fp32."""
    if precision == "fp32" or (precision == "auto" and device != "cuda"):
        return FP32
    return 2


def meta_target(target_config: Any, weight_bytes: int):
    """The target as AutoModelForCausalLM builds it (the trainer's loader), on meta."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    dtype = torch.float32 if weight_bytes == FP32 else torch.bfloat16
    try:
        with torch.device("meta"), no_init_weights():
            model = AutoModelForCausalLM.from_config(target_config, dtype=dtype)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise PlanError(f"target config: cannot build the model: {first}") from None
    model.tie_weights()  # skipped with the initialisation; tied embeddings count once
    return model


def fc_layer_ids(cfg: RunConfig, num_target_layers: int) -> list[int]:
    """The drafter's fc inputs, as the trainer resolves them (null = the recipe's taps)."""
    from workload.drafter.model import default_target_layer_ids

    ids = cfg.drafter.target_layer_ids
    if ids is None:
        n = len(recipe_layer_ids(num_target_layers))
        ids = default_target_layer_ids(num_target_layers, n)
    return list(ids[:-1] if cfg.drafter.fc_layers == "all_but_last" else ids)


def meta_drafter(cfg: RunConfig, target_config: Any, fc_ids: list[int]):
    import torch
    from transformers.initialization import no_init_weights

    from workload.drafter.model import DFlashDrafter, build_drafter_config

    d = cfg.drafter
    try:
        config = build_drafter_config(
            target_config,
            num_layers=d.num_layers,
            block_size=d.block_size,
            mask_token_id=d.mask_token_id or 0,  # any row: the size does not depend on it
            target_layer_ids=fc_ids,
            layer_types=d.layer_types,
            sliding_window=d.sliding_window,
            intermediate_size=d.intermediate_size,
            num_attention_heads=d.num_attention_heads,
            num_key_value_heads=d.num_key_value_heads,
            head_dim=d.head_dim,
        )
    except ValueError as exc:
        raise PlanError(f"drafter: {exc}") from None
    with torch.device("meta"), no_init_weights():
        return DFlashDrafter(config).float()


def module_bytes(module) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


# ---------------------------------------------------------------- the static terms


def optimizer_bytes(param_sizes: list[int], world: int, sharding: str, nnodes: int = 1) -> int:
    """AdamW moments in fp32; zero1 gives whole parameters, largest first, to the emptiest
    rank (ZeroRedundancyOptimizer's partition), so a rank holds its largest share; hybrid does
    so over the ranks of a node."""
    shards = shard_ranks(sharding, world, nnodes)
    if shards == 1:
        return ADAM_MOMENTS * FP32 * sum(param_sizes)
    ranks = [0] * shards
    for size in sorted(param_sizes, reverse=True):
        ranks[ranks.index(min(ranks))] += size
    return ADAM_MOMENTS * FP32 * max(ranks)


def overhead_bytes(device: str, world: int) -> int:
    if device != "cuda":
        return 0
    return CUDA_CONTEXT + (NCCL_BUFFERS if world > 1 else 0)


# ---------------------------------------------------------------- activations, phase by phase


def target_forward_peak(s: Shape, layer_bytes: int) -> int:
    """The frozen target's forward (no grad): every hidden state is kept for
    output_hidden_states (and the last layer's raw output next to the normed one), with the
    rope tables; the largest layer's working set on top; then the fc features are concatenated
    and the teacher's argmax runs over chunks of rows through lm_head."""
    c, d = s.context, s.target_dtype
    hidden_states = (s.target_layers + 2) * c * s.hidden * d + 2 * c * s.head_dim * d
    layer = c * layer_bytes
    features = s.features * c * s.hidden * d
    greedy = min(GREEDY_CHUNK, c) * s.vocab * d
    return hidden_states + max(layer, features + greedy)


def target_layer_bytes(text, d: int) -> int:
    """Bytes per position of the widest working set of one target layer's forward: the MLP's
    gate, up and product, or the token mixer. A Gated DeltaNet mixer is counted as the torch
    reference runs it (fp32 per-head copies of q, k, v and the chunk transforms, 64x64 chunk
    matrices); fla's fused kernels on GPU hold less."""
    mlp = 3 * text.intermediate_size * d
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    gate = 1 if getattr(text, "attn_output_gate", False) else 0
    attention = ((2 + gate) * heads * head_dim + 2 * kv * head_dim + text.hidden_size) * d
    types = getattr(text, "layer_types", None) or []
    if "linear_attention" not in types:
        return max(mlp, attention)
    hv, dk = text.linear_num_value_heads, text.linear_key_head_dim
    dv = text.linear_value_head_dim
    conv = 2 * text.linear_num_key_heads * dk + hv * dv
    delta = (conv + hv * dv) * d + FP32 * hv * (6 * dk + 4 * dv + 3 * 64)
    return max(mlp, attention, delta)


def step_inputs(s: Shape) -> int:
    """What micro_step keeps for the whole step: the clean features and the teacher's final
    hidden (TeacherView), the noisy fp32 fc inputs, and the block embeddings."""
    c, d = s.context, s.target_dtype
    clean = (s.features + 1) * c * s.hidden * d
    noisy = s.features * c * s.hidden * FP32
    embeds = s.queries * s.hidden * d
    return clean + noisy + embeds


def noise_peak(s: Shape) -> int:
    """add_noise: an fp32 copy of the features (unless already fp32) and two fp32 temporaries."""
    copy = 0 if s.target_dtype == FP32 else FP32
    return s.features * s.context * s.hidden * (copy + 2 * FP32)


def norm_saved(rows: int, width: int, a: int, readers: int) -> int:
    """Qwen3RMSNorm's saved tensors: its fp32 input, the rescaled copy in the input dtype, and
    the fp32 output; under autocast each linear reading it saves its own low-precision cast."""
    out = FP32 if a == FP32 else readers * a
    return rows * width * (FP32 + a + out)


def head_norm_rope(rows: int, width: int, a: int) -> int:
    """q/k projection -> head RMSNorm -> rope: the norm's fp32 input and rescaled copy are
    saved; rope multiplies by tables that need no gradient, so it saves nothing."""
    return rows * width * (FP32 + a)


def chunked_attention(s: Shape, window: int | None) -> int:
    """attention.py chunked: per group of blocks, SDPA saves the queries, the keys/values of the
    context slice the group sees plus its own blocks, the mask (in q's dtype), the output and
    the logsumexp.
    A group's slice reaches up to its last anchor: worst case the whole row."""
    from workload.drafter.attention import CHUNK_QUERIES

    a = s.compute_dtype
    per_group = max(1, CHUNK_QUERIES // s.block)
    groups = math.ceil(s.anchors / per_group)
    rows = min(per_group, s.anchors) * s.block  # queries of a group, per batch row
    span = s.seq if window is None else min(s.seq, window + math.ceil(s.seq / groups))
    keys = s.rows * (span + rows)
    per_group_bytes = (
        2 * keys * s.kv_dim * a
        + s.rows * rows * (span + rows) * a
        + s.rows * rows * s.q_heads * FP32
    )
    return groups * per_group_bytes + 2 * s.queries * s.q_dim * a  # + queries and outputs


def flex_attention(s: Shape) -> int:
    """attention.py flex: rows padded to power-of-two buckets; flex saves q, k, v, the output
    (autocast dtype) and the logsumexp (fp32)."""
    from workload.drafter.attention import flex_bucket

    a = s.compute_dtype
    ctx, blk = s.rows * flex_bucket(s.seq), s.rows * flex_bucket(s.anchors * s.block)
    return 2 * (ctx + blk) * s.kv_dim * a + 2 * blk * s.q_dim * a + blk * s.q_heads * FP32


def dense_attention(s: Shape) -> int:
    """attention.py dense: one [B, 1, N*K, S+N*K] mask and SDPA over all keys at once."""
    a = s.compute_dtype
    keys = s.rows * (s.seq + s.anchors * s.block)
    per_row_q = s.anchors * s.block
    return (
        2 * keys * s.kv_dim * a
        + s.rows * per_row_q * (s.seq + per_row_q) * a
        + s.queries * s.q_heads * FP32
        + 2 * s.queries * s.q_dim * a
    )


def attention_saved(s: Shape, layer_type: str) -> int:
    window = s.window if layer_type == "sliding_attention" else None
    if s.attention == "flex":
        return flex_attention(s)
    if s.attention == "dense":
        return dense_attention(s)
    return chunked_attention(s, window)


def drafter_layer_saved(s: Shape, layer_type: str) -> int:
    """One DFlash layer's tensors kept for backward: block stream (Q rows) and context (C)."""
    q, c, a = s.queries, s.context, s.compute_dtype
    block = (
        norm_saved(q, s.hidden, a, readers=3)  # input_layernorm -> q, k, v projections
        + head_norm_rope(q, s.q_dim, a)
        + head_norm_rope(q, s.kv_dim, a)
        + q * s.q_dim * a  # attention output, flattened for o_proj
        + norm_saved(q, s.hidden, a, readers=2)  # post_attention_layernorm -> gate, up
        + 4 * q * s.intermediate * a  # gate, up, act(gate), act * up
    )
    context = (0 if a == FP32 else 2 * c * s.hidden * a) + head_norm_rope(c, s.kv_dim, a)
    return block + context + attention_saved(s, layer_type)


def outside_layers_saved(s: Shape) -> int:
    """What the drafter's forward keeps outside its layers: project_context (fc output,
    hidden_norm in fp32), the final norm and its output, the slots fed to the loss, rope
    tables."""
    q, c, a = s.queries, s.context, s.compute_dtype
    context = 3 * c * s.hidden * FP32
    final = norm_saved(q, s.hidden, a, readers=1) + q * s.hidden * FP32
    slots = s.rows * s.anchors * (s.block - 1) * s.hidden * FP32
    rope = 2 * (c * FP32 + q * s.target_dtype) * s.head_dim
    return context + final + slots + rope


def drafter_saved(s: Shape) -> int:
    """The drafter's forward, kept for backward. Without checkpointing: every layer's saved
    tensors and, under autocast, the low-precision copies of the drafter's weights (autocast
    caches them until the step leaves autocast; the graph holds them until backward). With
    checkpointing: only each layer's input (drafter/model.py clears autocast's cache of the casts after
    each layer)."""
    if s.checkpointed:
        return outside_layers_saved(s) + len(s.drafter_layers) * s.queries * s.hidden * s.residual
    a = s.compute_dtype
    layers = sum(drafter_layer_saved(s, t) for t in s.drafter_layers)
    weights = 0 if a == FP32 else s.proj_weights * a
    return outside_layers_saved(s) + layers + weights


def loss_chunk_peak(s: Shape) -> int:
    """loss.objective under activation checkpointing: one chunk of 64 blocks' logits at a time.
    Its backward holds log_softmax's fp32 output, the NLL gradient and log_softmax's gradient
    ([rows, V] fp32 each); the forward holds the logits, an fp32 copy and log_softmax's output
    (or the metrics' fp32 chunks)."""
    rows = min(LOSS_CHUNK_BLOCKS, s.rows * s.anchors) * (s.block - 1)
    a = s.compute_dtype
    forward = rows * s.vocab * (a + (0 if a == FP32 else FP32) + FP32)
    metrics = rows * s.vocab * a + 2 * min(METRIC_CHUNK, rows * s.vocab) * FP32
    backward = 3 * rows * s.vocab * FP32
    weight_cast = s.vocab * s.hidden * a if a != s.target_dtype else 0
    return max(forward, metrics, backward) + weight_cast


def layer_backward(s: Shape) -> int:
    """What a layer's backward adds to its saved tensors: the block stream's gradients through
    the MLP (two [Q, I] beyond what it frees), or the context's gradient, summed over the
    layers ([C, H] fp32, plus the one arriving and a [C, kv] one)."""
    mlp = 2 * s.queries * s.intermediate * s.compute_dtype
    context = 2 * s.context * s.hidden * FP32 + s.context * s.kv_dim * FP32
    return max(mlp, context)


def layer_recompute(s: Shape) -> int:
    """Backward of a checkpointed layer: the layer runs again and keeps, until its gradients
    are through, what it saves (the widest kind of layer) and, under autocast, the casts of
    its weights. One layer at a time."""
    a = s.compute_dtype
    saved = max(drafter_layer_saved(s, t) for t in set(s.drafter_layers))
    return saved + (0 if a == FP32 else s.layer_casts * a) + layer_backward(s)


def backward_peak(s: Shape) -> int:
    """What backward adds on top of the saved tensors: the loss chunk first, then the layers'
    gradients (each layer recomputed first, when checkpointed)."""
    layers = layer_recompute(s) if s.checkpointed else layer_backward(s)
    return max(loss_chunk_peak(s), layers)


def optimizer_step_peak(param_sizes: list[int]) -> int:
    """After backward: AdamW's temporaries, one parameter at a time on CPU (fused on GPU)."""
    return 2 * FP32 * max(param_sizes)


def activation_parts(s: Shape, layer_bytes: int, extra: int) -> dict[str, int]:
    """The peak is the largest of four moments of a step (they do not overlap); `extra` is
    the optimizer step's."""
    inputs = step_inputs(s)
    drafter = drafter_saved(s)
    loss = backward_peak(s)
    moments = {
        "target forward": target_forward_peak(s, layer_bytes),
        "noise": inputs + noise_peak(s),
        "drafter": inputs + drafter + loss,
        "optimizer step": extra,
    }
    peak = max(moments, key=moments.get)
    if peak == "drafter":
        saved = "drafter saved (checkpointed)" if s.checkpointed else "drafter saved"
        return {"step inputs": inputs, saved: drafter, "backward": loss}
    return {peak: moments[peak]}


# ---------------------------------------------------------------- the plan


def anchors_per_row(cfg: RunConfig) -> int:
    """The most anchors a row gets: num_anchors (per document), the per-row cap, and never more
    than the row has positions."""
    n = cfg.data.num_anchors
    if cfg.data.max_anchors_per_row is not None:
        n = min(n, cfg.data.max_anchors_per_row)
    return max(1, min(n, cfg.data.max_length - 1))


def cast_elements(drafter) -> tuple[int, int]:
    """Elements autocast casts to bf16 (once each, cached): all the drafter's linear weights,
    and one layer's."""

    def linear_weights(module) -> int:
        return sum(p.numel() for n, p in module.named_parameters() if n.endswith("proj.weight"))

    return linear_weights(drafter), linear_weights(drafter.layers[0])


def step_shape(cfg: RunConfig, text: Any, drafter, vocab: int, device: str) -> Shape:
    import torch

    from workload.drafter.attention import resolve_impl
    from workload.drafter.model import checkpointing_on

    dc = drafter.config
    every, layer = cast_elements(drafter)
    return Shape(
        rows=cfg.optim.batch_size,
        seq=cfg.data.max_length,
        anchors=anchors_per_row(cfg),
        block=cfg.drafter.block_size,
        hidden=text.hidden_size,
        vocab=vocab,
        features=len(drafter.target_layer_ids),
        target_layers=text.num_hidden_layers,
        q_dim=dc.num_attention_heads * dc.head_dim,
        kv_dim=dc.num_key_value_heads * dc.head_dim,
        q_heads=dc.num_attention_heads,
        head_dim=dc.head_dim,
        intermediate=dc.intermediate_size,
        drafter_layers=list(dc.layer_types),
        window=dc.sliding_window,
        target_dtype=dtype_bytes(cfg.target.dtype, device),
        compute_dtype=compute_bytes(cfg.optim.precision, device),
        attention=resolve_impl(cfg.attention, torch.device(device)),
        checkpointed=checkpointing_on(cfg.drafter.activation_checkpointing, device),
        proj_weights=every,
        layer_casts=layer,
    )


def flop_counts(target, drafter, text) -> dict[str, int]:
    """The parameter counts step_plan.step_flops reads."""
    embeds = {id(m.weight): m.weight.numel()
              for m in (target.get_input_embeddings(), target.get_output_embeddings())}  # fmt: skip
    body = sum(p.numel() for p in target.parameters()) - sum(embeds.values())
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    counts = {"target_body": body, "target_q_dim": heads * head_dim, "drafter_block": 0,
              "target_full_layers": sum(t != "linear_attention" for t in types),
              "drafter_kv": 0, "fc": drafter.fc.weight.numel()}  # fmt: skip
    for name, p in drafter.layers.named_parameters():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            counts["drafter_kv"] += p.numel()
        elif name.endswith("proj.weight"):
            counts["drafter_block"] += p.numel()
    return counts


@dataclass
class Hardware:
    """What the step-time plan assumes (step_time.py)."""

    gpu: str = "h200"
    peak_tflops: float | None = None  # overrides the table's
    mfu: float = step_plan.DEFAULT_MFU
    link_gbps: float = step_plan.DEFAULT_LINK_GBPS
    link_measured: bool = False  # link_gbps measured between the run's nodes at start


def estimate(
    cfg: RunConfig,
    target_config: Any,
    world: int,
    *,
    device: str = "cuda",
    gpu_memory: int | None = None,
    nnodes: int = 1,
    hardware: Hardware | None = None,
) -> Plan:
    """The memory plan of one rank of a `world`-rank run of `cfg` on `device` (cuda | cpu)
    over `nnodes` nodes, with its communication and step time."""
    from workload.drafter.targets import text_config

    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be cuda or cpu, not {device!r}")
    sharding = resolve_sharding(cfg.dist.sharding, world, nnodes)
    text = text_config(target_config)
    target = meta_target(target_config, dtype_bytes(cfg.target.dtype, device))
    drafter = meta_drafter(cfg, target_config, fc_layer_ids(cfg, text.num_hidden_layers))
    vocab = int(target.get_output_embeddings().weight.shape[0])
    shape = step_shape(cfg, text, drafter, vocab, device)
    sizes = [p.numel() for p in drafter.parameters()]
    layer_bytes = target_layer_bytes(text, shape.target_dtype)
    parts = activation_parts(shape, layer_bytes, optimizer_step_peak(sizes))
    terms = Terms(
        target_weights=module_bytes(target),
        drafter_params=module_bytes(drafter),
        gradients=FP32 * sum(sizes),
        optimizer=optimizer_bytes(sizes, world, sharding, nnodes),
        activations=sum(parts.values()),
        overhead=overhead_bytes(device, world),
    )
    counts = {"target": sum(p.numel() for p in target.parameters()), "drafter": sum(sizes)}
    notes = _notes(cfg, shape, world, device)
    grad_dtype = resolve_grad_comm(cfg.dist.grad_comm_dtype, device, nnodes)
    comm = step_plan.comm_bytes(sum(sizes), world, nnodes, sharding, grad_dtype)
    hw = hardware or Hardware()
    time = step_plan.step_time(
        shape, flop_counts(target, drafter, text), params=sum(sizes), world=world,
        nnodes=nnodes, sharding=sharding, grad_dtype=grad_dtype, accum=cfg.optim.grad_accum,
        gpu=hw.gpu, peak_tflops=hw.peak_tflops, mfu=hw.mfu, link_gbps=hw.link_gbps,
        link_measured=hw.link_measured,
    )  # fmt: skip
    notes.append(f"gradients all-reduced in {grad_dtype} once per step; {step_plan.NOTE}")
    length = training_length(cfg, world, time.step_s if time is not None else None)
    resume = moves.resume_cost(sum(sizes), terms.target_weights, hw.link_gbps)
    return Plan(world, sharding, device, terms, counts, gpu_memory, notes, parts, nnodes, comm,
                time, cfg.optim.grad_accum, length, resume if device == "cuda" else {})  # fmt: skip


def training_length(cfg: RunConfig, world: int, step_s: float | None) -> dict[str, Any]:
    """Steps from optim.epochs over the corpus (where data.path is readable here) or
    optim.max_steps, whichever ends first, and their time at the planned step time."""
    o = cfg.optim
    per_step = o.batch_size * world * o.grad_accum
    rows = corpus_rows(cfg.data.path) if o.epochs is not None else None
    by_epochs = math.ceil(o.epochs * rows / per_step) if o.epochs and rows else None
    steps = min((s for s in (o.max_steps, by_epochs) if s), default=None)
    return {"steps": steps, "epochs": o.epochs, "max_steps": o.max_steps, "by_epochs": by_epochs,
            "conversations": rows, "rows_per_step": per_step,
            "eta_s": steps * step_s if steps and step_s else None}  # fmt: skip


def corpus_rows(path: str | None) -> int | None:
    """Conversations in a corpus (a datagen dataset's manifest, or the lines of its JSONL
    files); None where it cannot be read here."""
    if not path:
        return None
    where = Path(path)
    manifest = where / DATASET_MANIFEST
    try:
        if manifest.is_file():
            return int(json.loads(manifest.read_text())["done"])
        files = sorted(where.glob("*.jsonl")) if where.is_dir() else [where]
        if not files or not all(f.is_file() for f in files):
            return None
        count = 0
        for f in files:
            with open(f, "rb") as lines:
                count += sum(1 for line in lines if line.strip())
        return count
    except (OSError, ValueError, KeyError, TypeError):
        return None


def length_line(length: dict[str, Any]) -> str:
    steps, epochs = length["steps"], length["epochs"]
    if epochs is not None and length["conversations"] is None:
        cap = f", at most {length['max_steps']} steps" if length["max_steps"] else ""
        return f"{epochs:g} epoch(s) of data.path (not readable here: the trainer counts it){cap}"
    how = f"optim.max_steps {steps}"
    if epochs is not None:
        how = (f"{epochs:g} epoch(s) of {length['conversations']:,} conversations at "
               f"{length['rows_per_step']} rows a step -> {length['by_epochs']:,} steps")  # fmt: skip
        if steps != length["by_epochs"]:
            how += f", ended at optim.max_steps {steps:,}"
    eta = length["eta_s"]
    return how + (f", about {eta / 3600:.1f} h at the planned step time" if eta else "")


def _notes(cfg: RunConfig, s: Shape, world: int, device: str) -> list[str]:
    notes = [
        f"rows of {s.seq} tokens, {s.rows} per micro-step, {s.anchors} anchors x block "
        f"{s.block}; attention {s.attention}; drafter matmuls in "
        f"{'fp32' if s.compute_dtype == FP32 else 'bf16'}, target in "
        f"{'fp32' if s.target_dtype == FP32 else '16-bit'}",
        "gradients: one fp32 copy, views of DDP's buckets (gradient_as_bucket_view); AdamW "
        "moments fp32",
    ]
    if s.checkpointed:
        notes.append(
            "drafter layers under activation checkpointing: each keeps its input only and is "
            "recomputed in backward (one more drafter forward per step)"
        )
    else:
        notes.append(
            "drafter.activation_checkpointing: true would keep only each drafter layer's input "
            "(one more drafter forward per step)"
        )
    if cfg.data.pack and cfg.data.max_anchors_per_row is None:
        notes.append(
            "packed rows without data.max_anchors_per_row: num_anchors is per document, so a row "
            "of several documents can take more anchors than planned; set the cap"
        )
    if device == "cuda":
        notes.append(
            "overhead: 1 GiB CUDA context and workspaces (+0.5 GiB NCCL with several ranks); "
            "leave room for the caching allocator's fragmentation"
        )
    if world > 1 and cfg.dist.sharding == "none":
        notes.append("dist.sharding none: every rank holds all AdamW moments (zero1 shards them)")
    return notes


# ---------------------------------------------------------------- command line


def gpu_of(name: str, default: str) -> str:
    """The step-time plan's GPU for a device name ("NVIDIA H200" -> h200; else `default`)."""
    name = name.lower().replace(" ", "")
    return next((g for g in step_plan.GPUS if g != "cpu" and g in name), default)


def hardware_of(device) -> Hardware:
    """The step-time plan's GPU from the device's name (h200, h100, ...; else the default),
    and the link from DFLASHOPS_LINK_GBPS when the launcher knows it."""
    import torch

    hw = Hardware()
    if getattr(device, "type", device) == "cpu":
        hw.gpu = "cpu"
    elif torch.cuda.is_available():
        hw.gpu = gpu_of(torch.cuda.get_device_name(device), hw.gpu)
    with contextlib.suppress(ValueError):  # a malformed value keeps the default
        hw.link_gbps = float(os.environ.get(LINK_ENV, hw.link_gbps))
    return hw


def device_memory(device) -> int | None:
    """Total memory of a CUDA device (None elsewhere)."""
    import torch

    if getattr(device, "type", device) != "cuda" or not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(device).total_memory)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m workload.plan", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="run config (YAML)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, as for workload.train")  # fmt: skip
    p.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per node")
    p.add_argument("--nnodes", type=int, default=1, help="nodes")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="where the ranks run (decides the auto dtypes; default cuda)")  # fmt: skip
    p.add_argument("--gpu-memory-gib", type=float, default=None, metavar="G",
                   help="memory of one GPU; the plan says whether it fits")  # fmt: skip
    p.add_argument("--target-config", default=None, metavar="PATH",
                   help="the target's config.json (default: target.path/config.json)")  # fmt: skip
    p.add_argument("--gpu", choices=sorted(step_plan.GPUS), default="h200",
                   help="the GPU the step time assumes (its bf16 peak and interconnect)")  # fmt: skip
    p.add_argument("--gpu-name", default=None, metavar="NAME",
                   help="the device's name as nvidia-smi says it (picks --gpu from it)")  # fmt: skip
    p.add_argument("--peak-tflops", type=float, default=None, metavar="T",
                   help="the GPU's dense bf16 peak, instead of the table's")  # fmt: skip
    p.add_argument("--mfu", type=float, default=step_plan.DEFAULT_MFU, metavar="F",
                   help="fraction of the peak the step reaches (default 0.5)")  # fmt: skip
    p.add_argument("--link-gbps", type=float, default=step_plan.DEFAULT_LINK_GBPS, metavar="G",
                   help="the link between nodes, Gb/s (default 25)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        if args.nproc < 1 or args.nnodes < 1:
            raise PlanError(f"--nproc and --nnodes must be >= 1, got {args.nproc}, {args.nnodes}")
        cfg = load_config(args.config, args.set)
        target_config = load_target_config(args.target_config or cfg.target.path)
        gpu = None if args.gpu_memory_gib is None else int(args.gpu_memory_gib * GIB)
        if not (0 < args.mfu <= 1) or args.link_gbps <= 0:
            raise PlanError(f"--mfu must be in (0, 1] and --link-gbps > 0, got {args.mfu}, "
                            f"{args.link_gbps}")  # fmt: skip
        gpu_name = args.gpu if args.gpu_name is None else gpu_of(args.gpu_name, args.gpu)
        hw = Hardware(gpu_name, args.peak_tflops, args.mfu, args.link_gbps)
        plan = estimate(cfg, target_config, args.nproc * args.nnodes, device=args.device,
                        gpu_memory=gpu, nnodes=args.nnodes, hardware=hw)  # fmt: skip
        mismatches = before_launch(Path(args.config), args.set) if args.config else []
    except (ConfigError, PlanError, ParityError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    if args.json:
        print(json.dumps({**plan.to_json(), "parity": mismatches}))
    else:
        print("\n".join(plan.lines() + [f"parity: {line}" for line in mismatches]))
    return 0
