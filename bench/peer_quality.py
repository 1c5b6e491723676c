"""Drafter quality against a peer trainer: ours and vLLM speculators' DFlash trainer, same
target, same token rows, same drafter, same steps; both served in vLLM on the same prompts.

    PYTHONPATH=. python bench/peer_quality.py [--build DIR] [--steps 200] [--prompts 24]
        [--max-new-tokens 128] [--speculators-site /tmp/speculators-site]
        [--vllm-python PY] [--out DIR] [--json FILE]

What it measures: τ (acceptance length: tokens committed per verify step) in vLLM of two
drafters trained the same number of steps on the same tiny target (`python -m workload.tiny`,
default: the tests' newest cached dense build, else a fresh one under --out) and the same
conversations, plus each trainer's wall time. The Markdown table at the end has, per trainer:
steps, training wall time, τ in vLLM on the build's held-out prompts (prompts.jsonl, never
trained on) with its standard error over prompts, our simulated τ (workload/eval/decode.py) of the
same drafter, and the settings in which it departs from the other.

- ours: `python -m workload.train` with templates/runs/tiny.yaml (its loss, AdamW, schedule).
- speculators (PyPI `speculators==0.9.0`, imported from --speculators-site, installed there
  with `pip install --no-deps --target DIR speculators==0.9.0 datasets==5.1.0 openai
  hs-connectors==0.9.0 dill multiprocess pandas pydantic-settings python-dotenv loguru`, what it
  imports at module level, never into the workload's venv): its
  `DFlashDraftModel` (draft layer config from its `create_transformer_layer_config`), its loss
  (`get_trainer_kwargs`: CE with D-PACE position weights, its DFlash defaults; the eager loss,
  its fused one is Triton), its optimizers (`build_optimizers`: Muon + AdamW, its default) and
  a cosine schedule with warmup (transformers', as its Trainer builds it), attention "sdpa"
  (its flex default has no backward on CPU). Its `Trainer` cannot run on CPU (it moves the
  model to `local_rank` and calls `torch.accelerator.synchronize()`), so this bench drives the
  model with a loop of the Trainer's own step: forward, zero_grad, backward, clip 1.0, optimizer
  steps, scheduler steps. Its data are offline hidden states, computed here from the same target
  in transformers, in the layout its ArrowDataset returns (`hidden_states` = the target layers'
  outputs at its `aux_hidden_state_layer_ids` = our `target_layer_ids` + 1, concatenated;
  `verifier_last_hidden_states` = the last decoder layer's output before the final norm), for
  the very token rows our trainer reads (our token store: same chat template, max_length), a
  batch packed as its collate packs one (rows side by side, `document_ids`, max_anchors = our
  num_anchors per row times the batch), cut at the batch's own length rather than padded to a
  fixed total_seq_len (padding is masked out; only the last row's final block_size positions,
  never anchors in its sampler, would differ).
- serving: speculators' trained weights are converted into our checkpoint format (config.json
  with dflash_config; the same keys: its embed_tokens and lm_head are the frozen verifier's and
  are not saved, as ours), its own format is saved beside it (speculators/). One
  `python -m workload.eval --engine vllm` run serves the target alone, then with our drafter,
  then with speculators' (`--reference`): same engine, prompts, greedy, max new tokens.

The bar (issue 23): our τ is not below speculators' at equal steps, with a tolerance of one
standard error of the difference of the two means over prompts (the prompts differ far more
from each other than the engine's runs do; vLLM greedy on CPU is deterministic).
Exit status: 0 the bar holds, 3 it fails, 1 a step failed (one line saying which).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "templates" / "runs" / "tiny.yaml"
VLLM_PYTHON = (
    ROOT / ".dflashops" / "workspace" / "dflashops" / "engines" / "vllm" / "bin" / "python"
)
SPEC_VERSION = "0.9.0"


class BenchError(Exception):
    pass


def say(message: str) -> None:
    print(f"peer: {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- inputs


def _cache() -> Path:
    root = os.environ.get("DFLASHOPS_TEST_CACHE") or Path(tempfile.gettempdir()) / "dflashops-tests"
    return Path(root)


def find_build(given: Path | None, out: Path) -> Path:
    """The tiny build: --build, else the tests' newest cached dense one, else a new one."""
    if given is not None:
        if not (given / "run.yaml").is_file():
            raise BenchError(f"--build {given}: no run.yaml (not a `workload.tiny` build)")
        return given
    done = [p for p in _cache().glob("tiny-dense-*") if p.is_dir() and "." not in p.name]
    done = [p for p in done if (p / "run.yaml").is_file() and (p / "prompts.jsonl").is_file()]
    if done:
        return max(done, key=lambda p: p.stat().st_mtime)
    build = out / "tiny"
    if not (build / "run.yaml").is_file():
        say(f"building the tiny target in {build} (python -m workload.tiny)")
        run([sys.executable, "-m", "workload.tiny", "--out", str(build)], "workload.tiny")
    return build


def run(argv: list[str], what: str) -> float:
    """Run a workload command from the repository root; its wall time in seconds."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env, timeout=7200)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise BenchError(f"{what} failed (exit {done.returncode}): {tail}")
    return wall


def write_run_config(build: Path, steps: int, out: Path) -> Path:
    """The tiny template with the build's target, data and mask token, `steps` steps."""
    made = yaml.safe_load((build / "run.yaml").read_text())
    cfg = yaml.safe_load(TEMPLATE.read_text())
    cfg["target"]["path"] = made["target"]["path"]
    cfg["data"]["path"] = made["data"]["path"]
    cfg["data"]["pack"] = bool(made["data"].get("pack", False))
    cfg["drafter"]["mask_token_id"] = made["drafter"]["mask_token_id"]
    cfg["drafter"]["target_layer_ids"] = made["drafter"].get("target_layer_ids")
    cfg["optim"]["max_steps"] = steps
    cfg["checkpoint"]["every"] = steps
    path = out / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


# ----------------------------------------------------------------------------- ours


def train_ours(config: Path, steps: int, out: Path) -> dict:
    run_dir = out / "ours"
    shutil.rmtree(run_dir, ignore_errors=True)
    say(f"ours: python -m workload.train, {steps} steps")
    wall = run([sys.executable, "-m", "workload.train", "--config", str(config),
                "--run-dir", str(run_dir)], "workload.train")  # fmt: skip
    checkpoint = run_dir / "checkpoints" / f"step_{steps}"
    if not (checkpoint / "config.json").is_file():
        raise BenchError(f"workload.train wrote no {checkpoint}")
    return {"trainer": "ours", "steps": steps, "train_wall_s": wall, "checkpoint": checkpoint}


# ----------------------------------------------------------------------------- speculators


def import_speculators(site: Path):
    """speculators from `site` (appended to sys.path: nothing there shadows the workload's own
    packages); its DFlash model, loss kwargs, optimizers and layer-config builder."""
    if not (site / "speculators").is_dir():
        raise BenchError(
            f"--speculators-site {site}: no speculators package (pip install --no-deps "
            f"--target {site} speculators=={SPEC_VERSION} datasets==5.1.0 openai "
            "hs-connectors==0.9.0 dill multiprocess pandas pydantic-settings python-dotenv loguru)"
        )
    if str(site) not in sys.path:
        sys.path.append(str(site))
    try:
        from speculators.models.dflash.core import DFlashDraftModel
        from speculators.train.cli import create_transformer_layer_config
        from speculators.train.optimizers import build_optimizers
        from speculators.train.trainer import TrainerConfig
    except ImportError as exc:
        raise BenchError(f"cannot import speculators from {site}: {exc}") from None
    version = importlib.metadata.version("speculators")
    if version != SPEC_VERSION:
        say(f"warning: speculators {version}; the bench was written for {SPEC_VERSION}")
    return DFlashDraftModel, create_transformer_layer_config, build_optimizers, TrainerConfig


class HiddenStates:
    """Offline hidden states of our token rows, from the target in transformers, in the layout
    speculators' ArrowDataset hands its model (one row: [T, n_aux * hidden], [T, hidden])."""

    def __init__(self, target_path: str, layer_ids: list[int]) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            target_path, dtype=torch.float32, local_files_only=True
        ).eval()
        self.layer_ids = layer_ids
        self.rows: dict[int, tuple] = {}
        self.seconds = 0.0
        self._last = None
        self.model.model.layers[-1].register_forward_hook(self._keep_last)

    def _keep_last(self, _module, _args, output) -> None:
        self._last = output[0] if isinstance(output, tuple) else output

    def row(self, i: int, ids: list[int]) -> tuple:
        if i not in self.rows:
            torch = self.torch
            t0 = time.perf_counter()
            with torch.no_grad():
                out = self.model(torch.tensor([ids]), output_hidden_states=True)
            hs = out.hidden_states  # hs[k + 1]: output of decoder layer k
            aux = torch.cat([hs[k + 1][0] for k in self.layer_ids], dim=-1)
            self.rows[i] = (aux, self._last[0].clone())  # the last layer's output, pre-norm
            self.seconds += time.perf_counter() - t0
        return self.rows[i]


def pack(rows: list[tuple], total: int, torch) -> dict:
    """Rows side by side in one [1, total] sequence, as speculators' CollateFn packs a batch:
    document_ids per row, -1 on padding, positions restarting per row."""
    n_aux = rows[0][1].shape[-1]
    hidden = rows[0][2].shape[-1]
    batch = {
        "hidden_states": torch.zeros(total, n_aux),
        "input_ids": torch.zeros(total, dtype=torch.long),
        "verifier_last_hidden_states": torch.zeros(total, hidden),
        "loss_mask": torch.zeros(total, dtype=torch.long),
        "position_ids": torch.zeros(total, dtype=torch.long),
        "document_ids": torch.full((total,), -1, dtype=torch.long),
    }
    at = 0
    for doc, (ex, aux, last) in enumerate(rows):
        n = min(len(ex.input_ids), total - at)
        sl = slice(at, at + n)
        batch["hidden_states"][sl] = aux[:n]
        batch["input_ids"][sl] = torch.tensor(ex.input_ids[:n])
        batch["verifier_last_hidden_states"][sl] = last[:n]
        batch["loss_mask"][sl] = torch.tensor(ex.loss_mask[:n])
        batch["position_ids"][sl] = torch.arange(n)
        batch["document_ids"][sl] = doc
        at += n
    return {k: v.unsqueeze(0) for k, v in batch.items()}


def train_speculators(config: Path, ours_ckpt: Path, steps: int, site: Path, out: Path) -> dict:
    """speculators' model, loss and optimizers on our token rows, `steps` steps of its Trainer's
    step; saved in its own format and converted into ours. Timed: the hidden states, the loop."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, get_cosine_schedule_with_warmup

    from workload.config import load_config
    from workload.data.inspect_rows import open_store, read_settings

    model_cls, layer_config_of, build_optimizers, trainer_config = import_speculators(site)
    cfg = load_config(config)
    ours = json.loads((ours_ckpt / "config.json").read_text())
    dflash = ours["dflash_config"]
    layer_ids, mask_id, block = (
        dflash["target_layer_ids"],
        dflash["mask_token_id"],
        ours["block_size"],
    )
    target = str(cfg.target.path)
    batch_size, anchors = cfg.optim.batch_size, cfg.data.num_anchors
    torch.manual_seed(cfg.seed)

    t_all = time.perf_counter()
    layer_config = layer_config_of(
        target, num_layers=ours["num_hidden_layers"], draft_arch="qwen3", hidden_act=None,
        sliding_window=cfg.data.max_length,
        full_attention_indices=list(range(ours["num_hidden_layers"])),  # ours: all full
    )  # fmt: skip
    model = model_cls.from_training_args(
        verifier_config=layer_config, draft_vocab_size=layer_config.vocab_size,
        block_size=block, verifier_name_or_path=target,
        target_layer_ids=[k + 1 for k in layer_ids],  # its ids: hidden_states index
        mask_token_id=mask_id, draft_attn_impl="sdpa",
    )  # fmt: skip
    call_kwargs, _ = model.get_trainer_kwargs(
        loss_fn="ce", loss_implementation="eager", max_anchors=anchors * batch_size,
        per_position_loss_weight="dpace",
    )  # fmt: skip
    tc = trainer_config(lr=cfg.optim.lr, num_epochs=1, save_path=str(out / "speculators"),
                        optimizer="muon", weight_decay=0.01, muon_lr=cfg.optim.lr,
                        scheduler_type="cosine", scheduler_warmup_ratio=cfg.optim.warmup_ratio,
                        hidden_states_dtype=torch.float32, max_steps=steps)  # fmt: skip
    optimizers = build_optimizers(model, tc)
    warmup = int(steps * cfg.optim.warmup_ratio)
    schedulers = [get_cosine_schedule_with_warmup(o, warmup, steps) for o in optimizers]

    settings = read_settings(str(config), [])
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    store = open_store(tokenizer, settings)
    states = HiddenStates(target, layer_ids)
    order: list[int] = []
    rng = random.Random(cfg.seed)
    model.train()
    say(f"speculators: {steps} steps, {batch_size} rows a step packed side by side")
    t_loop, losses = 0.0, []
    for step in range(1, steps + 1):
        picked = []
        for _ in range(batch_size):
            if not order:
                order = list(range(len(store)))
                rng.shuffle(order)
            i = order.pop()
            ex = store.example(i)
            picked.append((ex, *states.row(i, ex.input_ids)))
        batch = pack(picked, sum(len(x[0].input_ids) for x in picked), torch)
        t0 = time.perf_counter()
        _, loss, _ = model(**batch, **call_kwargs)
        for o in optimizers:
            o.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for o in optimizers:
            o.step()
        for s in schedulers:
            s.step()
        t_loop += time.perf_counter() - t0
        losses.append(float(loss.detach()))
        if step % 50 == 0 or step == steps:
            say(f"speculators: step {step} loss {statistics.fmean(losses[-50:]):.3f}")
    wall = time.perf_counter() - t_all

    native = out / "speculators"
    shutil.rmtree(native, ignore_errors=True)
    model.save_pretrained(native)
    converted = out / "speculators-as-ours"
    shutil.rmtree(converted, ignore_errors=True)
    converted.mkdir(parents=True)
    check_same_layout(model.config, ours, layer_ids)
    shutil.copy(ours_ckpt / "config.json", converted / "config.json")
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    keep = set(load_keys(ours_ckpt))
    missing = keep - set(state)
    if missing:
        raise BenchError(f"speculators' model has no {sorted(missing)[:3]} (conversion)")
    save_file({k: state[k] for k in sorted(keep)}, str(converted / "model.safetensors"))
    return {"trainer": f"speculators {SPEC_VERSION}", "steps": steps, "train_wall_s": wall,
            "loop_s": t_loop, "hidden_states_s": states.seconds, "final_loss": losses[-1],
            "checkpoint": converted, "native": native}  # fmt: skip


def load_keys(checkpoint: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        return list(f.keys())


def check_same_layout(spec_config, ours: dict, layer_ids: list[int]) -> None:
    """speculators' drafter has our checkpoint's layout (so our config.json describes it)."""
    tl = spec_config.transformer_layer_config
    pairs = {
        "num_hidden_layers": tl.num_hidden_layers, "hidden_size": tl.hidden_size,
        "intermediate_size": tl.intermediate_size, "num_attention_heads": tl.num_attention_heads,
        "num_key_value_heads": tl.num_key_value_heads, "head_dim": tl.head_dim,
        "rms_norm_eps": tl.rms_norm_eps, "block_size": spec_config.block_size,
    }  # fmt: skip
    wrong = [f"{k} {v} vs ours {ours.get(k)}" for k, v in pairs.items() if v != ours.get(k)]
    if [k - 1 for k in spec_config.aux_hidden_state_layer_ids] != layer_ids:
        wrong.append(f"aux_hidden_state_layer_ids {spec_config.aux_hidden_state_layer_ids}")
    if spec_config.mask_token_id != ours["dflash_config"]["mask_token_id"]:
        wrong.append(f"mask_token_id {spec_config.mask_token_id}")
    if wrong:
        raise BenchError("speculators' drafter differs from ours: " + "; ".join(wrong))


# ----------------------------------------------------------------------------- serving


def evaluate(config: Path, ours: Path, theirs: Path, args: argparse.Namespace, out: Path) -> dict:
    result = out / "eval.json"
    say(f"vLLM: the target alone, with ours, with speculators' ({args.prompts} prompts)")
    argv = [sys.executable, "-m", "workload.eval", "--config", str(config),
            "--checkpoint", str(ours), "--reference", str(theirs), "--engine", "vllm",
            "--vllm-python", str(args.vllm_python), "--max-prompts", str(args.prompts),
            "--max-new-tokens", str(args.max_new_tokens), "--out", str(result)]  # fmt: skip
    run(argv, "workload.eval --engine vllm")
    return json.loads(result.read_text())


def per_prompt(records: list[dict], part: str) -> list[float]:
    """vLLM's τ of each prompt for one drafter (the eval's prompt records)."""
    found = []
    for r in records:
        x = r.get(part) or {}
        tau = (x.get("vllm") or {}).get("tau") if isinstance(x.get("vllm"), dict) else None
        found.append(tau if tau is not None else x.get("tau"))
    return [t for t in found if t is not None]


def stderr(xs: list[float]) -> float | None:
    return statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else None


# ----------------------------------------------------------------------------- report


DIFFERENT = {
    "ours": "loss CE on data tokens, decay weights gamma 7; AdamW betas (0.9, 0.95), "
    "weight decay 0; cosine to min_lr 1e-4; 32 anchors per row",
    "speculators": "loss CE on the target's argmax, D-PACE weights (its DFlash default); "
    "Muon (2-D weights) + AdamW betas (0.9, 0.999), weight decay 0.1 / 0.01 (its default); "
    "cosine to 0; anchors drawn over the packed batch",
}
EQUAL = ("target, token rows (our store: chat template, max_length), drafter layout (layers, "
         "hidden, heads, block size, target_layer_ids, mask token, all-full attention), steps, "
         "rows per step, peak lr and warmup, grad clip 1.0, float32, anchors per step")  # fmt: skip


def table(rows: list[dict]) -> str:
    head = ("| trainer | steps | train wall s | τ vLLM (± se) | τ simulated | differs in |\n"
            "|---|---|---|---|---|---|")  # fmt: skip
    lines = [head]
    for r in rows:
        se = f" ± {r['tau_se']:.3f}" if r.get("tau_se") is not None else ""
        sim = f"{r['tau_sim']:.3f}" if r.get("tau_sim") is not None else "-"
        lines.append(f"| {r['trainer']} | {r['steps']} | {r['train_wall_s']:.1f} | "
                     f"{r['tau_vllm']:.3f}{se} | {sim} | {r['differs']} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--build", type=Path, help="a `workload.tiny` build (default: the tests' cache)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--prompts", type=int, default=24, help="held-out prompts served (first N)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--speculators-site", type=Path, default=Path("/tmp/speculators-site"))
    p.add_argument(
        "--vllm-python",
        type=Path,
        default=Path(os.environ.get("DFLASHOPS_VLLM_PYTHON") or VLLM_PYTHON),
    )
    p.add_argument("--out", type=Path, help="work directory (default: a temporary one, kept)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.steps < 1 or args.prompts < 1:
        p.error("--steps and --prompts must be >= 1")
    if not args.vllm_python.is_file():
        p.error(f"--vllm-python {args.vllm_python}: no such file")
    out = args.out or Path(tempfile.mkdtemp(prefix="peer-quality-"))
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        build = find_build(args.build, out)
        say(f"tiny build {build}; work in {out}")
        config = write_run_config(build, args.steps, out)
        ours = train_ours(config, args.steps, out)
        theirs = train_speculators(config, ours["checkpoint"], args.steps,
                                   args.speculators_site, out)  # fmt: skip
        result = evaluate(config, ours["checkpoint"], theirs["checkpoint"], args, out)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    ref = result.get("reference") or {}
    records = result.get("prompts") or []
    ours.update(tau_vllm=result["tau"], tau_sim=(result.get("simulation") or {}).get("tau"),
                per_prompt=per_prompt(records, "checkpoint"), differs=DIFFERENT["ours"])  # fmt: skip
    theirs.update(tau_vllm=ref["tau"], tau_sim=(ref.get("simulation") or {}).get("tau"),
                  per_prompt=per_prompt(records, "reference"),
                  differs=DIFFERENT["speculators"])  # fmt: skip
    for r in (ours, theirs):
        r["tau_se"] = stderr(r["per_prompt"])
    diff = [a - b for a, b in zip(ours["per_prompt"], theirs["per_prompt"], strict=False)]
    tol = stderr(diff) or 0.0
    verdict = ours["tau_vllm"] >= theirs["tau_vllm"] - tol
    print(table([ours, theirs]))
    print(f"\nequal: {EQUAL}.")
    print(
        f"speculators' wall: {theirs['hidden_states_s']:.1f} s hidden states (transformers), "
        f"{theirs['loop_s']:.1f} s in its steps; ours is the whole `workload.train` process."
    )
    print(
        f"held-out prompts: {len(diff)} of {build / 'prompts.jsonl'}, "
        f"max {args.max_new_tokens} new tokens, vLLM {result.get('engine', {}).get('version')}"
    )
    print(f"bar: our τ ≥ speculators' τ − {tol:.3f} (one standard error of the per-prompt "
          f"difference): {'holds' if verdict else 'FAILS'}")  # fmt: skip
    if args.json:
        keep = ("trainer", "steps", "train_wall_s", "tau_vllm", "tau_se", "tau_sim", "differs",
                "per_prompt", "loop_s", "hidden_states_s", "final_loss")  # fmt: skip
        doc = {"rows": [{k: r.get(k) for k in keep} for r in (ours, theirs)],
               "equal": EQUAL, "tolerance": tol, "bar_holds": verdict, "build": str(build),
               "prompts": len(diff), "max_new_tokens": args.max_new_tokens,
               "vllm": result.get("engine"), "out": str(out)}  # fmt: skip
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if verdict else 3


if __name__ == "__main__":
    sys.exit(main())
