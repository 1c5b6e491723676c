"""Training-step time of workload.train, split by phase, and dense-mask vs chunked attention.

    python bench/train_step.py [--tiny DIR] [--steps 5] [--runs 3] [--precision fp32|bf16]

Part 1 trains the drafter of a tiny target (DIR from `python -m workload.tiny`, else a random
tiny dense target built here; time does not depend on the weights) with templates/runs/tiny.yaml
for --steps steps and prints the per-step median of each phase: target forward (with teacher
labels, anchors and block embeddings), drafter forward+backward (with the chunked lm_head loss
and metrics), optimizer (clip, AdamW, schedule).

Part 2 is the speed anchor of the recipe: a random Qwen3 target of hidden 256, 8 layers, vocab
4096; a 2-layer drafter, block 16; one 2048-token row with 256 anchors (and 1024/128). The full
training step runs with `attention: dense` (one [B,1,N*K,S+N*K] mask, the baseline) and
`attention: chunked`, each in its own process. Peak memory: growth of peak RSS over the first
step on CPU (ru_maxrss), torch.cuda.max_memory_allocated on GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PHASES = ("target_forward", "drafter_fwd_bwd", "optimizer")
ANCHOR_CASES = [(2048, 256), (1024, 128)]


# ---------------------------------------------------------------- building inputs


def _tokenizer():
    from workload import tiny

    r = random.Random(0)
    convs = [tiny.conversation(r)[0] for _ in range(300)]
    return tiny.build_tokenizer([tiny.chatml(c) for c in convs], vocab_size=1024)


def random_tiny(out: Path) -> Path:
    """A random-weights tiny dense target + chat data + run.yaml (the tiny build's layout)."""
    import yaml

    from workload import tiny

    tok = _tokenizer()
    model = tiny.build_model("dense", tok, seed=0)
    (out / "target").mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out / "target")
    tok.save_pretrained(out / "target")
    r = random.Random(1)
    with open(out / "data.jsonl", "w") as f:
        for _ in range(400):
            f.write(json.dumps({"messages": tiny.conversation(r)[0]}) + "\n")
    cfg = tiny.run_config(out, "dense", tok, model.config.num_hidden_layers, 0)
    (out / "run.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


def anchor_target(out: Path) -> Path:
    """The speed-anchor target (hidden 256, 8 layers, vocab 4096) and long single-doc chats."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from workload import tiny

    tok = _tokenizer()
    config = Qwen3Config(hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         vocab_size=4096, max_position_embeddings=4096, tie_word_embeddings=True,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    (out / "target").mkdir(parents=True, exist_ok=True)
    Qwen3ForCausalLM(config).save_pretrained(out / "target")
    tok.save_pretrained(out / "target")
    r = random.Random(2)
    with open(out / "data.jsonl", "w") as f:
        for _ in range(4):  # one reply of ~3000 tokens: every row is one 2048-token document
            reply = " ".join(tiny.TASKS[n](r)[1] for n in r.choices(sorted(tiny.TASKS), k=250))
            chat = [{"role": "user", "content": "Go."}, {"role": "assistant", "content": reply}]
            f.write(json.dumps({"messages": chat}) + "\n")
    return out


# ---------------------------------------------------------------- measuring (child process)


def measure(config_path: str, overrides: list[str], steps: int) -> dict:
    import torch
    import torch.distributed as dist

    from workload.config import load_config
    from workload.train import loop as T
    from workload.train.step import StepSums

    cfg = load_config(config_path, overrides)
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    d = T.init_distributed()
    run, _ = T.setup(cfg, d, say=lambda m: None)
    run.timing = True
    cuda = d.device.type == "cuda"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    per_step: list[dict] = []
    tokens = []
    for step in range(steps + 1):  # the first step is a warm-up
        run.times.clear()
        sums = StepSums(run.device)
        t0 = time.perf_counter()
        T.train_step(run, step, sums)  # run.timing: waits for the device at the end
        wall = time.perf_counter() - t0
        if step == 0:
            peak = (torch.cuda.max_memory_allocated() if cuda else
                    (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)  # fmt: skip
            continue
        per_step.append({**run.times, "step": wall})
        tokens.append(sums.to_dict()["tokens"] / wall)
    med = {k: statistics.median(s[k] for s in per_step) for k in (*PHASES, "step")}
    return {**med, "tok_s": statistics.median(tokens), "peak_mib": peak / 2**20,
            "threads": torch.get_num_threads(), "device": d.device.type}  # fmt: skip


def in_child(config_path: str, overrides: list[str], steps: int) -> dict:
    spec = json.dumps({"config": config_path, "overrides": overrides, "steps": steps})
    proc = subprocess.run([sys.executable, __file__, "--child", spec], capture_output=True,
                          text=True, check=False, cwd=ROOT)  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"child failed ({overrides}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- report


def _ms(x: float) -> str:
    return f"{1000 * x:8.0f}"


def report_tiny(res: dict) -> None:
    print(f"{'':24}{'target fwd':>11}{'drafter f+b':>12}{'optimizer':>10}{'step':>9}"
          f"{'tok/s':>8}{'peak MiB':>10}")  # fmt: skip
    print(f"{'tiny (ms, median)':<24}{_ms(res['target_forward']):>11}{_ms(res['drafter_fwd_bwd']):>12}"
          f"{_ms(res['optimizer']):>10}{_ms(res['step']):>9}{res['tok_s']:8.0f}{res['peak_mib']:10.0f}")  # fmt: skip


def report_anchor(rows: list[tuple[str, dict, dict]]) -> None:
    print(f"{'case':<16}{'phase':<17}{'dense ms':>10}{'chunked':>9}{'x':>6}")
    for case, dense, chunked in rows:
        for key in (*PHASES, "step", "peak_mib"):
            scale = 1 if key == "peak_mib" else 1000
            name = "peak MiB" if key == "peak_mib" else key
            dv, cv = dense[key] * scale, chunked[key] * scale
            print(f"{case:<16}{name:<17}{dv:>10.0f}{cv:>9.0f}{dv / max(cv, 1e-9):>6.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", help="a `python -m workload.tiny --out` directory (default: random)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per measurement")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "auto"))
    p.add_argument("--skip-anchor", action="store_true", help="part 1 only")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        spec = json.loads(a.child)
        print(json.dumps(measure(spec["config"], spec["overrides"], spec["steps"])))
        return
    results: dict = {"load_average": os.getloadavg()[0], "precision": a.precision}
    print(
        f"load average {results['load_average']:.1f}; precision {a.precision}; "
        f"medians of {a.steps} steps after one warm-up; one process per measurement"
    )
    with tempfile.TemporaryDirectory() as tmp:
        tiny_dir = Path(a.tiny) if a.tiny else random_tiny(Path(tmp) / "tiny")
        prec = f"optim.precision={a.precision}"
        res = in_child(str(tiny_dir / "run.yaml"), [prec], a.steps)
        results["tiny"] = res
        report_tiny(res)
        if not a.skip_anchor:
            base = anchor_target(Path(tmp) / "anchor")
            template = ROOT / "templates" / "runs" / "tiny.yaml"
            rows = []
            for seq_len, anchors in ANCHOR_CASES:
                common = [f"target.path={base / 'target'}", f"data.path={base / 'data.jsonl'}",
                          "drafter.num_layers=2", "drafter.block_size=16",
                          "drafter.mask_token_id=3", f"data.max_length={seq_len}",
                          f"data.num_anchors={anchors}", "optim.batch_size=1", prec]  # fmt: skip
                dense = in_child(str(template), [*common, "attention=dense"], a.steps)
                chunked = in_child(str(template), [*common, "attention=chunked"], a.steps)
                rows.append((f"S={seq_len} N={anchors}", dense, chunked))
                results[f"S{seq_len}_N{anchors}"] = {"dense": dense, "chunked": chunked}
            report_anchor(rows)
        print(f"torch threads {res['threads']}, device {res['device']}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
