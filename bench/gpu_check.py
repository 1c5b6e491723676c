"""One unattended GPU check of the trainer (a single H200): under 5 minutes, results as JSON.

    python bench/gpu_check.py --out gpu_check.json [--budget 210]   # no section starts after
    python bench/gpu_check.py --cpu-smoke --out smoke.json      # the same code paths, tiny, CPU

Sections (each in try/except: a failure is recorded with its traceback tail and the next runs):
  env        torch/CUDA/transformers/fla/triton versions, device name and memory
  flex       correctness first: compiled flex block attention (the trainer's CUDA path) against
             the dense-mask reference on random inputs, forward outputs and the gradients of
             q, context K/V and block K/V, in float32 and bfloat16, full and sliding/causal
             layers, with and without documents. Errors are max |flex - ref| / max |ref| against
             a float32 dense reference on the same (rounded) inputs. Pass: float32 <= 1e-4;
             bfloat16 <= max(3e-2, 2 x the dense path's own bfloat16 error). Then compiles:
             unique graphs after each shape, and a second pass over new shapes in the same
             row buckets must add none (rows are padded to power-of-two buckets)
  The sections of issue 17 run first: plan_27b (the step-time plan's verdict for the 27B
  template on 2 x 8 H200 at 25 and 100 GbE), fc_precision, drafter_27b, drafter_flex (which
  finds the trainer's flex kernels compiled by drafter_27b); one table of
  their numbers is printed at the end (`summary`), the JSON holds everything.
  drafter_27b  the trainer's steps at the 27B template's drafter shape on a shallow target of
             its width (bench/gpu_drafter_step.py): first step (compiles: time, shapes, graphs;
             none after it), step split, peak memory against workload.plan's estimate (ratio;
             pass within 25%)
  fc_precision  the drafter's fc (5 x 5120 -> 5120) in fp32, TF32, emulated TF32 and bf16
             against float64: output, loss, weight gradient, the training noise's effect;
             the bar and the decision optim.fc_precision's auto follows
             (bench/gpu_fc_precision.py)
  drafter_flex  flex at the 27B template's drafter shape (24/4 heads, head_dim 256, window
             2048, block 16, 512 anchors, 4096 rows; bench/gpu_drafter_flex.py): values and
             gradients against the chunked reference, first call (compile) and fwd+bwd time,
             peak memory, and no new compile for a smaller batch padded to the same maxima
  dense_1b   bf16 training steps of a 5-layer drafter against a random 1B-class Qwen3 target
             (hidden 2048, 16 layers, vocab 151936), one 4096-token row, 512 anchors, block 16:
             attention flex vs dense mask (and chunked if time allows); step time split into
             target forward / drafter forward+backward / optimizer, tokens/s, peak memory
  hybrid     the same on a small Qwen3.5-style hybrid target (Gated DeltaNet + full attention)
             whose linear layers run fla's kernels on CUDA
  fla        the small hybrid target's forward (4096 tokens) with the kernels transformers picked
             (fla's Gated DeltaNet, causal-conv1d where installed) against transformers' torch
             code on the same device, weights and tokens, in float32 and bfloat16: max |kernels -
             torch| (absolute and over max |torch|), median times and the speed-up. Pass:
             float32 relative difference <= 1e-2 (a wrong kernel, not rounding). On CPU
             (--cpu-smoke) the kernels are skipped and only the torch code runs
  target_load  host memory of loading a saved target onto the device, each way in its own
             process: load_target (device_map: each weight straight to the device) against
             from_pretrained on the CPU then .to(device); the peak of anonymous RSS while
             loading. Pass on GPU: device_map's peak under half the target's size
  multi      data parallel over 2 GPUs (nccl; gloo on CPU for --cpu-smoke), each run spawned with
             torchrun from here: 2 ranks vs 1 rank with the same global batch and seed (random
             equal-length rows, every position an anchor, no noise: the same arithmetic either
             way), the sharding `auto` gives (zero1 for 2 ranks). Losses per step, fp32 (rel.
             <= 1e-4; CPU 1e-5) and, on GPU, bf16 (<= 2e-2); the drafter's weights after the
             steps; median step time and tokens/s of each. Skipped in one line under 2 GPUs
  serve_tiny the serving benchmark (workload.serve_bench) of two checkpoints of a tiny drafter in
             vLLM's server at concurrencies 1, 4, 16: speedup, tokens/s, TPOT, tau
             (bench/gpu_serve.py); needs a vLLM environment (--vllm-python), else skipped. Last:
             `--only serve_tiny` runs it alone
Sections stop starting new measurements when the time budget is spent. Needs torch with CUDA,
transformers >= 5, and for `hybrid` flash-linear-attention with triton.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# (row length S, anchors N, sliding window, causal in block, packed documents)
FLEX_CASES = {
    "gpu": [(4000, 500, None, False, False), (3000, 400, 2048, True, True),
            (1000, 100, None, False, False)],
    "smoke": [(200, 10, None, False, False), (150, 6, 64, True, True)],
}  # fmt: skip
FLEX_SAME_BUCKETS = {"gpu": [(3900, 480), (2600, 300)], "smoke": [(190, 12)]}
FLEX_TOL = {"float32": 1e-4, "bfloat16": 3e-2}

FULL = {
    "dense": dict(hidden=2048, layers=16, heads=16, kv=8, head_dim=128, inter=6144, vocab=151936),
    "hybrid": dict(hidden=1024, layers=8, heads=8, kv=2, head_dim=128, inter=3072, vocab=32000),
    "seq_len": 4096, "anchors": 512, "block": 16, "draft_layers": 5, "steps": 5, "warmup": 2,
    "impls": ["flex", "dense", "chunked"],
}  # fmt: skip
SMOKE = {
    "dense": dict(hidden=64, layers=4, heads=4, kv=2, head_dim=16, inter=128, vocab=512),
    "hybrid": dict(hidden=64, layers=4, heads=4, kv=2, head_dim=16, inter=128, vocab=512),
    "seq_len": 256, "anchors": 32, "block": 16, "draft_layers": 2, "steps": 2, "warmup": 1,
    "impls": ["dense", "chunked"],
}  # fmt: skip


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.time() + seconds

    def left(self) -> float:
        return self.end - time.time()


def say(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- sections


def section_env(device) -> dict:
    import torch
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "cuda": torch.version.cuda,
           "device": str(device)}  # fmt: skip
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(name=props.name, memory_gib=props.total_memory / 2**30,
                   capability=f"{props.major}.{props.minor}")  # fmt: skip
    for mod in ("fla", "triton"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as exc:  # noqa: BLE001 - a missing kernel library is a finding
            out[mod] = f"unavailable: {exc}"
    return out


def _flex_inputs(S: int, N: int, docs: bool, device, dtype, seed: int, grads: bool):
    import torch

    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim, k = 8, 2, 128, 16
    anchors = torch.sort(torch.randperm(S - 1, generator=g)[:N]).values[None].repeat(2, 1)
    valid = torch.rand(2, N, generator=g) > 0.1
    doc_ids = None
    if docs:  # 4 documents per row
        doc_ids = (torch.arange(S)[None].repeat(2, 1) * 4 // S).long()
    shapes = [(heads, N * k), (kv_heads, S), (kv_heads, S), (kv_heads, N * k), (kv_heads, N * k)]
    tensors = [torch.randn(2, h, n, dim, generator=g) for h, n in shapes]
    move = dict(device=device)
    qkv = [t.to(dtype=dtype, **move).requires_grad_(grads) for t in tensors]
    extra = (anchors.to(**move), valid.to(**move), None if doc_ids is None else doc_ids.to(**move))
    return qkv, extra


def _flex_errors(case, dtype_name: str, device, grads: bool) -> dict:
    """Normalised max errors of flex and of dense (same dtype) against dense float32."""
    import torch

    from workload.drafter.attention import block_attention

    S, N, window, causal, docs = case
    dtype = getattr(torch, dtype_name)
    qkv, (anchors, valid, doc_ids) = _flex_inputs(S, N, docs, device, dtype, S + N, grads)
    exact = [t.detach().float().requires_grad_(grads) for t in qkv]  # the same rounded inputs
    weight = torch.randn(2, 8, N * 16, 128, generator=torch.Generator().manual_seed(1))
    weight = weight.to(device)
    kw = dict(anchors=anchors, anchor_valid=valid, block_size=16, doc_ids=doc_ids,
              sliding_window=window, causal_in_block=causal, scaling=128**-0.5)  # fmt: skip
    results = {}
    for name, inputs, impl in (("ref", exact, "dense"), ("flex", qkv, "flex"),
                               ("dense", qkv, "dense")):  # fmt: skip
        if name == "dense" and dtype == torch.float32:
            continue
        out = block_attention(*inputs, impl=impl, **kw)
        got = [out.float()]
        if grads:
            got += [g.float() for g in torch.autograd.grad((out.float() * weight).sum(), inputs)]
        results[name] = got
    labels = ["out", "dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"]

    def err(a, b) -> float:
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    out = {}
    for i, label in enumerate(labels[: len(results["ref"])]):
        out[label] = {"flex": err(results["flex"][i], results["ref"][i])}
        if "dense" in results:
            out[label]["dense"] = err(results["dense"][i], results["ref"][i])
    return out


def _flex_pass(errors: dict, dtype_name: str) -> bool:
    tol = FLEX_TOL[dtype_name]
    return all(e["flex"] <= max(tol, 2 * e.get("dense", 0.0)) for e in errors.values())


def section_flex(device, mode: str, budget: Budget) -> dict:
    """Compiled flex against dense (values and gradients), then compiles across shapes."""
    import torch
    from torch._dynamo.utils import counters

    import workload.drafter.attention as attention

    attention.COMPILE_FLEX = True  # the trainer's CUDA path (forced on for the CPU smoke run)
    grads = device.type == "cuda"  # flex has no backward on CPU
    dtypes = ["float32", "bfloat16"] if grads else ["float32"]
    out: dict = {"tolerance": FLEX_TOL, "grads": grads, "cases": [], "passed": True}
    for dtype_name in dtypes:
        for case in FLEX_CASES[mode]:
            if budget.left() < 30:
                out["cases"].append({"case": case, "skipped": "time budget spent"})
                continue
            t0 = time.time()
            errors = _flex_errors(case, dtype_name, device, grads)
            ok = _flex_pass(errors, dtype_name)
            out["passed"] &= ok
            graphs = counters["stats"]["unique_graphs"]
            out["cases"].append({"case": case, "dtype": dtype_name, "passed": ok, "errors": errors,
                                 "seconds": time.time() - t0, "unique_graphs": graphs})  # fmt: skip
            say(f"flex {dtype_name} {case}: {'ok' if ok else 'FAILED'} ({time.time() - t0:.0f}s)")
    before = counters["stats"]["unique_graphs"]
    for S, N in FLEX_SAME_BUCKETS[mode]:  # new shapes, buckets already compiled
        if budget.left() > 30:
            _flex_errors((S, N, None, False, False), dtypes[0], device, grads)
    out["new_graphs_for_known_buckets"] = counters["stats"]["unique_graphs"] - before
    out["recompile_limit"] = torch._dynamo.config.recompile_limit
    return out


def _target(kind: str, size: dict, device):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    common = dict(hidden_size=size["hidden"], intermediate_size=size["inter"],
                  num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                  num_key_value_heads=size["kv"], head_dim=size["head_dim"],
                  vocab_size=size["vocab"], max_position_embeddings=8192,
                  tie_word_embeddings=False, eos_token_id=1, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    if kind == "dense":
        config, cls = Qwen3Config(**common), Qwen3ForCausalLM
    else:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        layer_types = (["linear_attention"] * 3 + ["full_attention"]) * (size["layers"] // 4)
        config = Qwen3_5TextConfig(**common, layer_types=layer_types, linear_num_key_heads=4,
                                   linear_num_value_heads=8, linear_key_head_dim=64,
                                   linear_value_head_dim=64, linear_conv_kernel_dim=4)  # fmt: skip
        cls = Qwen3_5ForCausalLM
    config._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = cls(config).to(dtype)
    from workload.drafter.targets import force_torch_fallback_off_gpu

    force_torch_fallback_off_gpu(model)
    model.eval().requires_grad_(False)
    return model


def _examples(spec: dict, vocab: int, n: int = 4) -> list:
    import torch

    from workload.data.chat import Example

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(4, vocab - 1, (spec["seq_len"],), generator=g).tolist()
        out.append(Example(ids, [0] * 16 + [1] * (spec["seq_len"] - 16)))
    return out


def _measure(target, spec: dict, size: dict, impl: str, d, budget: Budget) -> dict:
    import torch

    from workload.config import load_config
    from workload.train import loop as T
    from workload.train.step import StepSums

    cfg = load_config(None, [
        "target.path=in-memory", "data.path=in-memory",
        f"drafter.num_layers={spec['draft_layers']}", f"drafter.block_size={spec['block']}",
        f"drafter.mask_token_id={size['vocab'] - 1}", f"data.max_length={spec['seq_len']}",
        f"data.num_anchors={spec['anchors']}", "optim.batch_size=1", "optim.max_steps=100",
        f"attention={impl}", "optim.precision=auto",
    ])  # fmt: skip
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=1, mask_token_id=None)
    run, _ = T.setup(cfg, d, say=lambda m: None, target=target, tokenizer=tok,
                     examples=_examples(spec, size["vocab"]))  # fmt: skip
    run.timing = True
    cuda = d.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    steps, rows = [], []
    for i in range(spec["warmup"] + spec["steps"]):
        if i >= spec["warmup"] and budget.left() < 0:
            break
        run.times.clear()
        sums = StepSums(run.device)
        start = time.perf_counter()
        loss, grad_norm, _ = T.train_step(run, i, sums)
        wall = time.perf_counter() - start
        if i == 0:
            first = wall
        if i >= spec["warmup"]:
            host = sums.to_dict()
            steps.append({**run.times, "step": wall, "tokens": host["tokens"]})
            rows.append({"loss": float(loss), "grad_norm": float(grad_norm), **_metrics(host)})
    out = {"impl": impl, "first_step_s": first, "timed_steps": len(steps),
           "drafter_params_m": sum(p.numel() for p in run.drafter.parameters()) / 1e6}  # fmt: skip
    if steps:
        for key in ("target_forward", "drafter_fwd_bwd", "optimizer", "step"):
            out[f"{key}_ms"] = 1000 * sorted(s[key] for s in steps)[len(steps) // 2]
        out["tok_s"] = sum(s["tokens"] for s in steps) / sum(s["step"] for s in steps)
        out["last"] = rows[-1]
    if cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    out["wall_s"] = time.perf_counter() - t0
    del run
    if cuda:
        torch.cuda.empty_cache()
    return out


def _metrics(sums: dict) -> dict:
    from workload.train.metrics import finalize

    return finalize(sums) if sums.get("blocks") else {}


def section_train(kind: str, spec: dict, d, budget: Budget) -> dict:
    size = spec[kind]
    t0 = time.time()
    target = _target(kind, size, d.device)
    out: dict = {"size": size, "seq_len": spec["seq_len"], "anchors": spec["anchors"],
                 "target_params_m": sum(p.numel() for p in target.parameters()) / 1e6,
                 "build_s": time.time() - t0, "impls": {}}  # fmt: skip
    impls = spec["impls"] if kind == "dense" else spec["impls"][:1]
    for impl in impls:
        if budget.left() < 30:
            out["impls"][impl] = {"skipped": "time budget spent"}
            continue
        say(f"{kind}: attention={impl}")
        try:
            out["impls"][impl] = _measure(target, spec, size, impl, d, budget)
            say(f"{kind}: {impl}: {_short(out['impls'][impl])}")
        except Exception as exc:  # noqa: BLE001 - record and go on
            out["impls"][impl] = _failure(exc)
            say(f"{kind}: {impl} FAILED: {exc}")
    return out


# ---------------------------------------------------------------- fla: kernels vs torch code

FLA = {"gpu": dict(seq_len=4096, repeats=5, dtypes=["float32", "bfloat16"]),
       "smoke": dict(seq_len=128, repeats=2, dtypes=["float32"])}  # fmt: skip
FLA_TOL = 1e-2  # float32, relative to max |torch|: catches a wrong kernel, not rounding


@contextmanager
def torch_code(model):
    """Within: the model's linear-attention and conv functions are transformers' torch code,
    whatever kernels transformers (or workload.drafter.targets' dispatcher) picked at import."""
    from workload.drafter.targets import _KERNEL_FUNCS

    saved = []
    for name in {type(m).__module__ for m in model.modules()}:
        module = sys.modules.get(name)
        for fn_name in _KERNEL_FUNCS:
            fn = getattr(module, fn_name, None)
            reference = getattr(fn, "__wrapped__", None)
            if reference is not None:
                saved.append((module, fn_name, fn))
                setattr(module, fn_name, reference)
    try:
        yield
    finally:
        for module, fn_name, fn in saved:
            setattr(module, fn_name, fn)


def kernel_sources(model) -> dict:
    """{function: the module its chosen implementation comes from} (fla, causal_conv1d, or
    transformers' own torch code when the kernel package did not import)."""
    import inspect

    from workload.drafter.targets import _KERNEL_FUNCS

    found = {}
    for name in {type(m).__module__ for m in model.modules()}:
        module = sys.modules.get(name)
        for fn_name in _KERNEL_FUNCS:
            fn = getattr(module, fn_name, None)
            if fn is None:
                continue
            for hop in ("kernel", "implementation"):  # dispatcher -> transformers' wrapper -> impl
                try:
                    fn = inspect.getclosurevars(fn).nonlocals.get(hop, fn)
                except TypeError:  # not a Python function: the implementation itself
                    break
            found[fn_name] = getattr(fn, "__module__", "?")
    return found


def _timed_forward(model, ids, repeats: int):
    """The final hidden states (float32, CPU) and the median milliseconds of `repeats` forwards
    after one warm-up (which compiles triton kernels the first time)."""
    import torch

    cuda = ids.device.type == "cuda"
    times = []
    with torch.no_grad():
        for i in range(repeats + 1):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model.model(input_ids=ids).last_hidden_state
            if cuda:
                torch.cuda.synchronize()
            if i:
                times.append(1000 * (time.perf_counter() - t0))
    return out.float().cpu(), sorted(times)[len(times) // 2]


def section_fla(mode: str, d, budget: Budget) -> dict:
    """The small hybrid target's forward: the kernels transformers picked against its torch code."""
    import torch

    spec, size = FLA[mode], (FULL if mode == "gpu" else SMOKE)["hybrid"]
    target = _target("hybrid", size, d.device)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(4, size["vocab"] - 1, (1, spec["seq_len"]), generator=gen).to(d.device)
    cuda = d.device.type == "cuda"
    out: dict = {"size": size, "seq_len": spec["seq_len"], "kernels": kernel_sources(target),
                 "tolerance": FLA_TOL, "dtypes": {}}  # fmt: skip
    if not cuda:
        out["skipped"] = "fla's kernels need a CUDA device: the torch code only"
    for dtype_name in spec["dtypes"]:
        if budget.left() < 20:
            out["dtypes"][dtype_name] = {"skipped": "time budget spent"}
            continue
        target.to(getattr(torch, dtype_name))
        with torch_code(target):
            ref, torch_ms = _timed_forward(target, ids, spec["repeats"])
        row = {"torch_ms": torch_ms, "ref_max_abs": float(ref.abs().max())}
        if cuda:
            fast, fla_ms = _timed_forward(target, ids, spec["repeats"])
            diff = float((fast - ref).abs().max())
            row.update(fla_ms=fla_ms, speedup=torch_ms / fla_ms, max_abs=diff,
                       rel=diff / max(row["ref_max_abs"], 1e-30))  # fmt: skip
            say(f"fla {dtype_name}: max |kernels - torch| {diff:.2e} (rel {row['rel']:.2e}); "
                f"{fla_ms:.1f} ms vs torch {torch_ms:.1f} ms ({row['speedup']:.1f}x)")  # fmt: skip
        else:
            say(f"fla {dtype_name}: skipped on {d.device}; torch code {torch_ms:.1f} ms")
        out["dtypes"][dtype_name] = row
    if cuda and "rel" in out["dtypes"].get("float32", {}):
        out["passed"] = out["dtypes"]["float32"]["rel"] <= FLA_TOL
    return out


def _short(r: dict) -> str:
    keys = ("step_ms", "target_forward_ms", "drafter_fwd_bwd_ms", "optimizer_ms", "tok_s",
            "peak_gib", "first_step_s")  # fmt: skip
    return ", ".join(f"{k} {r[k]:.1f}" for k in keys if k in r)


def _failure(exc: BaseException) -> dict:
    return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}


# ---------------------------------------------------------------- target_load: host memory

LOAD_SIZE = {"gpu": dict(FULL["dense"], layers=8), "smoke": SMOKE["dense"]}
_LOAD_PROBE = """
import json, sys, threading, time
import torch

def anon():
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) * 1024 for x in f if x.startswith("RssAnon:"))

base, peak, done = anon(), [0], threading.Event()

def watch():
    while not done.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.002)

threading.Thread(target=watch, daemon=True).start()
path, device, how = sys.argv[1:4]
if how == "device_map":
    from workload.drafter.targets import load_target
    model, _ = load_target(path, dtype="bfloat16", device=device)
else:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
done.set()
peak[0] = max(peak[0], anon())
size = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"peak_anon_gib": (peak[0] - base) / 2**30, "target_gib": size / 2**30,
                  "device": str(next(model.parameters()).device)}))
"""


def section_target_load(mode: str, d, out: Path) -> dict:
    """Peak host memory of loading a saved target onto the device, each way."""
    import shutil
    import subprocess

    path = out.with_suffix(".target")
    target = _target("dense", LOAD_SIZE[mode], d.device)
    target.save_pretrained(path)
    del target
    result: dict = {"size": LOAD_SIZE[mode]}
    try:
        for how in ("device_map", "load_then_move"):
            done = subprocess.run([sys.executable, "-c", _LOAD_PROBE, str(path), str(d.device), how],
                                  capture_output=True, text=True, cwd=ROOT, timeout=600,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
            if done.returncode:
                raise RuntimeError(f"{how}: {done.stderr[-2000:]}")
            result[how] = json.loads(done.stdout.strip().splitlines()[-1])
            say(f"target_load {how}: {result[how]}")
    finally:
        shutil.rmtree(path, ignore_errors=True)
    if d.device.type == "cuda":
        m = result["device_map"]
        result["passed"] = m["peak_anon_gib"] < 0.5 * m["target_gib"]
    return result


# ---------------------------------------------------------------- multi: 2 ranks vs 1

MULTI = {
    "gpu": dict(size=dict(hidden=1024, layers=8, heads=8, kv=4, head_dim=128, inter=3072,
                          vocab=32000), seq_len=512, rows=4, draft_layers=2, block=16,
                attention="dense", precisions=["fp32", "bf16"], steps=5, warmup=2),
    "smoke": dict(size=SMOKE["dense"], seq_len=64, rows=4, draft_layers=1, block=4,
                  attention="chunked", precisions=["fp32"], steps=3, warmup=1),
}  # fmt: skip
MULTI_TOL = {("gpu", "fp32"): 1e-4, ("gpu", "bf16"): 2e-2, ("smoke", "fp32"): 1e-5}


def multi_worker(spec: dict) -> int:
    """One rank (under torchrun) of a short run; rank 0 writes the per-step losses, times and
    a weight fingerprint to spec["out"]."""
    import torch
    import torch.distributed as dist

    from workload.config import DistConfig, load_config
    from workload.train import loop as T
    from workload.train.step import StepSums, train_step

    m, size = spec["multi"], spec["multi"]["size"]
    d = T.init_distributed(DistConfig(timeout_s=300))
    cfg = load_config(None, [
        "target.path=in-memory", "data.path=in-memory", f"attention={m['attention']}",
        f"drafter.num_layers={m['draft_layers']}", f"drafter.block_size={m['block']}",
        f"drafter.mask_token_id={size['vocab'] - 1}", f"data.max_length={m['seq_len']}",
        f"data.num_anchors={m['seq_len']}", f"optim.batch_size={m['rows'] // d.world}",
        "optim.max_steps=100", "noise.start=0", "noise.end=0",
        f"optim.precision={spec['precision']}",
    ])  # fmt: skip
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=1, mask_token_id=None)
    target = _target("dense", size, d.device)
    n_rows = m["rows"] * (m["steps"] + m["warmup"])
    run, _ = T.setup(cfg, d, say=lambda msg: None, target=target, tokenizer=tok,
                     examples=_examples({"seq_len": m["seq_len"]}, size["vocab"], n_rows))  # fmt: skip
    losses, times, tokens = [], [], []
    for i in range(m["warmup"] + m["steps"]):
        sums = StepSums(run.device)
        if d.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss, _, _ = train_step(run, i, sums)
        if d.device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        mean = torch.tensor([float(loss), sums.to_dict()["tokens"]], dtype=torch.float64)
        dist.all_reduce(mean, group=d.control)
        losses.append(float(mean[0]) / d.world)
        if i >= m["warmup"]:
            times.append(wall)
            tokens.append(float(mean[1]) / wall)
    weights = torch.cat([p.detach().float().flatten().cpu() for p in run.drafter.parameters()])
    if d.main:
        out = {"ranks": d.world, "backend": dist.get_backend(), "sharding": run.sharding,
               "losses": losses, "step_s": sorted(times)[len(times) // 2],
               "tok_s": sorted(tokens)[len(tokens) // 2], "weights": weights.tolist()}  # fmt: skip
        Path(spec["out"]).write_text(json.dumps(out))
    dist.destroy_process_group()
    return 0


def _spawn_multi(spec: dict, nproc: int, out: Path, budget: Budget) -> dict:
    import subprocess

    spec = {**spec, "out": str(out)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), str(Path(__file__).resolve()), "--multi-worker", json.dumps(spec)]  # fmt: skip
    if spec["mode"] == "smoke":
        cmd.append("--cpu-smoke")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if spec["mode"] == "smoke":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path (gloo) even where GPUs exist
    done = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          timeout=max(60.0, budget.left()))  # fmt: skip
    if done.returncode:
        raise RuntimeError(
            f"torchrun {nproc} ranks exited {done.returncode}: {done.stderr[-2000:]}"
        )
    return json.loads(out.read_text())


def section_multi(mode: str, budget: Budget, out: Path) -> dict:
    """2 ranks against 1 with the same global batch: equal losses and weights, and times."""
    import torch

    gpus = torch.cuda.device_count()
    if mode == "gpu" and gpus < 2:
        say(f"multi: skipped: {gpus} GPU(s) here, data parallel needs 2 or more")
        return {"skipped": f"{gpus} GPU(s)"}
    m = MULTI[mode]
    result: dict = {"spec": {k: v for k, v in m.items() if k != "size"}, "size": m["size"],
                    "passed": True, "runs": {}}  # fmt: skip
    for precision in m["precisions"]:
        if budget.left() < 60:
            result["runs"][precision] = {"skipped": "time budget spent"}
            continue
        spec = {"multi": m, "precision": precision, "mode": mode}
        one = _spawn_multi(spec, 1, out.with_suffix(f".multi1-{precision}.json"), budget)
        two = _spawn_multi(spec, 2, out.with_suffix(f".multi2-{precision}.json"), budget)
        loss_err = max(abs(a - b) / max(abs(a), 1e-12)
                       for a, b in zip(one["losses"], two["losses"], strict=True))  # fmt: skip
        w1, w2 = torch.tensor(one["weights"]), torch.tensor(two["weights"])
        weight_err = float((w1 - w2).abs().max() / w1.abs().max())
        tol = MULTI_TOL[(mode, precision)]
        ok = loss_err <= tol and weight_err <= 10 * tol
        result["passed"] &= ok
        result["runs"][precision] = {
            "loss_rel_err": loss_err, "weight_rel_err": weight_err, "tolerance": tol,
            "passed": ok, "losses": {"1": one["losses"], "2": two["losses"]},
            "sharding": {"1": one["sharding"], "2": two["sharding"]},
            "backend": two["backend"], "step_s": {"1": one["step_s"], "2": two["step_s"]},
            "tok_s": {"1": one["tok_s"], "2": two["tok_s"]},
            "efficiency": two["tok_s"] / (2 * one["tok_s"]),
        }  # fmt: skip
        say(f"multi {precision}: {'ok' if ok else 'FAILED'}: loss rel err {loss_err:.2e}, "
            f"weights {weight_err:.2e}; step {one['step_s'] * 1000:.0f} ms (1 rank) vs "
            f"{two['step_s'] * 1000:.0f} ms (2 ranks, {two['sharding']})")  # fmt: skip
    return result


# ---------------------------------------------------------------- the note's numbers


def section_plan_27b() -> dict:
    """The step-time plan's verdict for the 27B template on 2 x 8 H200 at 25 and 100 GbE (from
    the configs alone; the same on any machine)."""
    from bench.gpu_drafter_flex import RUN_27B, TARGET_27B
    from workload.config import load_config
    from workload.plan import memory as plan
    from workload.plan import step_time as step_plan

    cfg, target = load_config(RUN_27B, []), plan.load_target_config(TARGET_27B)
    out = {}
    for gbps in (25.0, 100.0):
        p = plan.estimate(cfg, target, 16, nnodes=2, hardware=plan.Hardware("h200", link_gbps=gbps))
        out[f"{gbps:g}"] = {**p.time.to_json(), "comm_bytes": vars(p.comm),
                            "verdict": step_plan.verdict(p.time, 2)}  # fmt: skip
    return out


def _num(value, fmt: str = ".3g") -> str:
    return "-" if value is None else format(value, fmt)


def summary(r: dict) -> list[str]:
    """One table of the numbers issue 17's note needs (the rest is in the JSON)."""
    out = [f"== gpu_check ({r.get('mode')}, {r.get('env', {}).get('name', 'cpu')}, torch "
           f"{r.get('env', {}).get('torch')}, {_num(r.get('wall_s'), '.0f')} s)"]  # fmt: skip
    flex = r.get("drafter_flex") or {}
    for c in flex.get("cases") or []:
        worst = max((c.get("errors") or {"-": None}).items(), key=lambda kv: kv[1] or 0)
        out.append(f"flex vs chunked at the 27B drafter shape, {c.get('kind')} {c.get('dtype')}: "
                   f"worst {worst[0]} {_num(worst[1])} ({'ok' if c.get('passed') else 'FAIL'}), "
                   f"first call {_num(c.get('first_call_s'))} s, fwd+bwd "
                   f"{_num(c.get('fwd_bwd_ms'))} ms, peak {_num(c.get('peak_gib'))} GiB")  # fmt: skip
    if flex:
        out.append(f"  flex shapes {flex.get('flex_shapes')}, new for a smaller batch "
                   f"{flex.get('new_shapes_for_a_smaller_batch')} (graphs "
                   f"{flex.get('new_graphs_for_a_smaller_batch')})")  # fmt: skip
    step = r.get("drafter_27b") or {}
    if "first_step_s" in step:
        out.append(f"trainer step at the 27B drafter shape ({step.get('attention')}): first step "
                   f"{_num(step.get('first_step_s'))} s ({step.get('flex_shapes')} new flex shapes, "
                   f"{step.get('unique_graphs')} graphs; {step.get('new_graphs_after_the_first_step')}"
                   f" new after it), step {_num(step.get('step_ms'))} ms = target "
                   f"{_num(step.get('target_forward_ms'))} + drafter fwd+bwd "
                   f"{_num(step.get('drafter_fwd_bwd_ms'))} + optimizer "
                   f"{_num(step.get('optimizer_ms'))} ms")  # fmt: skip
        out.append(
            f"  peak {_num(step.get('peak_gib'))} GiB against the plan's "
            f"{_num(step.get('plan_gib'))} GiB: ratio {_num(step.get('peak_over_plan'))}"
        )
    fc = r.get("fc_precision") or {}
    for mode, row in (fc.get("results") or {}).items():
        e = row.get("errors") or {}
        out.append(f"fc {mode:<13} out rms {_num(e.get('out_rms'))} max {_num(e.get('out_max'))}, "
                   f"loss {_num(e.get('loss'))}, wgrad rms {_num(e.get('grad_rms'))}, noise "
                   f"effect err {_num(e.get('noise_rms'))}, {_num(row.get('fwd_wgrad_ms'))} ms: "
                   f"{'within' if row.get('within_bar') else 'outside'} the bar")  # fmt: skip
    if fc:
        out.append(f"  fc decision: {fc.get('decision')} (measured on {fc.get('measured_on')}; "
                   f"bar {fc.get('bar')})")  # fmt: skip
    for gbps, row in (r.get("plan_27b") or {}).items():
        if isinstance(row, dict) and "verdict" in row:
            out.append(f"plan, 27B on 2 x 8 H200 at {gbps} GbE: {row['verdict']}")
    serve = (r.get("serve_tiny") or {}).get("summary") or {}
    for which in ("half", "last") if serve else ():
        row = serve.get(which) or {}
        speed = ", ".join(f"@{c} {_num(e.get('speedup'), '.2f')}x ({_num(e.get('spec_tok_s'))} vs "
                          f"{_num(e.get('plain_tok_s'))} tok/s)"
                          for c, e in (row.get("serve") or {}).items())  # fmt: skip
        out.append(f"serve_tiny, {which} checkpoint: tau {_num(row.get('tau'))}; {speed}")
    if "skipped" in (r.get("serve_tiny") or {}):
        out.append(f"serve_tiny: skipped ({r['serve_tiny']['skipped']})")
    for name in ("flex", "dense_1b", "hybrid", "fla", "target_load", "multi"):
        sec = r.get(name)
        if isinstance(sec, dict):
            state = "error" if "error" in sec else {True: "ok", False: "FAIL"}.get(
                sec.get("passed"), "ran")  # fmt: skip
            out.append(f"{name}: {state}")
    return out


# ---------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument(
        "--budget",
        type=float,
        default=210.0,
        help="seconds in which sections start (the last may run past it)",
    )
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU (no flex, no fla)")
    p.add_argument("--only", help="run only these sections (comma-separated names)")
    p.add_argument("--multi-worker", help=argparse.SUPPRESS)  # one rank of section multi
    p.add_argument("--vllm-python", help="a vLLM environment's python, for serve_tiny")
    a = p.parse_args()
    if a.multi_worker:
        return multi_worker(json.loads(a.multi_worker))
    import torch
    import torch.distributed as dist

    from workload.train import loop as T

    spec = SMOKE if a.cpu_smoke else FULL
    from bench.gpu_drafter_flex import section_drafter_flex
    from bench.gpu_drafter_step import section_drafter_27b
    from bench.gpu_fc_precision import section_fc_precision
    from bench.gpu_serve import section_serve_tiny

    if not a.cpu_smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke for the CPU dry run", file=sys.stderr)
        return 2
    if not dist.is_initialized():
        backend = "gloo" if a.cpu_smoke else "nccl"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    d = T.init_distributed()
    if a.cpu_smoke:
        d.device = torch.device("cpu")
    budget = Budget(a.budget)
    results: dict = {"mode": "cpu-smoke" if a.cpu_smoke else "gpu", "started": time.time()}
    mode = "smoke" if a.cpu_smoke else "gpu"
    sections = [("env", lambda: section_env(d.device)), ("plan_27b", section_plan_27b),
                ("fc_precision", lambda: section_fc_precision(d.device, a.cpu_smoke, budget)),
                ("drafter_27b", lambda: section_drafter_27b(d, a.cpu_smoke, budget)),
                ("drafter_flex", lambda: section_drafter_flex(d.device, a.cpu_smoke, budget)),
                ("flex", lambda: section_flex(d.device, mode, budget)),
                ("dense_1b", lambda: section_train("dense", spec, d, budget)),
                ("hybrid", lambda: section_train("hybrid", spec, d, budget)),
                ("fla", lambda: section_fla(mode, d, budget))]  # fmt: skip
    sections.append(("target_load", lambda: section_target_load(mode, d, Path(a.out))))
    sections.append(("multi", lambda: section_multi(mode, budget, Path(a.out))))
    sections.append(("serve_tiny", lambda: section_serve_tiny(mode, Path(a.out), a.vllm_python)))
    if a.only:
        sections = [(n, fn) for n, fn in sections if n in a.only.split(",")]
    for name, fn in sections:
        if name != "env" and budget.left() <= 0:  # the whole check stays within --budget
            results[name] = {"skipped": "time budget spent"}
            say(f"section {name}: skipped (time budget spent)")
            continue
        say(f"section {name} ({budget.left():.0f}s left)")
        try:
            results[name] = fn()
        except Exception as exc:  # noqa: BLE001
            results[name] = _failure(exc)
            say(f"section {name} FAILED: {exc}")
        Path(a.out).write_text(json.dumps(results, indent=2, default=str) + "\n")
    results["wall_s"] = time.time() - results["started"]
    Path(a.out).write_text(json.dumps(results, indent=2, default=str) + "\n")
    print("\n".join(summary(results)), flush=True)
    say(f"wrote {a.out} in {results['wall_s']:.0f}s")
    failed = [n for n, r in results.items() if isinstance(r, dict) and "error" in r]
    if results.get("drafter_27b", {}).get("passed") is False:
        failed.append("drafter_27b")
    for name in ("flex", "drafter_flex"):
        if name in results and not results[name].get("passed", False):
            failed.append(name)
    failed += [n for n in ("target_load", "multi", "fla")
               if results.get(n, {}).get("passed") is False]  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
