"""bench/gpu_check.py's `fc_precision` section: is TF32 or bf16 exact enough for the drafter's fc
(the projection of the concatenated target hidden states, [rows, taps x H] -> [rows, H]) at
the 27B template's shape (5 taps x 5120 -> 5120; 4096 rows on GPU, 32 on CPU)?

Each precision runs the fc's forward and its weight gradient as the trainer would (fp32 with
TF32 off; TF32, torch.backends.cuda.matmul.allow_tf32, on CUDA only; TF32 emulated: the operands
rounded to TF32's 10-bit mantissa and multiplied in fp32, what the tensor cores do, also on CPU;
bf16 autocast), against float64 on the same noisy inputs. The features stand in for a target's
hidden states: N(0, 1) scaled per tap to rms 1, 2, 4, 8, 16 (deeper taps are larger), with two
channels per tap at +-200 (massive activations); the training noise (uniform +-noise.start of the
template) is added before the fc, as add_noise does. The loss behind the fc is the drafter's
hidden_norm and a fixed random readout (1024 classes) with cross-entropy, in float64, so its
error is the fc's alone. Figures (each max |x - ref| / max |ref| and rms(x - ref) / rms(ref)):
the fc output, the loss (relative), the weight gradient, and the noise's own effect on the output
(fc(x + n) - fc(x)): how much of the noise the precision keeps.

The bar (BAR): output rms error <= 2^-8 (bf16's unit roundoff: the drafter's own layers run in
bf16, so the fc need not be better), loss relative error <= 1e-3, weight-gradient rms error <=
2^-8, and the noise's effect kept to 10% (its rms error <= 0.1): noise that rounds away trains
nothing. The decision: the fastest precision that meets the bar; optim.fc_precision `auto` is
that on CUDA (fp32 on CPU, where TF32 does not exist).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

BAR = {"out_rms": 2.0**-8, "loss": 1e-3, "grad_rms": 2.0**-8, "noise_rms": 0.1}
SCALES = (1.0, 2.0, 4.0, 8.0, 16.0)  # per tap, shallow to deep
OUTLIER = 200.0
CLASSES = 1024
FASTEST_FIRST = ("bf16", "tf32", "fp32")


def fc_shape() -> dict:
    """Taps, hidden size and noise of the 27B template's drafter fc, from its configs."""
    from bench.gpu_drafter_flex import RUN_27B, TARGET_27B
    from workload.config import load_config
    from workload.drafter.targets import text_config
    from workload.plan.memory import fc_layer_ids, load_target_config

    cfg = load_config(RUN_27B, [])
    text = text_config(load_target_config(TARGET_27B))
    taps = len(fc_layer_ids(cfg, text.num_hidden_layers))
    return {"taps": taps, "hidden": text.hidden_size, "noise": cfg.noise.start,
            "seq_len": cfg.data.max_length, "init_std": 0.02}  # fmt: skip


def round_tf32(t):
    """Round float32 to TF32 (10 mantissa bits, nearest even), kept in float32."""
    import torch

    bits = t.float().contiguous().view(torch.int32)
    bias = ((bits >> 13) & 1) + 0xFFF  # round half to even on the 13 bits dropped
    return ((bits + bias) & ~0x1FFF).view(torch.float32)


@contextmanager
def tf32(on: bool):
    import torch

    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def matmul(a, b, mode: str):
    """a @ b in one precision (float32 out)."""
    import torch

    if mode == "fp64":
        return a.double() @ b.double()
    if mode == "tf32_emulated":
        with tf32(False):
            return round_tf32(a) @ round_tf32(b)
    if mode == "bf16":
        with torch.autocast(a.device.type, dtype=torch.bfloat16):
            return (a.float() @ b.float()).float()
    with tf32(mode == "tf32"):
        return a.float() @ b.float()


def inputs(shape: dict, rows: int, device, seed: int = 0):
    """Features, noise, fc weight, readout and labels (float32), as the module doc says."""
    import torch

    g = torch.Generator().manual_seed(seed)
    taps, h = shape["taps"], shape["hidden"]
    scales = torch.tensor([SCALES[i % len(SCALES)] for i in range(taps)]).repeat_interleave(h)
    x = torch.randn(rows, taps * h, generator=g) * scales
    for tap in range(taps):
        x[:, tap * h + torch.randint(h, (2,), generator=g)] = OUTLIER
    noise = (torch.rand(x.shape, generator=g) * 2 - 1) * shape["noise"]
    weight = torch.randn(h, taps * h, generator=g) * shape["init_std"]
    readout = torch.randn(CLASSES, h, generator=g) / h**0.5
    labels = torch.randint(CLASSES, (rows,), generator=g)
    return [t.to(device) for t in (x, noise, weight, readout, labels)]


def head_loss(y, readout, labels):
    """hidden_norm (RMSNorm, unit weight) and cross-entropy of a fixed readout, float64."""
    import torch.nn.functional as F

    y = y.double()
    normed = y * (y.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()
    return F.cross_entropy(normed @ readout.double().T, labels)


def run_mode(mode: str, x, noise, weight, readout, labels) -> dict:
    """Output (noisy and clean), loss and weight gradient of the fc in `mode`."""
    import torch

    noisy = x + noise
    out, clean = matmul(torch.cat([noisy, x]), weight.T, mode).chunk(2)  # one weight cast
    y = out.detach().double().requires_grad_(True)
    loss = head_loss(y, readout, labels)
    (gy,) = torch.autograd.grad(loss, y)
    grad = matmul(gy.float().T if mode != "fp64" else gy.T, noisy, mode)
    return {"out": out, "effect": out.double() - clean.double(), "loss": float(loss.detach()),
            "grad": grad}  # fmt: skip


def errors(got: dict, ref: dict) -> dict:
    def rel(a, b) -> tuple[float, float]:
        d = a.double() - b.double()
        return (float(d.abs().max() / b.abs().max().clamp_min(1e-300)),
                float(d.pow(2).mean().sqrt() / b.double().pow(2).mean().sqrt()))  # fmt: skip

    out = {}
    for key in ("out", "grad"):
        out[f"{key}_max"], out[f"{key}_rms"] = rel(got[key], ref[key])
    out["noise_max"], out["noise_rms"] = rel(got["effect"], ref["effect"])
    out["loss"] = abs(got["loss"] - ref["loss"]) / abs(ref["loss"])
    return out


def timed_ms(mode: str, x, weight, device) -> float | None:
    """Median ms of the fc's forward and weight gradient (two matmuls) on CUDA."""
    import torch

    if device.type != "cuda":
        return None
    times = []
    for i in range(6):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        y = matmul(x, weight.T, mode)
        matmul(y.T, x, mode)
        torch.cuda.synchronize(device)
        if i:
            times.append(1000 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def decide(results: dict) -> str:
    """The fastest precision within BAR (fp32 when none other is; emulated TF32 stands for
    TF32 where no GPU measured it)."""
    for mode in FASTEST_FIRST:
        names = ["tf32", "tf32_emulated"] if mode == "tf32" else [mode]
        row = next((results[n] for n in names if "errors" in results.get(n, {})), None)
        if row is not None and row["within_bar"]:
            return mode
    return "fp32"


def section_fc_precision(device, smoke: bool, budget) -> dict:
    shape = fc_shape()
    rows = 32 if smoke else shape["seq_len"]
    x, noise, weight, readout, labels = inputs(shape, rows, device)
    ref = run_mode("fp64", x, noise, weight, readout, labels)
    modes = ["fp32", "tf32_emulated", "bf16"]
    if device.type == "cuda":
        modes.insert(1, "tf32")
    out: dict = {"shape": shape, "rows": rows, "bar": BAR, "results": {}}
    for mode in modes:
        if budget.left() < 10:
            out["results"][mode] = {"skipped": "time budget spent"}
            continue
        errs = errors(run_mode(mode, x, noise, weight, readout, labels), ref)
        row = {"errors": errs, "within_bar": all(errs[k] <= v for k, v in BAR.items()),
               "fwd_wgrad_ms": timed_ms(mode, x + noise, weight, device)}  # fmt: skip
        out["results"][mode] = row
    out["decision"] = decide(out["results"])
    out["measured_on"] = device.type
    return out
