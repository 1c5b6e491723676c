"""Train-to-serve parity: what the drafter was trained on against what it will be served with.

    python -m workload.parity --config RUN.yaml [--checkpoint DIR] [--vllm-python PY]
        [--eval-kwargs JSON] [--eval-result FILE]... [--serving-defaults]
        [--serve-chat-template FILE] [--serve-chat-template-kwargs JSON]
        [--num-speculative-tokens N] [--given FILE|-] [--gather-only] [--json]

A drafter that trains well and serves badly is most often one whose serving differs from its
training in a setting nobody compared: the thinking switch of the chat template (dflash#133:
acceptance 25% -> 60% once it matched), the block size against the engine's
num_speculative_tokens, a mask token outside the vocabulary, layer taps read in another
convention, sliding layers an engine version does not serve. This program gathers those
settings where it runs (facts) and names each disagreement with both sides, one line each.

Facts come from the run's config (what training rendered with), its dataset's manifest (what
the data was made with), the checkpoint's config.json, the target model (vocabulary, layers, its
tokenizer's chat template: what an engine serves with by default), the eval results of the
checkpoint (what they rendered with) and the engine (its version; how its own DFlash model
resolves each of the drafter's layers: a window or full attention, or its refusal). Serving is
said in the engine's words (`--serve-chat-template`, `--serve-chat-template-kwargs`: vLLM's
`--chat-template` and `--default-chat-template-kwargs`; `--num-speculative-tokens`); what is not
said is the engine's default (the tokenizer's template, no kwargs; for the block, block - 1, what
`eval --serve` asks for), and each such assumption is said.
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

from workload.common.layout import DATASET_MANIFEST, RESOLVED_CONFIG, RUN_CONFIG
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
# What the engine makes of a drafter: its version, whether its model registry serves the
# drafter's architecture, and its DFlash model's own per-layer attention (a window, or None
# for full attention) of the drafter's config (stdin; a one-layer sliding one without), under
# the engine's default config, as a server started with its environment resolves it.
ENGINE_PROBE = """
import json, sys
import vllm
out = {"name": "vllm", "version": vllm.__version__}
given = json.loads(sys.stdin.read() or "null")
cfg = given or {"layer_types": ["sliding_attention"], "sliding_window": 8}
try:
    from vllm.model_executor.models.registry import ModelRegistry
    out["architectures"] = sorted(a for a in ModelRegistry.get_supported_archs() if "DFlash" in a)
except Exception as exc:
    out["architectures_unknown"] = f"{type(exc).__name__}: {exc}"
try:
    from transformers import PretrainedConfig
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.models.qwen3_dflash import _resolve_layer_attention
except Exception as exc:
    out["layers_unknown"] = f"no per-layer attention resolver ({type(exc).__name__}: {exc})"
else:
    try:
        engine_config = VllmConfig()
    except Exception as exc:
        out["layers_unknown"] = f"its default config does not build here ({type(exc).__name__}: {exc})"
    else:
        config = PretrainedConfig(**{**cfg, "num_hidden_layers": len(cfg.get("layer_types") or [])})
        try:
            with set_current_vllm_config(engine_config):
                out["windows"] = [_resolve_layer_attention(config, i)[0]
                                  for i in range(config.num_hidden_layers)]
        except Exception as exc:
            out["refused"] = f"{type(exc).__name__}: {exc}"
        out["of"] = "drafter" if given else "probe"
print(json.dumps(out))
"""
# the drafter's config.json keys the engine's resolver reads
PROBE_KEYS = ("layer_types", "sliding_window", "dflash_config", "architectures", "is_causal")
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
        "n_predict": c.get("n_predict"),  # vLLM's num_speculative_tokens default, if any
        "architectures": c.get("architectures"),
        "engine_config": {k: c[k] for k in PROBE_KEYS if k in c},
    }


def eval_facts(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """What the checkpoint's stored eval results rendered with (their fingerprints); a result
    not there yet is left out."""
    out = []
    for path in paths:
        try:
            fp = json.loads(path.read_text(encoding="utf-8")).get("fingerprint") or {}
        except FileNotFoundError:
            continue
        except (OSError, ValueError, AttributeError) as exc:
            raise ParityError(f"--eval-result {path}: not an eval result ({exc})") from None
        if "chat_template_kwargs" in fp:
            out.append({"result": str(path), "chat_template_kwargs": fp["chat_template_kwargs"],
                        "chat_template_sha256": fp.get("chat_template_sha256")})  # fmt: skip
    return out


def serving_facts(args: argparse.Namespace) -> dict[str, Any]:
    """How it will be served, in the engine's words; None where not said (the engine's
    default)."""
    template = None
    if args.serve_chat_template is not None:
        path = Path(args.serve_chat_template)
        if not path.is_file():
            raise ParityError(f"--serve-chat-template {path}: no such file")
        template = path.read_text(encoding="utf-8")
    given = args.given_facts.get("serving") or {}
    return {
        "compared": bool(args.serving_defaults or given.get("compared")),
        "chat_template": template or given.get("chat_template"),
        "chat_template_file": args.serve_chat_template or given.get("chat_template_file"),
        "chat_template_kwargs": args.serve_chat_template_kwargs
        if args.serve_chat_template_kwargs is not None
        else given.get("chat_template_kwargs"),
        "num_speculative_tokens": args.num_speculative_tokens
        or given.get("num_speculative_tokens"),
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


def engine_facts(python: str, drafter: dict[str, Any] | None = None) -> dict[str, Any]:
    """ENGINE_PROBE's answer, run in the engine's python (about 10 s: it imports vLLM)."""
    try:
        ran = subprocess.run([python, "-c", ENGINE_PROBE], capture_output=True, text=True,
                             input=json.dumps(drafter) if drafter else "",
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
    if args.eval_results:
        facts["evals"] = eval_facts(args.eval_results)
    if args.vllm_python is not None:
        drafter = (facts.get("checkpoint") or {}).get("engine_config")
        facts["engine"] = engine_facts(args.vllm_python, drafter)
    facts["serving"] = serving_facts(args)
    return facts


# ----------------------------------------------------------------------------- comparing


def mismatches(facts: dict[str, Any]) -> list[Mismatch]:
    """Each disagreement between training and serving the facts can show, one line each."""
    out: list[Mismatch] = []
    out += _chat(facts)
    out += _drafter(facts)
    return out


ENGINE_DEFAULTS = (
    "the engine's defaults: the target tokenizer's template and no kwargs, unless "
    "served with --chat-template and --default-chat-template-kwargs (say how you "
    "serve: check --serve-chat-template, --serve-chat-template-kwargs)"
)


def _serving_side(serving: dict[str, Any], own: str | None) -> tuple | None:
    """(template, kwargs, where) of serving, the engine's defaults where not said."""
    template = serving.get("chat_template") or own
    if not serving.get("compared") or template is None:
        return None
    kwargs = serving.get("chat_template_kwargs")
    said = [f"--serve-chat-template {serving['chat_template_file']}"
            if serving.get("chat_template") else "",
            "--serve-chat-template-kwargs" if kwargs is not None else ""]  # fmt: skip
    where = ", ".join(x for x in said if x) or ENGINE_DEFAULTS
    if any(said) and not all(said):
        where += " (the rest the engine's default)"
    return template, kwargs or {}, where


def _chat(facts: dict[str, Any]) -> list[Mismatch]:
    train, target = facts.get("train"), facts.get("target")
    if train is None or target is None or not (train["chat_template"] or target["chat_template"]):
        return []  # nothing to render with
    tokenizer = _tokenizer(target["path"])
    own = target["chat_template"]
    trained = train["chat_template"] or own
    sides = {"training": (trained, train["chat_template_kwargs"], f"run config {train['config']}")}
    serving = _serving_side(facts.get("serving") or {}, own)
    if serving is not None:
        sides["serving"] = serving
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
    pairs = [("data", "training"), ("training", "eval"), ("training", "serving")]
    out = []
    for i, result in enumerate(facts.get("evals") or []):
        name = f"the eval result {result['result']}"
        known = {_sha(t): t for t in (trained, serving[0] if serving else None) if t}
        template = known.get(result.get("chat_template_sha256") or _sha(trained))
        if template is None:
            out.append(Mismatch("chat_template", f"chat template: {name} rendered with sha256 "
                                f"{str(result['chat_template_sha256'])[:12]}, training with "
                                f"{_sha(trained)[:12]}"))  # fmt: skip
            continue
        sides[f"eval{i}"] = (template, result["chat_template_kwargs"], name)
        pairs.append((f"eval{i}", "serving" if serving else "training"))
    rendered = {name: _render(tokenizer, t, k) for name, (t, k, _) in sides.items()}
    for a, b in pairs:
        if a not in sides or b not in sides or rendered[a] == rendered[b]:
            continue
        (ta, ka, wa), (tb, kb, wb) = sides[a], sides[b]
        what = "chat template" if _sha(ta) != _sha(tb) else "chat template kwargs"
        shown = f" [template {_sha(ta)[:12]} vs {_sha(tb)[:12]}]" if ta != tb else ""
        label = "eval" if a.startswith("eval") else a
        out.append(Mismatch(what.replace(" ", "_"), (
            f"{what}: {label} renders with {_said(ka, kb)} ({wa}), {b} with {_said(kb, ka)} "
            f"({wb}){shown}; their serving prompts differ: ...{_tail(rendered[a])!r} vs "
            f"...{_tail(rendered[b])!r}")))  # fmt: skip
    return out


def _said(kwargs: dict, other: dict) -> str:
    """The kwargs, and the other side's keys they leave to the template's default."""
    unset = [k for k in other if k not in kwargs]
    text = json.dumps(kwargs)
    return text + (f" ({', '.join(unset)} not given: the template's default)" if unset else "")


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
    spec, _ = asked_tokens(ckpt, serving)
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
    out += _layers(ckpt, target, where)
    out += _engine(ckpt, engine, where)
    dtypes = {ckpt.get("dtype"), (target or {}).get("dtype")}
    if {"float16", "bfloat16"} <= dtypes:
        out.append(Mismatch("dtype", f"dtype: the drafter is {ckpt.get('dtype')} ({where}), the "
                            f"target {(target or {}).get('dtype')}: float16 and bfloat16 differ "
                            "in range"))  # fmt: skip
    return out


def asked_tokens(ckpt: dict, serving: dict) -> tuple[int | None, str | None]:
    """num_speculative_tokens the engine will be asked for, and, where not said, the default
    assumed (None: said)."""
    spec, block = serving.get("num_speculative_tokens"), ckpt.get("block_size")
    if spec is not None or block is None:
        return spec, None
    if isinstance(ckpt.get("n_predict"), int):
        return ckpt["n_predict"], (f"num_speculative_tokens not given: compared as "
                                   f"{ckpt['n_predict']}, vLLM's default (the drafter's n_predict)")  # fmt: skip
    return block - 1, (f"num_speculative_tokens not given: compared as {block - 1} (block "
                       f"{block} - 1, what eval --serve asks vLLM for; vLLM has no default "
                       "for a DFlash drafter without n_predict)")  # fmt: skip


def _layers(ckpt: dict, target: dict | None, where: str) -> list[Mismatch]:
    """The drafter's num_target_layers against the target's real layer count."""
    made, real = ckpt.get("num_target_layers"), (target or {}).get("num_layers")
    if made is None or real is None or made == real:
        return []
    return [Mismatch("num_target_layers", f"num_target_layers: the drafter was made for a "
                     f"{made}-layer target ({where}), the target {target['path']} has {real} "
                     "layers")]  # fmt: skip


def _engine(ckpt: dict, engine: dict | None, where: str) -> list[Mismatch]:
    """What the engine's own DFlash model makes of the drafter (ENGINE_PROBE): its
    architecture in the registry, its sliding layers served with their window."""
    if engine is None:
        return []
    name = f"{engine['name']} {engine['version']}"
    out = []
    archs, served = ckpt.get("architectures") or [], engine.get("architectures")
    if served is not None and archs and not set(archs) & set(served):
        out.append(Mismatch("architectures", f"architectures: the drafter is {archs} ({where}), "
                            f"{name}'s model registry serves DFlash drafters as {served}"))  # fmt: skip
    types = ckpt.get("layer_types") or []
    if "sliding_attention" not in types or engine.get("of") != "drafter":
        return out
    if engine.get("refused"):
        out.append(Mismatch("layer_types", f"layer_types: the drafter has sliding_attention "
                            f"layers ({where}); {name}'s DFlash model refuses them: "
                            f"{engine['refused']}"))  # fmt: skip
        return out
    windows = engine.get("windows") or []
    full = [i for i, t in enumerate(types) if t == "sliding_attention"
            and (i >= len(windows) or windows[i] is None)]  # fmt: skip
    if full:
        out.append(Mismatch("layer_types", f"layer_types: the drafter's layers {full} are "
                            f"sliding_attention ({where}), {name}'s DFlash model serves them "
                            "with full attention"))  # fmt: skip
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
    p.add_argument("--eval-result", dest="eval_results", action="append", type=Path,
                   default=[], help="a stored eval result of the checkpoint (what it rendered "
                   "with, compared with serving); one not there is left out")  # fmt: skip
    p.add_argument("--num-speculative-tokens", type=int, help="what the engine is asked for")
    p.add_argument("--serving-defaults", action="store_true",
                   help="compare serving too: what is not said below as the engine's default "
                   "(its own template, no kwargs)")  # fmt: skip
    p.add_argument(
        "--serve-chat-template",
        metavar="FILE",
        help="the template the engine serves with (vLLM's --chat-template)",
    )
    p.add_argument(
        "--serve-chat-template-kwargs",
        metavar="JSON",
        help="the kwargs it renders with (vLLM's --default-chat-template-kwargs)",
    )
    p.add_argument("--given", help="facts gathered elsewhere (a JSON file, - for stdin)")
    p.add_argument("--gather-only", action="store_true", help="print the facts, compare nothing")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = p.parse_args(argv)
    args.eval_kwargs = json_object("--eval-kwargs", args.eval_kwargs)
    args.serve_chat_template_kwargs = json_object("--serve-chat-template-kwargs",
                                                args.serve_chat_template_kwargs)  # fmt: skip
    if args.serve_chat_template is not None or args.serve_chat_template_kwargs is not None:
        args.serving_defaults = True
    given = sys.stdin.read() if args.given == "-" else None
    if args.given not in (None, "-"):
        given = Path(args.given).read_text(encoding="utf-8")
    args.given_facts = json_object("--given", given) or {}
    return args


def json_object(name: str, text: str | None) -> dict | None:
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
                vllm_python: str | None, serving: dict | None = None) -> list[str]:  # fmt: skip
    """The mismatches an evaluation would measure through: its kwargs (JSON, None: the run's),
    the checkpoint against the run and its target, and, for a drafter with sliding layers,
    the engine (probing it costs an import of vLLM). `serving` ({"chat_template": FILE|None,
    "chat_template_kwargs": JSON|None}): a server's settings, compared instead of the kwargs."""
    sliding = "sliding_attention" in (checkpoint_facts(checkpoint).get("layer_types") or [])
    given: dict[str, Any] = {"eval_kwargs": json_object("--chat-template-kwargs", kwargs)}
    if serving is not None:
        given = {"serving_defaults": True, "serve_chat_template": serving.get("chat_template"),
                 "serve_chat_template_kwargs": json_object("--serve-chat-template-kwargs",
                                                         serving.get("chat_template_kwargs"))}  # fmt: skip
    args = _here(config, overrides, checkpoint=checkpoint,
                 vllm_python=vllm_python if sliding else None, **given)  # fmt: skip
    return [m["line"] for m in check(args)["mismatches"]]


def trained_apart(config: Path, other: Path, overrides: Sequence[str]) -> str | None:
    """Whether two runs were trained for different chat settings (by what they render for the
    probe conversation under the first run's target), said in one line; None: alike."""
    mine = run_facts(config, overrides)
    theirs = run_facts(other, [f"target.path={mine['target_path']}"] if mine["target_path"] else [])
    target = target_facts(mine["target_path"])
    if target is None or not (mine["chat_template"] or target["chat_template"]):
        return None
    tokenizer = _tokenizer(target["path"])
    a = _render(tokenizer, mine["chat_template"] or target["chat_template"],
                mine["chat_template_kwargs"])  # fmt: skip
    b = _render(tokenizer, theirs["chat_template"] or target["chat_template"],
                theirs["chat_template_kwargs"])  # fmt: skip
    if a == b:
        return None
    return (f"trained chat settings: {config} renders with "
            f"{_said(mine['chat_template_kwargs'], theirs['chat_template_kwargs'])}, {other} "
            f"with {_said(theirs['chat_template_kwargs'], mine['chat_template_kwargs'])}; "
            f"their serving prompts differ: ...{_tail(a)!r} vs ...{_tail(b)!r}")  # fmt: skip


def before_vs(config: Path, vs: Path, vs_config: Path | None, overrides: Sequence[str],
              vllm_python: str | None, serving: dict) -> dict:  # fmt: skip
    """The --vs drafter of a serving benchmark checked as the first one is, against the same
    serving, on the first run's target; and whether the two were trained for different chat
    settings. {"config", "mismatches", "apart"}, or {"unknown": why} without its run config
    (a published drafter): its run.yaml (or the trainer's resolved.yaml) beside it, above it
    (as pull-ckpt leaves it) or in its run directory (RUN/checkpoints/step_N)."""
    if vs_config is None:
        places = [d / n for d in (vs, vs.parent, vs.parent.parent)
                  for n in (RUN_CONFIG, RESOLVED_CONFIG)]  # fmt: skip
        vs_config = next((p for p in places if p.is_file()), None)
    if vs_config is None:
        return {"unknown": f"--vs {vs}: no run config beside it: the chat settings it was "
                "trained for are not known, nor checked"}  # fmt: skip
    target = run_facts(config, overrides)["target_path"]
    same = [f"target.path={target}"] if target else []
    lines = before_eval(vs_config, vs, None, same, vllm_python, serving)
    return {"config": str(vs_config), "mismatches": lines,
            "apart": trained_apart(config, vs_config, overrides)}  # fmt: skip


def before_launch(config: Path, overrides: Sequence[str]) -> list[str]:
    """The mismatches a launch can see (no checkpoint yet): the dataset's chat settings
    against training's (and so the eval's, which renders as training by default)."""
    return [m["line"] for m in check(_here(config, overrides))["mismatches"]]


def _here(config: Path, overrides: Sequence[str], **given: Any) -> argparse.Namespace:
    """The program's arguments for a check of what is here, as a caller in-process asks."""
    args = {"checkpoint": None, "target": None, "given_facts": {}, "eval_kwargs": None,
            "eval_results": [], "vllm_python": None, "num_speculative_tokens": None,
            "serving_defaults": False, "serve_chat_template": None,
            "serve_chat_template_kwargs": None, "gather_only": False, **given}  # fmt: skip
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
    ckpt, engine = facts.get("checkpoint") or {}, facts.get("engine")
    if ckpt and ckpt.get("num_target_layers") is None:
        out.append("the drafter's config.json has no num_target_layers: the target it was made for")
    if engine is None:
        out.append("no engine given (--vllm-python): the drafter's architecture and layer types "
                   "against what it serves")  # fmt: skip
    else:
        for key in ("architectures_unknown", "layers_unknown"):
            if engine.get(key):
                out.append(f"{engine['name']} {engine['version']}: {engine[key]}")
    return out


def assumed(facts: dict[str, Any]) -> list[str]:
    """The engine's defaults compared where serving was not said."""
    serving, ckpt = facts.get("serving") or {}, facts.get("checkpoint") or {}
    out = []
    if serving.get("compared") and serving.get("chat_template_kwargs") is None:
        out.append("--serve-chat-template-kwargs not given: compared as {}, the engine's default")
    if serving.get("compared") and serving.get("chat_template") is None:
        out.append("--serve-chat-template not given: compared as the target tokenizer's own "
                   "template, the engine's default")  # fmt: skip
    _, said = asked_tokens(ckpt, serving) if ckpt else (None, None)
    return out + ([said] if said else [])


def check(args: argparse.Namespace) -> dict[str, Any]:
    """The facts, their mismatches ([{"key", "line"}]) and what could not be compared."""
    facts = gather(args)
    if args.gather_only:
        return {"facts": facts, "mismatches": [], "notes": [], "assumed": []}
    found = [m.doc() for m in mismatches(facts)]
    return {"facts": facts, "mismatches": found, "notes": unchecked(facts),
            "assumed": assumed(facts)}  # fmt: skip


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
