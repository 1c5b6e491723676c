"""The serving benchmark of a checkpoint: the target served by vLLM's own OpenAI server, with the
drafter as its DFlash speculator and without it, driven by vLLM's own benchmark client.

    python -m workload.serve_bench --config RUN.yaml --checkpoint DIR [--vs DIR | --vs-result FILE
        | --vs-vllm-python PATH [--vs-engine-name NAME]] [--vs-config FILE] [--concurrency 1,4,16]
        [--prompts FILE] [--max-new-tokens N] [--max-prompts N] [--serve-chat-template FILE]
        [--serve-chat-template-kwargs JSON] [--set KEY=VALUE]... [--vllm-python PATH]
        [--vllm-arg KEY=VALUE]... [--repeat N] [--ready-timeout S] [--bench-timeout S] [--force]
        --out FILE.json

Each subject in turn (the checkpoint, the --vs drafter, then the target alone; with
--vs-vllm-python, the checkpoint and the target alone in each of two vLLM environments): a server
(`python -m vllm.entrypoints.openai.api_server` in the vLLM environment's python, bound to
127.0.0.1 on a free port, its own process group) is started and awaited (/health, within
--ready-timeout), driven by `workload.eval.serve_client` (vLLM's `vllm bench serve`, in the vLLM
python) at each concurrency over all the prompts, then stopped (its process group; the port
must be closed after) before the next starts: one accelerator holds one server at a time.
The prompts are the offline eval's (workload/eval/prompts.py), rendered as the server renders a
chat: with --serve-chat-template (the server's --chat-template; default: the target tokenizer's
own) and --serve-chat-template-kwargs (its --default-chat-template-kwargs; default: none), which
the parity check compares with training's (and the --vs drafter's, whose run config is
--vs-config, else beside it), sent as token ids, greedy, `ignore_eos` with the workload's stop
ids, at most --max-new-tokens each, as `eval --engine vllm` generates them.

The servers run without prefix caching (`--no-enable-prefix-caching`; `--vllm-arg
enable_prefix_caching=true` turns it on, and the fingerprint's server_args say so): the same
prompts go out at every concurrency and repeat, and with it the later passes' TTFT would be
mostly cache hits. `--repeat N` runs every
concurrency's pass N times (all concurrencies, then again), spec and plain alike: each figure is
the mean over the repeats, with their standard deviation in `spread` and each repeat's figures in
`by_repeat`. Fewer prompts than the highest concurrency is warned about (that pass never holds
that many requests at once), in the result's `warnings` too. The prompts are checked against the
run's training data first (workload/eval/overlap.py: refused above its share unless --force).

The fingerprint names the hardware (workload/eval/hardware.py: GPU model, count, driver, the
serving environment's CUDA; on a CPU its model and cores): a --vs-result measured on other
hardware is put beside this one, not differenced.

Acceptance comes from the server's spec-decode counters (/metrics, read by the client around
each pass): per position accepted_per_pos / drafts, τ pooled as 1 + accepted / drafts (vLLM's
figure, `engine_mean_acceptance_length` in an offline eval). τ per category (a record's
`category` or `task`, else the prompt file's kind) and per prompt-length bucket come from one
more pass per (category, bucket) group, at the highest concurrency, when there are several.

SIGTERM, SIGHUP or Ctrl-C stops the server and the client that run, and nothing is written; a
SIGKILL of this process tells them SIGTERM (workload/common/processes.py), and an eval job ends
what is left of their process groups (remote/engine_groups.py). Exit status:
0 done, 1 a server or the client failed, 2 bad input, 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from workload.common.jsonfile import write_json_atomic
from workload.common.processes import end_group, start_group
from workload.eval.arguments import subject_parser
from workload.eval.errors import EngineError, EvalError
from workload.eval.fingerprint import (
    checkpoint_sha256,
    fingerprint,
    target_identity,
    template_sha256,
)
from workload.eval.hardware import hardware, with_cuda
from workload.eval.inputs import (
    chat_template,
    check_manifest,
    drafter_block_size,
    generation_config,
    parity_check,
    prompt_set_of,
    render_prompt,
    served_chat,
    stop_ids_of,
)
from workload.eval.overlap import training_overlap
from workload.eval.parity import ParityError, before_vs
from workload.eval.prompts import prompts_sha256
from workload.eval.run_settings import load_run_settings
from workload.eval.summary import say
from workload.eval.vllm_engine import resolve_dtype
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

BUCKETS = ((1024, "<1k"), (4096, "1-4k"), (16384, "4-16k"), (math.inf, ">16k"))
STOP_GRACE_S = 30.0  # SIGTERM, then SIGKILL of the server's process group


class Interrupted(BaseException):
    """SIGTERM or SIGHUP: unwinds like Ctrl-C, so every server started is stopped."""


@dataclass
class Subject:
    name: str  # "checkpoint", "vs", "plain" (and "vs-plain": the target alone in the vs engine)
    path: Path | None  # the drafter; None for the target alone
    python: str  # the vLLM environment's python that serves it
    block_size: int = 0
    version: str = "unknown"  # vLLM's, as its client reports it
    cuda: str | None = None  # the CUDA its environment's torch was built for, as the client says
    timing: dict[str, float] = field(default_factory=dict)
    passes: dict[str, dict] = field(default_factory=dict)


# ----------------------------------------------------------------------------- inputs


def concurrencies(text: str) -> list[int]:
    try:
        found = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        found = []
    if not found or found[0] < 1:
        raise EvalError(f"--concurrency {text}: expected numbers >= 1, e.g. 1,4,16")
    return found


def bucket_of(tokens: int) -> str:
    return next(name for bound, name in BUCKETS if tokens < bound)


def category_of(item: dict, kind: str) -> str:
    return item.get("category") or kind


class Bench:
    """The inputs, checked and rendered before any server starts."""

    def __init__(self, args: argparse.Namespace) -> None:
        if args.max_new_tokens < 1:
            raise EvalError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
        if args.repeat < 1:
            raise EvalError(f"--repeat {args.repeat}: must be >= 1")
        self.args = args
        self.levels = concurrencies(args.concurrency)
        self.python = vllm_python(args.vllm_python)
        self.vs_python = vllm_python(args.vs_vllm_python) if args.vs_vllm_python else None
        self.settings = load_run_settings(args.config, args.overrides)
        self.kwargs = served_chat(args)
        prompts_path = args.prompts or _default_prompts(args, self.settings.data_path)
        self.prompt_set = prompt_set_of(prompts_path).head(args.max_prompts)
        self.prompts = self.prompt_set.items
        self.overlap = training_overlap(self.prompts, self.settings.data_path, args.force)
        check_manifest(args.checkpoint, required=True)
        self.subjects = subjects_of(args, self.python, self.vs_python)
        target = self.settings.target_path
        if not (target / "config.json").is_file():
            raise EvalError(f"target.path {target}: no config.json (not a model directory)")
        self.tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
        self.template = chat_template(args.serve_chat_template)  # None: the tokenizer's
        self.stops = stop_ids_of(generation_config(target), self.tokenizer)
        self.ids = [render_prompt(self.tokenizer, p, self.template, self.kwargs)
                    for p in self.prompts]  # fmt: skip
        self.extra = engine_args(args.vllm_args)
        self.gpu = _gpu()
        self.hardware = hardware(self.gpu)
        self.warnings = few_prompts(len(self.prompts), self.levels)
        for line in self.warnings:
            say(f"serve: warning: {line}")

    def groups(self) -> dict[tuple[str, str], list[int]]:
        """Prompt indices by (category, length bucket)."""
        out: dict[tuple[str, str], list[int]] = {}
        for i, item in enumerate(self.prompts):
            key = (category_of(item, self.prompt_set.kind), bucket_of(len(self.ids[i])))
            out.setdefault(key, []).append(i)
        return out

    def max_model_len(self) -> int:
        block = max((s.block_size for s in self.subjects), default=1)
        return max(map(len, self.ids)) + self.args.max_new_tokens + block + 1

    def server_args(self) -> dict[str, Any]:
        """What decides the servers besides the drafter: the fingerprint's `server_args`."""
        args = {
            "dtype": resolve_dtype(self.settings.dtype, self.gpu),  # the offline eval's rule
            "seed": 0,
            "max_model_len": self.max_model_len(),
            "enforce_eager": not self.gpu,
            "enable_prefix_caching": False,  # the same prompts at each concurrency and repeat
        }
        args.update(self.extra)
        return args

    def kv_cache_gib(self) -> int:
        """A CPU server's KV cache: the highest concurrency's sequences, target and drafter
        layers, doubled (VLLM_CPU_KVCACHE_SPACE)."""
        paths = [self.settings.target_path, *(s.path for s in self.subjects if s.path)]
        tokens = self.levels[-1] * self.max_model_len()
        return max(1, math.ceil(2 * kv_bytes_per_token(*paths) * tokens / 2**30))


def subjects_of(args: argparse.Namespace, python: str, vs_python: str | None) -> list[Subject]:
    """The servers in the order they run: each drafter, then the target alone; with a second
    engine, the checkpoint and the target alone in each."""
    out = [Subject("checkpoint", args.checkpoint, python)]
    if args.vs is not None:
        check_manifest(args.vs, required=False)  # a published drafter has none
        out.append(Subject("vs", args.vs, python))
    out.append(Subject("plain", None, python))
    if vs_python is not None:
        out += [Subject("vs", args.checkpoint, vs_python), Subject("vs-plain", None, vs_python)]
    for s in out:
        s.block_size = drafter_block_size(s.path) if s.path is not None else 0
    return out


def few_prompts(n: int, levels: list[int]) -> list[str]:
    """The warning when the highest concurrency outnumbers the prompts."""
    if n >= levels[-1]:
        return []
    return [f"{n} prompts, fewer than the highest concurrency {levels[-1]}: that pass never holds "
            f"more than {n} requests at once, so its figures are not those of concurrency "
            f"{levels[-1]} (give at least {levels[-1]} prompts: --prompts, --max-prompts)"]  # fmt: skip


def _default_prompts(args: argparse.Namespace, data: Path | None) -> Path:
    if data is None:
        raise EvalError(f"{args.config}: data.path is unset; pass --prompts FILE")
    return data.parent / "prompts.jsonl"


def _gpu() -> bool:
    import torch

    return torch.cuda.is_available()


# ----------------------------------------------------------------------------- one server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def server_argv(bench: Bench, subject: Subject, port: int) -> list[str]:
    argv = [subject.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(bench.settings.target_path), "--host", "127.0.0.1",
            "--port", str(port), "--disable-uvicorn-access-log"]  # fmt: skip
    for key, value in bench.server_args().items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + flag[2:])  # vLLM's boolean options take --no-<name>
        elif value is not None:
            argv += [flag, value if isinstance(value, str) else json.dumps(value)]
    if bench.args.serve_chat_template is not None:
        argv += ["--chat-template", str(Path(bench.args.serve_chat_template).resolve())]
    if bench.kwargs:
        argv += ["--default-chat-template-kwargs", json.dumps(bench.kwargs)]
    if subject.path is not None:
        spec = {"method": "dflash", "model": str(subject.path.resolve()),
                "num_speculative_tokens": subject.block_size - 1}  # fmt: skip
        argv += ["--speculative-config", json.dumps(spec)]
    return argv


def _env(bench: Bench, python: str) -> dict[str, str]:
    env = child_env()
    preload(python, env)
    if not bench.gpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(bench.kv_cache_gib()))
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


@dataclass
class Started:
    proc: subprocess.Popen
    url: str
    log: Path
    t0: float


@contextlib.contextmanager
def server(bench: Bench, subject: Subject, log: Path) -> Iterator[Started]:
    """A server for `subject`, starting (`ready` awaits it). Stopped on leaving, however we
    leave."""
    port = free_port()
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = start_group(server_argv(bench, subject, port), stdin=subprocess.DEVNULL,
                           stdout=out, stderr=subprocess.STDOUT, env=_env(bench, subject.python))  # fmt: skip
    try:
        yield Started(proc, f"http://127.0.0.1:{port}", log, t0)
    finally:
        t1 = time.perf_counter()
        stop_server(proc, port)
        subject.timing["stop_s"] = time.perf_counter() - t1


def ready(bench: Bench, subject: Subject, up: Started) -> None:
    wait_ready(up.proc, up.url, bench.args.ready_timeout, up.log)
    subject.timing["start_s"] = time.perf_counter() - up.t0
    say(f"serve: {subject.name}: server ready on {up.url.removeprefix('http://')} "
        f"({subject.timing['start_s']:.1f}s)")  # fmt: skip


def wait_ready(proc: subprocess.Popen, url: str, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            lines = log.read_text(errors="replace").splitlines(keepends=True)
            raise EngineError(f"the vLLM server exited ({proc.returncode}) before it was ready: "
                              f"{last_error(lines)} (all it printed: {log})")  # fmt: skip
        if _healthy(url):
            return
        time.sleep(0.5)
    raise EngineError(f"the vLLM server was not ready in {timeout:.0f}s (--ready-timeout; all "
                      f"it printed: {log})")  # fmt: skip


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def stop_server(proc: subprocess.Popen, port: int) -> None:
    """SIGTERM to its process group, SIGKILL after STOP_GRACE_S; then nothing of the group may
    be left and the port must be closed."""
    end_group(proc, STOP_GRACE_S)
    if listening(port):
        raise EngineError(f"127.0.0.1:{port} still listening after its server stopped")


# ----------------------------------------------------------------------------- the client


def passes_of(bench: Bench, subject: Subject) -> list[dict]:
    """Every concurrency over all prompts; a drafter also one pass per (category, length)
    group at the highest concurrency, where there are several groups."""
    everything = list(range(len(bench.prompts)))
    out = [{"name": pass_name(c, r), "prompts": everything, "concurrency": c,
            "warmups": 1 if r == 0 else 0}
           for r in range(bench.args.repeat) for c in bench.levels]  # fmt: skip
    groups = bench.groups()
    if subject.path is not None and len(groups) > 1:
        for k, ((category, bucket), indices) in enumerate(sorted(groups.items())):
            out.append({"name": f"group{k}", "prompts": indices, "concurrency": bench.levels[-1],
                        "warmups": 0, "category": category, "bucket": bucket})  # fmt: skip
    return out


def pass_name(concurrency: int, repeat: int) -> str:
    """'c4' (the first pass at concurrency 4), 'c4.2' (its second repeat), ..."""
    return f"c{concurrency}" + (f".{repeat + 1}" if repeat else "")


def request_of(bench: Bench, subject: Subject, url: str) -> dict:
    return {
        "label": subject.name,
        "base_url": url,
        "ready_timeout": bench.args.ready_timeout,
        "model": str(bench.settings.target_path),
        "tokenizer": str(bench.settings.target_path),
        "max_new_tokens": bench.args.max_new_tokens,
        "extra_body": {"stop_token_ids": bench.stops},
        "prompts": bench.ids,
        "passes": passes_of(bench, subject),
    }


@contextlib.contextmanager
def client(bench: Bench, subject: Subject, up: Started, log: Path) -> Iterator[Any]:
    """workload.eval.serve_client in the vLLM python, started at once (it imports vLLM while the
    server starts, then awaits it); the context's value waits for its figures and keeps them
    in `subject.passes`. Killed on leaving early."""
    request = request_of(bench, subject, up.url)
    with tempfile.TemporaryDirectory(prefix="dflash-serve-") as tmp:
        req, out = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request))
        argv = [subject.python, "-m", "workload.eval.serve_client", "--request", str(req), "--out",
                str(out)]  # fmt: skip
        lines: list[str] = []
        t0 = time.perf_counter()
        proc = start_group(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, env=_env(bench, subject.python),
                           cwd=tmp)  # fmt: skip
        reader = threading.Thread(
            target=forward_progress, args=(proc.stderr, lines, "serve: "), daemon=True
        )
        reader.start()

        def finish() -> None:
            code = _wait(proc, bench.args.bench_timeout, log, lines)
            reader.join(timeout=5)
            if code != 0 or not out.is_file():
                raise EngineError(f"the benchmark client failed (exit {code}): "
                                  f"{last_error(lines)}" + keep_output(log, lines))  # fmt: skip
            subject.timing["client_s"] = time.perf_counter() - t0
            keep(bench, subject, request["passes"], json.loads(out.read_text()))

        try:
            yield finish
        finally:
            end_group(proc)


def _wait(proc: subprocess.Popen, timeout: float, log: Path, lines: list[str]) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise EngineError(f"the benchmark client did not finish in {timeout:.0f}s "
                          "(--bench-timeout)" + keep_output(log, lines)) from None  # fmt: skip


def keep(bench: Bench, subject: Subject, passes: list[dict], result: dict) -> None:
    subject.timing["passes_s"] = sum(p["wall_s"] for p in result["passes"].values())
    subject.version = result["version"]
    subject.cuda = result.get("cuda")
    for p in passes:
        subject.passes[p["name"]] = {**result["passes"][p["name"]],
                                     **{k: p[k] for k in ("category", "bucket") if k in p}}  # fmt: skip


# ----------------------------------------------------------------------------- figures


def figures(p: dict) -> dict:
    """One pass as the contract's `spec`/`plain` entry."""
    return {
        "output_tokens_per_s": p.get("output_throughput"),
        "ttft_ms": {"p50": p.get("p50_ttft_ms", p.get("median_ttft_ms")),
                    "p99": p.get("p99_ttft_ms")},
        "tpot_ms": {"p50": p.get("p50_tpot_ms", p.get("median_tpot_ms")),
                    "p99": p.get("p99_tpot_ms")},
        "requests": p.get("completed"),
        "output_tokens": p.get("total_output_tokens"),
        "duration_s": p.get("duration"),
    }  # fmt: skip


@dataclass
class Counts:
    drafts: int = 0
    accepted: int = 0
    per_position: list[int] = field(default_factory=list)

    def add(self, p: dict) -> None:
        drafts = int(p.get("spec_decode_num_drafts") or 0)
        rates = p.get("spec_decode_per_position_acceptance_rates") or []
        self.drafts += drafts
        self.accepted += int(p.get("spec_decode_accepted_tokens") or 0)
        self.per_position.extend([0] * (len(rates) - len(self.per_position)))
        for i, rate in enumerate(rates):
            self.per_position[i] += round(rate * drafts)

    @property
    def tau(self) -> float | None:
        return 1 + self.accepted / self.drafts if self.drafts else None

    def rates(self) -> list[float]:
        return [x / self.drafts for x in self.per_position] if self.drafts else []


def acceptance(bench: Bench, s: Subject) -> dict:
    """per_position and τ over all prompts once (the groups' passes, else the first
    concurrency's), τ per category and per length bucket."""
    groups = [p for p in s.passes.values() if "category" in p]
    overall = Counts()
    for p in groups or [s.passes[f"c{bench.levels[0]}"]]:
        overall.add(p)
    by: dict[str, dict[str, Counts]] = {"category": {}, "bucket": {}}
    if groups:
        for p in groups:
            for key in by:
                by[key].setdefault(p[key], Counts()).add(p)
    else:
        (category, bucket), = bench.groups()  # fmt: skip
        by["category"][category] = by["bucket"][bucket] = overall
    order = [name for _, name in BUCKETS]
    return {
        "tau": overall.tau,
        "per_position": overall.rates(),
        "spec_decode": {
            "drafts": overall.drafts,
            "accepted_tokens": overall.accepted,
            "accepted_per_position": overall.per_position,
        },  # fmt: skip
        "tau_by_category": {k: c.tau for k, c in sorted(by["category"].items())},
        "tau_by_length": {k: by["bucket"][k].tau for k in order if k in by["bucket"]},
    }


def serve_table(bench: Bench, spec: Subject, plain: Subject) -> dict:
    """Per concurrency: spec and plain figures and speedup, each the mean over the repeats; with
    more than one, `spread` (their standard deviation) and `by_repeat` (each repeat's)."""
    out = {}
    for c in bench.levels:
        names = [pass_name(c, r) for r in range(bench.args.repeat)]
        each = [one_repeat(spec.passes[n], plain.passes[n]) for n in names]
        entry = {key: _mean_of([e[key] for e in each]) for key in ("spec", "plain", "speedup")}
        entry["repeats"] = len(each)
        if len(each) > 1:
            entry["spread"] = {key: _spread_of([e[key] for e in each])
                               for key in ("spec", "plain", "speedup")}  # fmt: skip
            entry["by_repeat"] = each
        out[str(c)] = entry
    return out


def one_repeat(a: dict, b: dict) -> dict:
    rate_a, rate_b = a.get("output_throughput"), b.get("output_throughput")
    return {"spec": {**figures(a), "tau": _tau_of(a)}, "plain": figures(b),
            "speedup": rate_a / rate_b if rate_a and rate_b else None}  # fmt: skip


def _mean_of(values: list) -> Any:
    """The mean of numbers, key by key through dicts; None where any repeat has none."""
    if isinstance(values[0], dict):
        return {k: _mean_of([v.get(k) for v in values]) for k in values[0]}
    if any(not isinstance(v, (int, float)) for v in values):
        return None
    return values[0] if len(set(values)) == 1 else statistics.fmean(values)


def _spread_of(values: list) -> Any:
    """The sample standard deviation, key by key, as _mean_of."""
    if isinstance(values[0], dict):
        return {k: _spread_of([v.get(k) for v in values]) for k in values[0]}
    if any(not isinstance(v, (int, float)) for v in values):
        return None
    return statistics.stdev(values)


def _tau_of(p: dict) -> float | None:
    c = Counts()
    c.add(p)
    return c.tau


def subject_result(bench: Bench, s: Subject, plain: Subject, fp: dict) -> dict:
    return {
        "checkpoint": str(s.path.resolve()),
        "checkpoint_sha256": checkpoint_sha256(s.path),
        "fingerprint": fp,
        "serve": serve_table(bench, s, plain),
        **acceptance(bench, s),
    }


def differences(a: dict, b: dict) -> list[str]:
    """The fingerprint keys where two results part, each with both values."""
    keys = sorted(set(a) | set(b))
    return [f"{k}: {json.dumps(a.get(k))} vs {json.dumps(b.get(k))}" for k in keys
            if a.get(k) != b.get(k)]  # fmt: skip


def diff_of(a: dict, b: dict) -> dict:
    """a - b: speedup, tokens/s, TTFT/TPOT per concurrency both have; τ, per position, per
    category and length."""
    serve = {}
    for c in sorted(set(a["serve"]) & set(b["serve"]), key=int):
        x, y = a["serve"][c], b["serve"][c]
        serve[c] = {
            "speedup": _minus(x.get("speedup"), y.get("speedup")),
            "output_tokens_per_s": _minus(x["spec"]["output_tokens_per_s"],
                                          y["spec"]["output_tokens_per_s"]),
            "ttft_ms": {q: _minus(x["spec"]["ttft_ms"][q], y["spec"]["ttft_ms"][q])
                        for q in ("p50", "p99")},
            "tpot_ms": {q: _minus(x["spec"]["tpot_ms"][q], y["spec"]["tpot_ms"][q])
                        for q in ("p50", "p99")},
        }  # fmt: skip
    return {
        "serve": serve,
        "tau": _minus(a.get("tau"), b.get("tau")),
        "per_position": [
            _minus(x, y) for x, y in zip(a["per_position"], b["per_position"], strict=False)
        ],  # fmt: skip
        "tau_by_category": _keyed(a["tau_by_category"], b["tau_by_category"]),
        "tau_by_length": _keyed(a["tau_by_length"], b["tau_by_length"]),
    }


def _keyed(a: dict, b: dict) -> dict:
    return {k: _minus(a[k], b[k]) for k in a if k in b}


def _minus(x: float | None, y: float | None) -> float | None:
    return None if x is None or y is None else x - y


def attach_vs(result: dict, other: dict, axis: str = "drafter") -> None:
    """`vs` and, where the fingerprints agree, `diff`; else `diff_refused` names why. On the
    engine axis (one drafter, two engine environments) the engine is what is compared: its
    version may differ, nothing else."""
    result["vs"] = {k: other.get(k) for k in ("checkpoint", "checkpoint_sha256", "fingerprint",
                                             "serve", "tau", "per_position", "tau_by_category",
                                             "tau_by_length", "engine")}  # fmt: skip
    result["vs_axis"] = axis
    result.pop("diff", None)
    result.pop("diff_refused", None)
    fp = other.get("fingerprint") or {}
    mine = result["fingerprint"]
    if axis == "engine":
        fp, mine = without_engine(fp), without_engine(mine)
    why = differences(mine, fp)
    if why:
        result["diff_refused"] = why
    else:
        result["diff"] = diff_of(result, other)


def without_engine(fp: dict) -> dict:
    """A fingerprint less what belongs to the engine environment: its name and version, and the
    CUDA its torch was built for."""
    out = {**fp, "engine": None}
    if isinstance(fp.get("hardware"), dict):
        out["hardware"] = {**fp["hardware"], "cuda": None}
    return out


def read_vs_result(path: Path) -> dict:
    try:
        other = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise EvalError(f"--vs-result {path}: cannot read a serving result ({exc})") from None
    if not isinstance(other, dict) or "serve" not in other or "fingerprint" not in other:
        raise EvalError(f"--vs-result {path}: not a serving result (no serve/fingerprint)")
    return other


# ----------------------------------------------------------------------------- the run


def fingerprint_of(bench: Bench, s: Subject) -> dict:
    fp = fingerprint(
        prompts_sha256=prompts_sha256(bench.prompts),
        chat_template_sha256=template_sha256(bench.template, bench.tokenizer),
        chat_template_kwargs=bench.kwargs,
        max_new_tokens=bench.args.max_new_tokens,
        block_size=s.block_size,
        target=target_identity(bench.settings.target_path),
        engine={"name": "vllm", "version": s.version},
        dtype=bench.server_args()["dtype"],
    )
    return {
        **fp,
        "concurrency": bench.levels,
        "server_args": bench.server_args(),
        "hardware": with_cuda(bench.hardware, s.cuda),
    }


def run(bench: Bench, out: Path) -> dict:
    """Every subject's server in turn; what each printed is kept in OUT.logs/ only on a
    failure (the error names it)."""
    t0 = time.perf_counter()
    logs = out.with_name(out.name + ".logs")
    logs.mkdir(parents=True, exist_ok=True)
    for s in bench.subjects:
        with (
            server(bench, s, logs / f"{s.name}.server.log") as up,
            client(bench, s, up, logs / f"{s.name}.client.log") as finish,
        ):
            ready(bench, s, up)
            finish()
    shutil.rmtree(logs, ignore_errors=True)
    by = {s.name: s for s in bench.subjects}
    mine, plain = by["checkpoint"], by["plain"]
    fp = fingerprint_of(bench, mine)
    result = subject_result(bench, mine, plain, fp)
    result.update(
        engine={"name": "vllm", "version": mine.version},
        engine_device="gpu" if bench.gpu else "cpu",
        hardware=fp["hardware"],
        repeat=bench.args.repeat,
        warnings=bench.warnings,
        training_overlap=bench.overlap,
        n_prompts=len(bench.prompts),
        max_new_tokens=bench.args.max_new_tokens,
        prompt_set=bench.prompt_set.describe(),
        prompt_tokens={"max": max(map(len, bench.ids)), "total": sum(map(len, bench.ids))},
        groups={f"{c}/{b}": len(v) for (c, b), v in sorted(bench.groups().items())},
    )
    if "vs" in by:
        vs, vs_plain = by["vs"], by.get("vs-plain", plain)
        other = subject_result(bench, vs, vs_plain, fingerprint_of(bench, vs))
        other["engine"] = {"name": "vllm", "version": vs.version}
        if "vs-plain" in by:
            other["engine"]["environment"] = bench.args.vs_engine_name or vs.python
        attach_vs(result, other, "engine" if "vs-plain" in by else "drafter")
    elif bench.args.vs_result is not None:
        attach_vs(result, read_vs_result(bench.args.vs_result))
    timing = {s.name: {k: round(v, 3) for k, v in s.timing.items()} for s in bench.subjects}
    result["timing"] = {**timing, "total_s": round(time.perf_counter() - t0, 3)}
    return result


# ----------------------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = subject_parser("python -m workload.serve_bench", __doc__.split("\n")[0])
    p.add_argument("--vs", type=Path, default=None, help="a second drafter, served side by side")
    p.add_argument("--vs-result", type=Path, default=None,
                   help="a stored serving result to put side by side")  # fmt: skip
    p.add_argument("--vs-vllm-python", default=None, metavar="PATH",
                   help="the checkpoint served side by side in this second vLLM environment")  # fmt: skip
    p.add_argument("--vs-engine-name", default=None, metavar="NAME",
                   help="the second environment's name, as the result keeps it")  # fmt: skip
    p.add_argument(
        "--vs-config",
        type=Path,
        default=None,
        metavar="FILE",
        help="the --vs drafter's run config (default: a run.yaml beside it or above)",
    )
    p.add_argument(
        "--serve-chat-template",
        default=None,
        metavar="FILE",
        help="the server's --chat-template (default: the target tokenizer's own)",
    )
    p.add_argument(
        "--serve-chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="the server's --default-chat-template-kwargs (default: none)",
    )
    p.add_argument("--concurrency", default="1,4,16", help="concurrencies, e.g. 1,4,16")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="each concurrency's pass N times: the mean and its spread")  # fmt: skip
    p.add_argument("--ready-timeout", type=float, default=1800.0, metavar="S")
    p.add_argument("--bench-timeout", type=float, default=10800.0, metavar="S")
    args = p.parse_args(argv)
    given = [a for a in ("vs", "vs_result", "vs_vllm_python") if getattr(args, a) is not None]
    if len(given) > 1:
        p.error(" and ".join("--" + a.replace("_", "-") for a in given) + ": give one")
    args.engine = "vllm"  # for the parity check, which probes the engine
    args.reference = None
    args.serving = {"chat_template": args.serve_chat_template,
                    "chat_template_kwargs": args.serve_chat_template_kwargs
                    or args.chat_template_kwargs}  # fmt: skip
    return args


def vs_parity(args: argparse.Namespace, bench: Bench) -> dict | None:
    """The --vs drafter checked as the checkpoint is (workload/eval/parity.py before_vs): its
    mismatches, and two drafters trained for different chat settings, are refused unless
    --force (then kept in the result, and no difference computed)."""
    if args.vs is None:
        return None
    try:
        found = before_vs(args.config, args.vs, args.vs_config, args.overrides, bench.python,
                          args.serving)  # fmt: skip
    except ParityError as exc:
        raise EvalError(f"parity: --vs {args.vs}: {exc}") from None
    if "unknown" in found:
        say(f"serve: not checked: {found['unknown']}")
        return found
    lines = found["mismatches"] + ([found["apart"]] if found["apart"] else [])
    if lines and not args.force:
        raise EvalError("\neval: error: ".join(f"parity: --vs {args.vs}: {x}" for x in lines)
                        + "\neval: error: (--force serves them anyway, marked in the result)")  # fmt: skip
    return {**found, "forced": bool(lines)}


def _on_term(_signum: int, _frame: Any) -> None:
    raise Interrupted


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_term)
    try:
        bench = Bench(args)
        parity = parity_check(args)
        vs_checked = vs_parity(args, bench)
        say(f"serve: {len(bench.prompts)} prompts, max {args.max_new_tokens} new tokens, "
            f"concurrency {','.join(map(str, bench.levels))}, in vLLM ({bench.python}): "
            + ", then ".join(s.name for s in bench.subjects)
            + (f" (vs: in {bench.vs_python})" if bench.vs_python else ""))  # fmt: skip
        result = run(bench, args.out)
        result["parity"] = parity
        if vs_checked is not None:
            result["vs_parity"] = vs_checked
            if vs_checked.get("apart"):  # an A/B of two chat settings: no difference
                result.pop("diff", None)
                result["diff_refused"] = [*result.get("diff_refused", []), vs_checked["apart"]]
        write_json_atomic(args.out, result)
    except EvalError as exc:
        print(f"eval: error: {exc}", file=sys.stderr)
        return 2
    except EngineError as exc:
        print(f"eval: error: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Interrupted):
        print("serve: interrupted; the servers are stopped", file=sys.stderr)
        return 130
    say(summary_line(result, args.out))
    return 0


def summary_line(result: dict, out: Path) -> str:
    parts = [f"{c}: {_x(e.get('speedup'))}" for c, e in result["serve"].items()]
    return (f"serve: tau {_f(result.get('tau'))}, speedup by concurrency "
            + ", ".join(parts) + f" -> {out}")  # fmt: skip


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _x(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"
