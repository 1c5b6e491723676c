"""Train-to-serve parity: what the drafter was trained on against what it will be served with.

    python -m workload.parity --config RUN.yaml [--checkpoint DIR] [--vllm-python PY]
        [--eval-kwargs JSON] [--num-speculative-tokens N] [--given FILE|-] [--gather-only] [--json]

A drafter that trains well and serves badly is most often one whose serving differs from its
training in a setting nobody compared: the thinking switch of the chat template (dflash#133:
acceptance 25% -> 60% once it matched), the block size against the engine's
num_speculative_tokens, a mask token outside the vocabulary, layer taps read in another
convention, sliding layers an engine version does not serve. This program gathers those
settings where it runs (facts) and names each disagreement with both sides, one line each.

Facts come from the run's config (what training rendered with), its dataset's manifest (what
the data was made with), the checkpoint's config.json, the target model (vocabulary, layers, its
tokenizer's chat template: what an engine serves with by default) and the engine (its version,
whether its DFlash model serves sliding layers; the kwargs it renders with by default: none).
The training and eval targets are often two machines: `--gather-only` prints the facts found
here, and `--given` takes such facts from elsewhere (what is found here wins).

Chat settings are compared by what they render, not by their text: the serving prompt of a
probe conversation (two user turns, the first answered with reasoning) under each side's
template and kwargs. {} and {"enable_thinking": true} agree where the template's default is
thinking on; they disagree where it is off.

Exit 0: no mismatch; 2: one or more (each printed as `parity: LINE`), or bad input.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workload.common.layout import DATASET_MANIFEST
from workload.eval.errors import EvalError
from workload.eval.run_settings import load_run_settings

PROBE = [
    {"role": "user", "content": "parity question one"},
    {
        "role": "assistant",
        "content": "parity answer one",
        "reasoning_content": "parity reasoning one",
    },
    {"role": "user", "content": "parity question two"},
]
# what an engine's DFlash model serves: its version and whether it reads layer_types' sliding
ENGINE_PROBE = """
import inspect, json
import vllm
out = {"name": "vllm", "version": vllm.__version__, "sliding": None}
try:
    from vllm.model_executor.models import qwen3_dflash
    out["sliding"] = "sliding_attention" in inspect.getsource(qwen3_dflash)
except Exception:
    pass
print(json.dumps(out))
"""
ENGINE_DEADLINE_S = 300


class ParityError(Exception):
    """Bad input: one line, exit 2."""


@dataclass
class Mismatch:
    key: str
    line: str

    def doc(self) -> dict[str, str]:
        return {"key": self.key, "line": self.line}


# ----------------------------------------------------------------------------- facts


def run_facts(config: Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """What training used: the run config's chat settings, drafter shape and target."""
    try:
        settings = load_run_settings(config, overrides)
    except EvalError as exc:
        raise ParityError(str(exc)) from None
    template = settings.chat_template
    if template is not None and "{" not in template:
        if not Path(template).is_file():
            raise ParityError(f"{config}: data.chat_template {template}: no such file")
        template = Path(template).read_text(encoding="utf-8")
    return {
        "config": str(config),
        "target_path": str(settings.target_path) if settings.target_path else None,
        "data_path": str(settings.data_path) if settings.data_path else None,
        "chat_template": template,  # None: the target tokenizer's
        "chat_template_kwargs": settings.chat_template_kwargs,
        **settings.drafter,
    }


def data_facts(data_path: str | None) -> dict[str, Any] | None:
    """What a datagen dataset was made with (its manifest), None for a plain corpus."""
    if not data_path:
        return None
    manifest = Path(data_path) / DATASET_MANIFEST
    if not manifest.is_file():
        return None
    try:
        m = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ParityError(f"{manifest}: unreadable ({exc})") from None
    return {
        "manifest": str(manifest),
        "chat_template_kwargs": dict(m.get("chat_template_kwargs") or {}),
        "chat_template_sha256": m.get("chat_template_sha256"),
    }


def checkpoint_facts(directory: Path) -> dict[str, Any]:
    config = directory / "config.json"
    try:
        c = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ParityError(f"{config}: not a drafter's config ({exc})") from None
    dflash = c.get("dflash_config") or {}
    return {
        "dir": str(directory),
        "block_size": dflash.get("block_size", c.get("block_size")),
        "mask_token_id": dflash.get("mask_token_id"),
        "target_layer_ids": dflash.get("target_layer_ids"),
        "num_target_layers": c.get("num_target_layers"),
        "layer_types": c.get("layer_types"),
        "dtype": c.get("dtype") or c.get("torch_dtype"),
    }


def target_facts(path: str | None) -> dict[str, Any] | None:
    """The target model's vocabulary and layers, and its tokenizer's chat template."""
    if not path or not (Path(path) / "config.json").is_file():
        return None
    c = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    text = c.get("text_config") or c  # multimodal targets (Qwen3.5/3.6) nest their LM's
    try:
        template = _tokenizer(path).chat_template
    except (OSError, ValueError):  # a config without its tokenizer (a plan from configs)
        template = None
    return {
        "path": path,
        "vocab_size": text.get("vocab_size") or c.get("vocab_size"),
        "num_layers": text.get("num_hidden_layers") or c.get("num_hidden_layers"),
        "chat_template": template,
        "dtype": text.get("dtype") or text.get("torch_dtype") or c.get("torch_dtype"),
    }


def engine_facts(python: str) -> dict[str, Any]:
    try:
        ran = subprocess.run([python, "-c", ENGINE_PROBE], capture_output=True, text=True,
                             timeout=ENGINE_DEADLINE_S)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ParityError(f"--vllm-python {python}: cannot run it ({exc})") from None
    if ran.returncode != 0:
        last = (ran.stderr.strip().splitlines() or ["no output"])[-1]
        raise ParityError(f"--vllm-python {python}: `import vllm` failed: {last}")
    return json.loads(ran.stdout.strip().splitlines()[-1])


def gather(args: argparse.Namespace) -> dict[str, Any]:
    """The facts found here, over those `--given`."""
    facts: dict[str, Any] = dict(args.given_facts)
    if args.config is not None:
        facts["train"] = run_facts(args.config, getattr(args, "overrides", ()))
        data = data_facts(facts["train"]["data_path"])
        if data is not None:
            facts["data"] = data
    if args.checkpoint is not None:
        facts["checkpoint"] = checkpoint_facts(args.checkpoint)
    train = facts.get("train") or {}
    target = target_facts(args.target or train.get("target_path"))
    if target is not None:
        facts["target"] = target
    if args.eval_kwargs is not None:
        facts["eval"] = {"chat_template_kwargs": args.eval_kwargs}
    if args.vllm_python is not None:
        facts["engine"] = engine_facts(args.vllm_python)
    serving = {"num_speculative_tokens": args.num_speculative_tokens,
               "defaults": args.serving_defaults}  # fmt: skip
    facts["serving"] = {k: v for k, v in serving.items() if v not in (None, False)}
    return facts


# ----------------------------------------------------------------------------- comparing


def mismatches(facts: dict[str, Any]) -> list[Mismatch]:
    """Each disagreement between training and serving the facts can show, one line each."""
    out: list[Mismatch] = []
    out += _chat(facts)
    out += _drafter(facts)
    return out


def _chat(facts: dict[str, Any]) -> list[Mismatch]:
    train, target = facts.get("train"), facts.get("target")
    if train is None or target is None or not (train["chat_template"] or target["chat_template"]):
        return []  # nothing to render with
    tokenizer = _tokenizer(target["path"])
    own = target["chat_template"]
    trained = train["chat_template"] or own
    sides = {"training": (trained, train["chat_template_kwargs"], f"run config {train['config']}")}
    if facts.get("serving", {}).get("defaults") and own is not None:
        sides["serving"] = (own, {}, "the engine's defaults: the target tokenizer's template "
                            "and no kwargs, unless served with --chat-template and "
                            "--default-chat-template-kwargs")  # fmt: skip
    data = facts.get("data")
    if data is not None:
        where = f"dataset manifest {data['manifest']}"
        sides["data"] = (trained, data["chat_template_kwargs"], where)
        made = data.get("chat_template_sha256")
        if made and made != _sha(trained):
            return [Mismatch("chat_template", f"chat template: the data was made with sha256 "
                             f"{made[:12]} ({where}), training renders with {_sha(trained)[:12]}")]  # fmt: skip
    ev = facts.get("eval")
    if ev is not None:
        sides["eval"] = (trained, ev["chat_template_kwargs"], "the eval's --chat-template-kwargs")
    rendered = {name: _render(tokenizer, t, k) for name, (t, k, _) in sides.items()}
    out = []
    for a, b in (("data", "training"), ("training", "eval"), ("training", "serving")):
        if a not in sides or b not in sides or rendered[a] == rendered[b]:
            continue
        (ta, ka, wa), (tb, kb, wb) = sides[a], sides[b]
        what = "chat template" if _sha(ta) != _sha(tb) else "chat template kwargs"
        shown = f" [template {_sha(ta)[:12]} vs {_sha(tb)[:12]}]" if ta != tb else ""
        out.append(Mismatch(what.replace(" ", "_"), (
            f"{what}: {a} renders with {json.dumps(ka)} ({wa}), {b} with {json.dumps(kb)} "
            f"({wb}){shown}; their serving prompts differ: ...{_tail(rendered[a])!r} vs "
            f"...{_tail(rendered[b])!r}")))  # fmt: skip
    return out


def _drafter(facts: dict[str, Any]) -> list[Mismatch]:
    ckpt = facts.get("checkpoint")
    if ckpt is None:
        return []
    train, target = facts.get("train") or {}, facts.get("target")
    engine, serving = facts.get("engine"), facts.get("serving") or {}
    where = f"checkpoint {ckpt['dir']}/config.json"
    out = []
    block = ckpt["block_size"]
    if train.get("block_size") not in (None, block):
        out.append(Mismatch("block_size", f"block size: the drafter drafts {block} ({where}), "
                            f"the run config says {train['block_size']}"))  # fmt: skip
    spec = serving.get("num_speculative_tokens")
    if spec is not None and block is not None and spec != block - 1:
        out.append(Mismatch("block_size", f"block size: the drafter drafts blocks of {block} "
                            f"({where}), the engine is asked for num_speculative_tokens {spec} "
                            f"(a block of {block} serves {block - 1})"))  # fmt: skip
    mask = ckpt["mask_token_id"]
    if train.get("mask_token_id") not in (None, mask):
        out.append(Mismatch("mask_token_id", f"mask_token_id: {mask} ({where}), the run config "
                            f"says {train['mask_token_id']}"))  # fmt: skip
    if target is not None and target["vocab_size"]:
        vocab = target["vocab_size"]
        if not isinstance(mask, int) or not 0 <= mask < vocab:
            out.append(Mismatch("mask_token_id", f"mask_token_id: {mask} ({where}) is not in the "
                                f"target's vocabulary 0..{vocab - 1} ({target['path']})"))  # fmt: skip
    out += _taps(ckpt, train, target, where)
    sliding = "sliding_attention" in (ckpt.get("layer_types") or [])
    if sliding and engine is not None and engine.get("sliding") is False:
        out.append(Mismatch("layer_types", f"layer_types: the drafter has sliding_attention "
                            f"layers ({where}), {engine['name']} {engine['version']}'s DFlash "
                            "model serves full attention only"))  # fmt: skip
    dtypes = {ckpt.get("dtype"), (target or {}).get("dtype")}
    if {"float16", "bfloat16"} <= dtypes:
        out.append(Mismatch("dtype", f"dtype: the drafter is {ckpt.get('dtype')} ({where}), the "
                            f"target {(target or {}).get('dtype')}: float16 and bfloat16 differ "
                            "in range"))  # fmt: skip
    return out


def _taps(ckpt: dict, train: dict, target: dict | None, where: str) -> list[Mismatch]:
    """target_layer_ids in z-lab's convention (id k = output of decoder layer k), which the
    engines' DFlash models read: within the target's layers, no repeats, as trained."""
    ids = ckpt["target_layer_ids"]
    if train.get("target_layer_ids") not in (None, ids):
        return [Mismatch("target_layer_ids", f"target_layer_ids: {ids} ({where}), the run config "
                         f"says {train['target_layer_ids']}")]  # fmt: skip
    layers = (target or {}).get("num_layers") or ckpt.get("num_target_layers")
    bad = not isinstance(ids, list) or not ids or len(set(ids)) != len(ids)
    if not bad and layers:
        bad = any(not isinstance(i, int) or not 0 <= i < layers for i in ids)
    if not bad:
        return []
    return [Mismatch("target_layer_ids", f"target_layer_ids: {ids} ({where}) are not distinct "
                     f"layers 0..{(layers or 0) - 1} of the {layers}-layer target, as the engine "
                     "reads them (id k = output of decoder layer k)")]  # fmt: skip


# ----------------------------------------------------------------------------- helpers


_TOKENIZERS: dict[str, Any] = {}


def _tokenizer(path: str) -> Any:
    if path not in _TOKENIZERS:
        from transformers import AutoTokenizer

        _TOKENIZERS[path] = AutoTokenizer.from_pretrained(path)
    return _TOKENIZERS[path]


def _render(tokenizer: Any, template: str | None, kwargs: dict) -> str:
    try:
        return tokenizer.apply_chat_template(PROBE, chat_template=template, tokenize=False,
                                             add_generation_prompt=True, **kwargs)  # fmt: skip
    except Exception as exc:  # noqa: BLE001 (a template's own error, named)
        raise ParityError(f"the chat template fails to render a conversation: {exc}") from None


def _sha(text: str | None) -> str:
    return hashlib.sha256((text or "").encode("utf-8")).hexdigest()


def _tail(text: str, n: int = 40) -> str:
    return text[-n:]


# ----------------------------------------------------------------------------- the program


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m workload.parity", description=__doc__.split("\n")[0]
    )
    p.add_argument("--config", type=Path, help="the run's run.yaml")
    p.add_argument("--checkpoint", type=Path, help="a checkpoint directory of the run")
    p.add_argument("--target", help="the target model directory here (default: target.path)")
    p.add_argument("--vllm-python", help="the python of the vLLM environment that will serve")
    p.add_argument("--eval-kwargs", help="the chat template kwargs the eval renders with (JSON)")
    p.add_argument("--num-speculative-tokens", type=int, help="what the engine is asked for")
    p.add_argument("--serving-defaults", action="store_true",
                   help="compare with what the engine renders by default (its own template, "
                   "no kwargs)")  # fmt: skip
    p.add_argument("--given", help="facts gathered elsewhere (a JSON file, - for stdin)")
    p.add_argument("--gather-only", action="store_true", help="print the facts, compare nothing")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = p.parse_args(argv)
    args.eval_kwargs = _json_arg("--eval-kwargs", args.eval_kwargs)
    given = sys.stdin.read() if args.given == "-" else None
    if args.given not in (None, "-"):
        given = Path(args.given).read_text(encoding="utf-8")
    args.given_facts = _json_arg("--given", given) or {}
    return args


def _json_arg(name: str, text: str | None) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ParityError(f"{name}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ParityError(f"{name}: expected a JSON object")
    return value


def before_eval(config: Path, checkpoint: Path, kwargs: str | None, overrides: Sequence[str],
                vllm_python: str | None) -> list[str]:  # fmt: skip
    """The mismatches an evaluation would measure through: its kwargs (JSON, None: the run's),
    the checkpoint against the run and its target, and, for a drafter with sliding layers,
    the engine (probing it costs an import of vLLM)."""
    sliding = "sliding_attention" in (checkpoint_facts(checkpoint).get("layer_types") or [])
    args = _here(config, overrides, checkpoint=checkpoint,
                 eval_kwargs=_json_arg("--chat-template-kwargs", kwargs),
                 vllm_python=vllm_python if sliding else None)  # fmt: skip
    return [m["line"] for m in check(args)["mismatches"]]


def before_launch(config: Path, overrides: Sequence[str]) -> list[str]:
    """The mismatches a launch can see (no checkpoint yet): the dataset's chat settings
    against training's (and so the eval's, which renders as training by default)."""
    return [m["line"] for m in check(_here(config, overrides))["mismatches"]]


def _here(config: Path, overrides: Sequence[str], **given: Any) -> argparse.Namespace:
    """The program's arguments for a check of what is here, as a caller in-process asks."""
    args = {"checkpoint": None, "target": None, "given_facts": {}, "eval_kwargs": None,
            "vllm_python": None, "num_speculative_tokens": None, "serving_defaults": False,
            "gather_only": False, **given}  # fmt: skip
    return argparse.Namespace(config=config, overrides=overrides, **args)


def unchecked(facts: dict[str, Any]) -> list[str]:
    """What could not be compared for want of its facts, and why."""
    train = facts.get("train") or {}
    out = []
    if "target" not in facts:
        out.append(f"no target model at {train.get('target_path')} here: the chat settings, "
                   "the vocabulary and the layers")  # fmt: skip
    elif not (train.get("chat_template") or facts["target"]["chat_template"]):
        out.append("no chat template (the run's or the target tokenizer's): the chat settings")
    if "checkpoint" not in facts:
        out.append("no checkpoint: the drafter's block size, mask token, taps and layer types")
    if "engine" not in facts:
        out.append("no engine given (--vllm-python): the layer types it serves")
    return out


def check(args: argparse.Namespace) -> dict[str, Any]:
    """The facts, their mismatches ([{"key", "line"}]) and what could not be compared."""
    facts = gather(args)
    if args.gather_only:
        return {"facts": facts, "mismatches": [], "notes": []}
    found = [m.doc() for m in mismatches(facts)]
    return {"facts": facts, "mismatches": found, "notes": unchecked(facts)}


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        doc = check(args)
    except (ParityError, OSError) as exc:
        print(f"parity: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(doc))
    else:
        for m in doc["mismatches"]:
            print(f"parity: {m['line']}")
        if not doc["mismatches"] and not args.gather_only:
            print("parity: training and serving agree on every setting checked")
    return 2 if doc["mismatches"] else 0
