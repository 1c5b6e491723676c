"""The memory plan (workload.plan) against the memory real training steps take, and its CLI.

Measuring: torch's CPU allocator reports every allocation and free to the profiler when
`profile_memory=True`, with the bytes it then holds in total (`total_allocated`, counted from
the start of profiling). The test profiles from before the run is set up to the end of its
second step and takes the largest total inside that step (the first step creates the AdamW
moments). That is the peak of memory allocated by torch, to the byte, whatever the Python
garbage collector or glibc do; RSS would add the interpreter, libraries and freed-but-kept
pages, and move by megabytes when the tensors here are a few megabytes. safetensors maps the
target's weights from the file instead of allocating them, so the test copies them into
allocator memory once profiling has begun. The allocation events are read from the profiler's
event tree, the data torch's own memory timeline (torch.profiler._memory_profiler) uses.
"""

from __future__ import annotations

import gc
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from torch.profiler import ProfilerActivity, profile, record_function

from workload import tiny
from workload.config import load_config
from workload.drafter.targets import load_target
from workload.plan import memory as plan
from workload.train import loop as T
from workload.train import step as step_module
from workload.train.step import micro_step, train_step

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "templates" / "runs" / "tiny.yaml"
TARGET_27B = REPO / "templates" / "targets" / "qwen36-27b-config.json"
RUN_27B = REPO / "templates" / "runs" / "qwen36-27b.yaml"
MIB = 1 << 20
TOLERANCE = 0.25

CHECKPOINTED = "drafter.activation_checkpointing=true"
FIVE_LAYERS = [
    "drafter.num_layers=5",
    "drafter.layer_types=[sliding_attention,sliding_attention,"
    "sliding_attention,sliding_attention,full_attention]",
    "drafter.sliding_window=64",
]
# (name, target, overrides): drafter-heavy, bf16 autocast (the GPU's dtypes), several attention
# groups, context-heavy, and target-heavy (the hybrid's Gated DeltaNet reference on CPU); then
# the drafter's layers checkpointed: the same shapes, five layers (the published layout: one
# layer recomputed at a time, not five), and weight-heavy under autocast (its bf16 weight casts
# are not kept across layers).
CASES = [
    ("dense B8 S256 N32 K8", "dense", []),
    ("dense bf16 autocast", "dense", ["optim.precision=bf16"]),
    ("dense B2 S512 N96 K8", "dense",
     ["optim.batch_size=2", "data.max_length=512", "data.num_anchors=96"]),
    ("dense B8 S512 N4 K4", "dense",
     ["data.max_length=512", "data.num_anchors=4", "drafter.block_size=4"]),
    ("hybrid B8 S256 N32 K8", "hybrid", []),
    ("hybrid B4 S512 N4 K4", "hybrid",
     ["optim.batch_size=4", "data.max_length=512", "data.num_anchors=4", "drafter.block_size=4"]),
    ("ckpt dense B8 S256 N32 K8", "dense", [CHECKPOINTED]),
    ("ckpt dense B2 S512 N96 K8", "dense",
     [CHECKPOINTED, "optim.batch_size=2", "data.max_length=512", "data.num_anchors=96"]),
    ("ckpt 5 layers bf16", "dense", [CHECKPOINTED, "optim.precision=bf16", *FIVE_LAYERS]),
    ("ckpt 5 layers bf16 B1 S64", "dense",
     [CHECKPOINTED, "optim.precision=bf16", *FIVE_LAYERS, "optim.batch_size=1",
      "data.max_length=64", "data.num_anchors=4", "drafter.block_size=4"]),
]  # fmt: skip
RESULTS: list[tuple[str, int, int, str]] = []


@pytest.fixture(scope="module")
def group():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return T.init_distributed()


@pytest.fixture(scope="module")
def long_chats(tmp_path_factory) -> Path:
    """Chats of 40 turns: rows of up to max_length tokens with supervised tokens all along them,
    so the steps run the shapes the plan assumes (tiny's own chats are ~60 tokens)."""
    r = random.Random(0)
    path = tmp_path_factory.mktemp("plan") / "long.jsonl"
    with open(path, "w") as f:
        for _ in range(48):
            messages = []
            for _ in range(40):
                user, reply = tiny.TASKS[r.choice(sorted(tiny.TASKS))](r)
                messages += [{"role": "user", "content": user},
                             {"role": "assistant", "content": reply}]  # fmt: skip
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


@pytest.fixture(scope="module", autouse=True)
def print_table():
    yield
    if RESULTS:
        print("\n\nmemory plan vs measured peak (CPU, torch allocator, second step)")
        print(f"{'config':<24} {'measured':>12} {'estimated':>12} {'ratio':>6}  estimate's peak")
        for name, measured, estimated, peak in RESULTS:
            print(f"{name:<24} {measured / MIB:>8.2f} MiB {estimated / MIB:>8.2f} MiB "
                  f"{estimated / measured:>6.3f}  {peak}")  # fmt: skip


def tiny_config(build: Path, data: Path, *overrides: str):
    made = yaml.safe_load((build / "run.yaml").read_text())
    return load_config(TEMPLATE, [
        f"target.path={made['target']['path']}", f"data.path={data}",
        f"drafter.mask_token_id={made['drafter']['mask_token_id']}", "data.pack=false",
        *overrides,
    ])  # fmt: skip


def _allocations(prof) -> tuple[list[tuple[int, int, int]], tuple[int, int]]:
    """(time, size, bytes allocated in total) of every allocation or free (negative size), and
    the measured step's span."""
    events, span = [], None
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == torch._C._profiler._EventType.Allocation:
            fields = node.extra_fields
            events.append((node.start_time_ns, fields.alloc_size, fields.total_allocated))
        elif node.name == "plan::measured_step":
            span = (node.start_time_ns, node.end_time_ns)
        stack.extend(node.children)
    return sorted(events), span


def interval_sums(run):
    """What train_step adds its sums to (a StepSums on the device where step.py has one)."""
    sums = getattr(step_module, "StepSums", None)
    return {} if sums is None else sums(run.device)


def measured_peak(cfg, group) -> int:
    """Peak bytes torch allocates during the second training step (everything alive counted).

    The allocator's running total is counted from the first profiled allocation on; it keeps
    blocks allocated while profiling and freed after it, so everything is freed before the
    profile ends, and the total before this session's first allocation is subtracted."""
    target, tokenizer = load_target(cfg.target.path, dtype=cfg.target.dtype, device="cpu")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for t in [*target.parameters(), *target.buffers()]:
            t.data = t.data.clone()  # into allocator memory (safetensors maps the file)
        run, _ = T.setup(cfg, group, say=lambda m: None, target=target, tokenizer=tokenizer)
        train_step(run, 0, interval_sums(run))
        with record_function("plan::measured_step"):
            train_step(run, 1, interval_sums(run))
        del run, target
        gc.collect()
    events, (start, end) = _allocations(prof)
    _, size, total = events[0]
    baseline = total - size
    return max(total for t, _, total in events if start <= t <= end) - baseline


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(("name", "kind", "overrides"), CASES, ids=[c[0] for c in CASES])
def test_estimate_is_within_25_percent_of_the_measured_peak(
    name, kind, overrides, tiny_dense, tiny_hybrid, long_chats, group, monkeypatch
):
    build = tiny_dense if kind == "dense" else tiny_hybrid
    cfg = tiny_config(build, long_chats, *overrides)
    widths: list[int] = []

    def recording(run, batch, *args):
        widths.append(batch.input_ids.shape[1])
        return micro_step(run, batch, *args)

    monkeypatch.setattr(step_module, "micro_step", recording)
    measured = measured_peak(cfg, group)
    # rows as planned: the widest full (a row ends before a turn whose prompt fills max_length)
    assert widths and max(widths) == cfg.data.max_length
    target_config = plan.load_target_config(cfg.target.path)
    estimate = plan.estimate(cfg, target_config, 1, device="cpu")
    peak = ", ".join(estimate.activation_parts)
    RESULTS.append((name, measured, estimate.per_rank.total, peak))
    assert abs(estimate.per_rank.total / measured - 1) <= TOLERANCE, (name, measured, estimate)


# ---------------------------------------------------------------- the command line


def run_plan(capsys, *args: str) -> tuple[int, str, str]:
    code = plan.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_says_fits_false_when_the_plan_exceeds_the_gpu(tiny_dense, capsys):
    base = ["--config", str(tiny_dense / "run.yaml"), "--nproc", "2", "--json"]
    code, out, _ = run_plan(capsys, *base, "--gpu-memory-gib", "0.5")
    small = json.loads(out)
    assert code == 0 and small["fits"] is False  # 1 GiB of CUDA context alone is over 0.5
    assert small["world"] == 2 and small["sharding"] == "zero1"  # auto with two ranks
    assert small["gpu_memory"] == plan.GIB // 2
    rank = small["per_rank"]
    parts = ("target_weights", "drafter_params", "gradients", "optimizer", "activations",
             "overhead")  # fmt: skip
    assert rank["total"] == sum(rank[k] for k in parts)
    code, out, _ = run_plan(capsys, *base, "--gpu-memory-gib", "80")
    assert code == 0 and json.loads(out)["fits"] is True
    code, out, _ = run_plan(capsys, *base)
    assert json.loads(out)["fits"] is None and json.loads(out)["gpu_memory"] is None


def test_zero1_shards_the_adamw_moments(tiny_dense):
    cfg = load_config(tiny_dense / "run.yaml", ["dist.sharding=none"])
    target_config = plan.load_target_config(cfg.target.path)
    replicated = plan.estimate(cfg, target_config, 4)
    cfg.dist.sharding = "zero1"
    sharded = plan.estimate(cfg, target_config, 4)
    moments = 8 * replicated.parameters["drafter"]
    assert replicated.per_rank.optimizer == moments
    assert moments / 4 <= sharded.per_rank.optimizer < moments / 2
    assert sharded.per_rank.total < replicated.per_rank.total


def test_fewer_anchors_per_row_plan_fewer_activations(tiny_dense):
    cfg = load_config(tiny_dense / "run.yaml")
    target_config = plan.load_target_config(cfg.target.path)
    full = plan.estimate(cfg, target_config, 1, device="cpu")
    cfg.data.max_anchors_per_row = cfg.data.num_anchors // 4
    capped = plan.estimate(cfg, target_config, 1, device="cpu")
    assert capped.per_rank.activations < full.per_rank.activations
    assert capped.per_rank.target_weights == full.per_rank.target_weights
    assert full.per_rank.overhead == 0  # no CUDA context on CPU


def test_a_config_json_alone_is_enough(tiny_dense, tmp_path):
    """The target is built on the meta device: a directory with config.json and no weights."""
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny_dense / "target" / "config.json", bare / "config.json")
    cmd = [sys.executable, "-m", "workload.plan", "--config", str(tiny_dense / "run.yaml"),
           "--set", f"target.path={bare}", "--nproc", "1", "--device", "cpu", "--json"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    target, _ = load_target(tiny_dense / "target")
    real = sum(p.numel() for p in target.parameters())
    assert result["parameters"]["target"] == real
    assert result["per_rank"]["target_weights"] == 4 * real + sum(
        b.numel() * b.element_size() for b in target.buffers()
    )


def test_missing_or_bad_target_config_is_one_line_and_exit_2(tiny_dense, tmp_path, capsys):
    run = str(tiny_dense / "run.yaml")
    code, out, err = run_plan(capsys, "--config", run, "--set", f"target.path={tmp_path}")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and str(tmp_path / "config.json") in err
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    code, _, err = run_plan(capsys, "--config", run, "--target-config", str(broken))
    assert code == 2 and err.count("\n") == 1 and "broken.json" in err
    code, _, err = run_plan(capsys, "--config", run, "--set", "optim.batch_size=zero")
    assert code == 2 and err.count("\n") == 1 and "optim.batch_size" in err


def test_qwen36_27b_on_eight_gpus(capsys):
    """The 27B template on 8 ranks: a bf16 27B target (~54 GB) and a ~1.8e9-parameter drafter.
    As the template stands (zero1, the drafter's layers checkpointed on CUDA) it fits 80 GiB
    with room for the allocator; replicated AdamW states, or the layers' activations kept, do
    not fit 80 GiB; everything fits 141 GiB."""
    base = ["--config", str(RUN_27B), "--target-config", str(TARGET_27B), "--nproc", "8",
            "--json"]  # fmt: skip
    plans = {}
    for sharding in ("none", "zero1"):
        for checkpointing in ("null", "false"):
            code, out, err = run_plan(capsys, *base, "--set", f"dist.sharding={sharding}", "--set",
                                      f"drafter.activation_checkpointing={checkpointing}",
                                      "--gpu-memory-gib", "80")  # fmt: skip
            assert code == 0, err
            plans[sharding, checkpointing] = json.loads(out)
    p = plans["zero1", "null"]
    assert 26e9 < p["parameters"]["target"] < 28e9
    assert 1.7e9 < p["parameters"]["drafter"] < 2.0e9
    assert p["per_rank"]["target_weights"] == pytest.approx(2 * p["parameters"]["target"], 1e-3)
    assert p["fits"] is True and p["per_rank"]["total"] < 75 * plan.GIB  # room for the allocator
    assert any("activation checkpointing" in n for n in p["notes"])
    assert plans["zero1", "false"]["fits"] is False
    assert plans["none", "null"]["fits"] is False
    assert all(q["per_rank"]["total"] <= 141 * plan.GIB for q in plans.values())
    none_opt = plans["none", "null"]["per_rank"]["optimizer"]
    assert none_opt / 8 <= p["per_rank"]["optimizer"] < none_opt / 7
    kept = plans["zero1", "false"]["per_rank"]["activations"]
    assert p["per_rank"]["activations"] < kept / 2  # at 8192 the target's forward is the peak


def test_the_27b_templates_length_is_one_epoch_of_the_corpus_and_its_time(capsys, tmp_path):
    """optim.epochs over the corpus given: its conversations over the rows of a step, at the
    planned step time on the stated GPUs; a corpus not readable where the plan runs is said."""
    corpus = tmp_path / "train.jsonl"
    corpus.write_text('{"messages": []}\n' * 1001)
    base = ["--config", str(RUN_27B), "--target-config", str(TARGET_27B), "--nproc", "8",
            "--gpu-name", "NVIDIA H200", "--gpu-memory-gib", "139"]  # fmt: skip
    code, out, err = run_plan(capsys, *base, "--set", f"data.path={corpus}", "--json")
    assert code == 0, err
    length = json.loads(out)["length"]
    assert (length["epochs"], length["conversations"], length["rows_per_step"]) == (1, 1001, 8)
    assert length["steps"] == 126 and length["eta_s"] > 0  # ceil(1001 / 8)
    code, out, err = run_plan(capsys, *base, "--set", f"data.path={corpus}",
                              "--set", "optim.max_steps=100")  # fmt: skip
    assert "-> 126 steps, ended at optim.max_steps 100, about " in out
    code, out, err = run_plan(capsys, *base)
    assert "training length: 1 epoch(s) of data.path (not readable here" in out


def test_checkpointing_follows_the_key_and_the_device(tiny_dense):
    """null is on for cuda and off on cpu, as the trainer resolves it; on, the plan keeps
    fewer activations and says so."""
    cfg = load_config(tiny_dense / "run.yaml")
    target_config = plan.load_target_config(cfg.target.path)
    cuda, cpu = (plan.estimate(cfg, target_config, 1, device=d) for d in ("cuda", "cpu"))
    assert "drafter saved (checkpointed)" in cuda.activation_parts
    assert "drafter saved" in cpu.activation_parts
    cfg.drafter.activation_checkpointing = True
    on = plan.estimate(cfg, target_config, 1, device="cpu")
    assert on.per_rank.activations < cpu.per_rank.activations
    assert any("recomputed in backward" in n for n in on.notes)
    assert any("activation_checkpointing: true would" in n for n in cpu.notes)


def test_the_trainer_prints_the_plan_and_writes_plan_json(tiny_dense, group, tmp_path, capsys):
    small = ["drafter.num_layers=1", "drafter.block_size=4", "data.max_length=64",
             "data.num_anchors=4", "optim.batch_size=2", "optim.max_steps=1"]  # fmt: skip
    cfg = load_config(tiny_dense / "run.yaml", small)
    assert T.train(cfg, tmp_path / "run") == 0
    printed = capsys.readouterr().out
    written = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert written["world"] == 1 and written["device"] == "cpu" and written["fits"] is None
    assert f"total per rank  {plan.gib(written['per_rank']['total'])}" in printed
    assert printed.index("recipe audit") < printed.index("memory plan")


def test_qwen36_27b_on_two_nodes_pays_at_100_gbe_not_at_25(capsys):
    """2 x 8 H200: the step-time plan's verdict for the 27B template. Only bf16 gradients cross
    the nodes (hybrid sharding keeps ZeRO's broadcast inside each), 4x fewer bytes than
    fp32 gradients plus zero1's fp32 broadcast over both nodes; at 25 GbE the second node
    still makes a step slower than one node at twice the accumulation, and the plan names the
    grad_accum that pays; at 100 GbE it pays as it is."""
    # rows of 4096 tokens (the template trains 8192): the step these numbers were stated for
    base = ["--config", str(RUN_27B), "--target-config", str(TARGET_27B), "--nproc", "8",
            "--nnodes", "2", "--gpu", "h200", "--set", "data.max_length=4096",
            "--json"]  # fmt: skip
    plans = {}
    for gbps in (25, 100):
        code, out, err = run_plan(capsys, *base, "--link-gbps", str(gbps))
        assert code == 0, err
        plans[gbps] = json.loads(out)
    code, out, err = run_plan(capsys, *base, "--set", "dist.sharding=zero1", "--set",
                              "dist.grad_comm_dtype=fp32")  # fmt: skip
    before = json.loads(out)["comm_bytes"]
    after = plans[25]["comm_bytes"]
    drafter = plans[25]["parameters"]["drafter"]
    assert plans[25]["sharding"] == "hybrid"
    assert after["inter"] == 2 * drafter and before["inter"] == 8 * drafter
    slow, fast = plans[25]["step_time"], plans[100]["step_time"]
    assert 0.5 < slow["compute_s"] < 1.2  # ~0.8 s at 50% of the bf16 peak
    assert slow["pays"] is False and slow["accum_to_pay"] in (2, 3, 4)
    assert fast["pays"] is True
    code, out, _ = run_plan(capsys, *base[:-1], "--link-gbps", "25")
    assert "SLOWER" in out and f"grad_accum {slow['accum_to_pay']} would make it pay" in out


def test_the_verdict_line_says_slower_or_faster_and_the_accum_that_pays(capsys):
    """The 27B template on 2 x 8 H200: at 25 Gb/s (measured) the line says slower, with both
    step times, the link and the grad_accum that pays, and the trainer's audit warns with it;
    at 100 Gb/s (assumed) it says faster and the audit says nothing; one node has no line."""
    from workload.plan import step_time as step_plan
    from workload.train import loop as trainer

    cfg = load_config(RUN_27B)
    cfg.data.max_length = 4096  # the rows these numbers were stated for (the template: 8192)
    target_config = plan.load_target_config(TARGET_27B)

    def plan_at(gbps: float, nnodes: int = 2, measured: bool = False) -> plan.Plan:
        hw = plan.Hardware("h200", link_gbps=gbps, link_measured=measured)
        return plan.estimate(cfg, target_config, 8 * nnodes, nnodes=nnodes, hardware=hw)

    slow, fast = plan_at(23.1, measured=True), plan_at(100)
    line = step_plan.verdict(slow.time, 2)
    t, pay = slow.time, slow.time.accum_to_pay
    assert t.pays is False and pay in (3, 4) and t.link_measured and t.step_s > t.one_node_s
    assert line == (f"2 nodes: {t.step_s:.3g} s/step against {t.one_node_s:.3g} s on one node "
                    "(grad_accum 2, the same rows) at 23.1 Gb/s (measured between the nodes): "
                    f"slower; grad_accum {pay} makes it pay")  # fmt: skip
    for accum, pays in ((pay, True), (pay - 1, False)):  # the smallest grad_accum that pays
        cfg.optim.grad_accum = accum
        assert plan_at(23.1, measured=True).time.pays is pays
    cfg.optim.grad_accum = 1
    item = trainer.scale_out_item(cfg, slow)
    assert item.level == "warn" and item.key == "optim.grad_accum" and item.note == line
    assert item.line() == f"[warn] optim.grad_accum = 1: {line}"
    assert step_plan.verdict(fast.time, 2).endswith("at 100.0 Gb/s (assumed): faster")
    assert fast.time.step_s < fast.time.one_node_s
    assert trainer.scale_out_item(cfg, fast) is None
    one = plan_at(25, nnodes=1)
    assert step_plan.verdict(one.time, 1) is None and trainer.scale_out_item(cfg, one) is None
    assert plan_at(3).time.accum_to_pay > 3  # a slower link needs more accumulation


def test_the_gpu_of_the_step_time_comes_from_the_device_name(tiny_dense, capsys):
    """launch passes nvidia-smi's name (--gpu-name): an A100 is planned at the A100's peak,
    a name the table lacks at --gpu's."""
    assert plan.gpu_of("NVIDIA A100-SXM4-80GB", "h200") == "a100"
    assert plan.gpu_of("NVIDIA H200", "a100") == "h200"
    assert plan.gpu_of("Tesla T4", "h200") == "h200"
    base = ["--config", str(tiny_dense / "run.yaml"), "--nproc", "2", "--json"]
    code, out, _ = run_plan(capsys, *base, "--gpu-name", "NVIDIA A100-SXM4-80GB")
    assert code == 0 and json.loads(out)["step_time"]["gpu"] == "a100"
