"""`eval --engine vllm`: τ measured in vLLM, where the drafter serves, beside the simulation.

The engines run in a child process, `python -m workload.eval.vllm_engine`, in the vLLM environment's
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

import json
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from workload.common.processes import end_group, start_group
from workload.drafter.model import select_target_features
from workload.eval.decode import DraftSession, PromptResult, Round, target_hidden_states
from workload.eval.errors import EngineError
from workload.eval.evaluation import Evaluation, Subject
from workload.eval.summary import fmt, mean_over_prompts, rate, say, summarize, tau
from workload.eval.vllm_process import (
    child_env,
    engine_args,
    forward_progress,
    keep_output,
    kv_bytes_per_token,
    last_error,
    preload,
    vllm_python,
)

# ----------------------------------------------------------------------------- the engines


def run_engines(python: str, request: dict, timeout: float, log: Path) -> dict:
    """Run workload.eval.vllm_engine in `python` on `request`. Its progress lines go on to our
    stderr; all it printed is kept in `log` when it fails (named in the error)."""
    with tempfile.TemporaryDirectory(prefix="dflash-vllm-") as tmp:
        req, out = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request))
        env = child_env()
        preload(python, env)
        argv = [python, "-m", "workload.eval.vllm_engine", "--request", str(req), "--out", str(out)]
        lines: list[str] = []
        proc = start_group(  # its engine processes go with it on a kill
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp,
        )
        reader = threading.Thread(target=forward_progress, args=(proc.stderr, lines), daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise EngineError(
                f"the vLLM engines did not finish in {timeout:.0f}s (--engine-timeout)"
                + keep_output(log, lines)
            ) from None
        finally:
            end_group(proc)  # what it started is gone before we go on, however we leave
        reader.join(timeout=5)
        if code != 0 or not out.is_file():
            raise EngineError(
                f"the vLLM engines failed (exit {code}): {last_error(lines)}"
                + keep_output(log, lines)
            )
        return json.loads(out.read_text())


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
            "tau": tau(rounds),
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
    spec_rate = rate(spec["tokens"], spec["generate_s"])
    plain_rate = rate(plain["tokens"], plain["generate_s"])
    say(
        f"eval: {s.name}: vllm tau {fmt(summary['tau'])}, simulated "
        f"{fmt(simulated['tau'])}; rounds identical on {len(chains) - len(differs)}/"
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
            "running_tau": mean_over_prompts([r.chain for r in s.results]),
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
