"""Greedy generation in vLLM, plain and with DFlash drafters: the engine half of `eval --engine vllm`.

    python -m workload.eval.vllm_engine --request REQUEST.json --out RESULT.json

Runs in the Python of a vLLM environment (it needs nothing of the workload's own requirements:
the standard library and vLLM). `workload.eval` writes the request (the target, the prompts as
token ids, the stop ids, the drafters) and reads the result; see `run` for both formats. Each
engine in turn: the target alone ("plain"), then the target with each drafter as its DFlash
speculator (`speculative_config={"method": "dflash", "model": DRAFTER,
"num_speculative_tokens": block_size - 1}`). Every engine generates all prompts in one batch,
greedy, `ignore_eos` with the workload's stop ids (the simulation's stopping rule), after a
short warm-up that is not timed; it is shut down before the next starts, so one accelerator
holds one engine at a time.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _platform_is_gpu() -> bool:
    from vllm.platforms import current_platform

    return not current_platform.is_cpu()


def resolve_dtype(dtype: str, gpu: bool) -> str:
    """The workload's rule (targets.py): `auto` is bfloat16 on a GPU, float32 on CPU. vLLM's own
    `auto` would run a float32 checkpoint in bfloat16 on CPU."""
    if dtype == "auto":
        return "bfloat16" if gpu else "float32"
    return dtype


def _kv_cache_gib(request: dict) -> int:
    """KV cache a CPU engine needs for the whole batch (target and drafter layers), doubled."""
    kv = request.get("kv_bytes_per_token", 0)
    tokens = sum(len(p) for p in request["prompts"])
    tokens += len(request["prompts"]) * (request["max_new_tokens"] + request["block_size"])
    return max(1, math.ceil(2 * kv * tokens / 2**30))


def engine_args(request: dict, drafter: dict | None, gpu: bool) -> dict[str, Any]:
    longest = max(len(p) for p in request["prompts"])
    args: dict[str, Any] = {
        "model": request["target"],
        "tokenizer": request["target"],
        "dtype": resolve_dtype(request["dtype"], gpu),
        "seed": 0,
        "max_model_len": longest + request["max_new_tokens"] + request["block_size"] + 1,
        "enforce_eager": request.get("enforce_eager", not gpu),
        "disable_log_stats": False,
    }
    if drafter is not None:
        args["per_request_spec_decode_metrics"] = "detailed"
        args["speculative_config"] = {
            "method": "dflash",
            "model": drafter["path"],
            "num_speculative_tokens": drafter["block_size"] - 1,
        }
    args.update(request.get("engine_args", {}))
    return args


def _counters(llm: Any) -> dict[str, Any]:
    from vllm.v1.metrics.reader import Counter, Vector

    found: dict[str, Any] = {k: 0 for k in COUNTERS}
    found["accepted_per_position"] = []
    names = {v: k for k, v in COUNTERS.items()}
    for metric in llm.get_metrics():
        if isinstance(metric, Counter) and metric.name in names:
            found[names[metric.name]] += metric.value
        elif isinstance(metric, Vector) and metric.name == PER_POSITION:
            values = found["accepted_per_position"]
            values.extend([0] * (len(metric.values) - len(values)))
            for i, v in enumerate(metric.values):
                values[i] += v
    return found


def _minus(after: dict, before: dict) -> dict:
    out = {k: after[k] - before[k] for k in COUNTERS}
    a, b = after["accepted_per_position"], before["accepted_per_position"]
    out["accepted_per_position"] = [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]
    return out


def _shutdown(llm: Any) -> None:
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm
    gc.collect()


def run_engine(request: dict, drafter: dict | None, gpu: bool) -> dict:
    """One engine: start it, warm it up, generate every prompt in one batch, shut it down."""
    from vllm import LLM, SamplingParams

    name = "plain" if drafter is None else drafter["name"]
    t0 = time.perf_counter()
    llm = LLM(**engine_args(request, drafter, gpu))
    started = time.perf_counter() - t0
    dtype = str(llm.model_config.dtype).removeprefix("torch.")  # what it runs in, not what we asked
    params = SamplingParams(
        temperature=0.0,
        max_tokens=request["max_new_tokens"],
        ignore_eos=True,
        stop_token_ids=request["stop_ids"],
        detokenize=False,
    )
    prompts = [{"prompt_token_ids": ids} for ids in request["prompts"]]
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:1], warm, use_tqdm=False)
    before = _counters(llm)
    t1 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t1
    pooled = _minus(_counters(llm), before)
    _shutdown(llm)
    records = []
    for out in outputs:
        completion = out.outputs[0]
        metrics = getattr(completion, "spec_decode_metrics", None)
        records.append(
            {
                "tokens": list(completion.token_ids),
                "finish_reason": completion.finish_reason,
                "per_step_accepted": list(getattr(metrics, "per_step_accepted", []) or []),
                "per_step_drafted": list(getattr(metrics, "per_step_drafted", []) or []),
            }
        )
    generated = sum(len(r["tokens"]) for r in records)
    say(
        f"vllm: {name}: {generated} tokens in {seconds:.1f}s "
        f"({generated / seconds if seconds else 0:.1f} tokens/s; engine start {started:.1f}s)"
    )
    return {
        "name": name,
        "start_s": started,
        "generate_s": seconds,
        "tokens": generated,
        "dtype": dtype,
        "pooled": pooled if drafter is not None else None,
        "outputs": records,
    }


def run(request: dict) -> dict:
    """request: {"target": DIR, "dtype": "auto"|..., "prompts": [[ids]], "max_new_tokens": N,
    "stop_ids": [ids], "block_size": B, "drafters": [{"name", "path", "block_size"}],
    "kv_bytes_per_token": n, "enforce_eager": bool (optional), "engine_args": {...} (optional)}.
    result: {"version", "device", "dtype", "engines": {"plain": ENGINE, NAME: ENGINE, ...}}; an
    ENGINE is {"start_s", "generate_s", "tokens", "dtype" (the one the engine ran in),
    "pooled" (the spec counters, or None),
    "outputs": [{"tokens", "finish_reason", "per_step_accepted", "per_step_drafted"}]}."""
    import vllm

    gpu = _platform_is_gpu()
    if not gpu and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(_kv_cache_gib(request))
    engines = {}
    for drafter in [None, *request["drafters"]]:
        result = run_engine(request, drafter, gpu)
        engines[result.pop("name")] = result
    dtypes = sorted({e["dtype"] for e in engines.values()})
    return {
        "version": vllm.__version__,
        "device": "gpu" if gpu else "cpu",
        "dtype": dtypes[0] if len(dtypes) == 1 else ",".join(dtypes),
        "engines": engines,
    }


def end_group_on_term() -> None:
    """SIGTERM or SIGHUP (our starter gone, PR_SET_PDEATHSIG; or a stop) ends our whole process
    group at once, vLLM's engine core with us; only where we lead it (vllm_offline starts us so)."""
    if os.getpgrp() == os.getpid():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda *_: os.killpg(0, signal.SIGKILL))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workload.eval.vllm_engine", description=__doc__)
    p.add_argument("--request", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)
    end_group_on_term()
    result = run(json.loads(args.request.read_text()))
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
