"""`python -m workload.datagen`: the target answers a chat corpus again, turn by turn (CONTRACTS §7).

```
python -m workload.datagen --prompts FILE --target PATH --out DIR
    [--engine vllm|transformers] [--max-new-tokens N] [--temperature T]
    [--chat-template-kwargs JSON] [--tensor-parallel-size N] [--max-model-len N]
    [--chunk N] [--check-only] [--finalize]
    [--seed N] [--batch-size N] [--nnodes N --node-rank I]
```

- `--prompts FILE`: JSONL conversations, `{"messages": [{"role", "content"}, ...]}` or ShareGPT's
  `{"conversations": [{"from", "value"}, ...]}` (see workload/data/datagen/conversations.py for which turns
  are answered). Every line is checked before any engine starts; a malformed one is one line on
  stderr, `error: FILE:LINE: what is wrong`, exit 2. `--check-only` does only that check
  (exit 0 and one `ok:` line, or exit 2).
- `--target PATH`: a model directory (config.json, weights, tokenizer with its chat template).
  Each prompt is rendered with the target's chat template and `--chat-template-kwargs` (a JSON
  object, e.g. `{"enable_thinking": false}`) by the tokenizer, then given to the engine as token
  ids, so both engines see identical inputs.
- `--engine`: `vllm` (default where `import vllm` works in this python) or `transformers`.
  vLLM runs with the target's dtype (float32 on CPU, with enforce_eager; VLLM_CPU_KVCACHE_SPACE=1
  unless set) and `--tensor-parallel-size` GPUs per process; transformers runs `generate` on
  left-padded batches of `--batch-size` (default 64), one GPU (or the CPU) per process.
- `--max-new-tokens` (default 8192: thinking replies often run past 2048), `--temperature` (default 0: greedy; above 0 plain sampling,
  top-p 1, no top-k, in both engines), `--seed` (default 0).
- `--max-model-len` (default: the target's max_position_embeddings): a prompt of N tokens leaves
  `max-model-len - N` for its reply (the reply budget is the smaller of that and
  `--max-new-tokens`); a prompt with no room left fails the conversation, "too long for the
  context (N tokens > M - 1)", counted before the engine sees it.
- `--chunk N` (default 512): the input is cut into global chunks of N conversations (chunk k =
  conversations [k*N, (k+1)*N)); chunk k goes to rank k % WORLD_SIZE. The whole chunk goes to
  the engine at once, one call per assistant turn index.
- `--finalize`: start no engine; reconcile the chunk files in DIR (e.g. after other nodes'
  chunks were copied in), verify each file's sha256, write DIR/manifest.json; exit 0 when
  complete, 1 when not (the missing chunks are named).

Processes: run it alone (one process) or under torchrun, one process per GPU (or per
`--tensor-parallel-size` GPUs), several nodes through a c10d rendezvous, or several nodes with
no rendezvous at all: each node started on its own (alone or under a one-node torchrun) with
`--nnodes N --node-rank I`, its processes then being ranks I*L .. I*L+L-1 of N*L (L its local
processes; every node the same L). Each such node writes its own DIR (its share of the chunks;
its manifest is not complete until the other nodes' chunks are copied in and `--finalize`
reconciles them) and its local rank 0 keeps that DIR's state.json. RANK, LOCAL_RANK,
WORLD_SIZE and LOCAL_WORLD_SIZE come from the environment; each process claims its GPUs through
CUDA_VISIBLE_DEVICES (local rank r: GPUs [r*tp, (r+1)*tp) of those visible), and torchrun's
variables (RANK, MASTER_ADDR, TORCHELASTIC_*, ...) are removed from the environment before the
engine starts, so vLLM's own processes never take them for theirs. No process group is made:
ranks share nothing but DIR.

Output in DIR (see workload/data/datagen/output.py for the layout): `chunk_<K>.jsonl` of
`{"messages", "source": "FILE:LINE", "turns"}` records (`turns`: per assistant turn the
engine's own `prompt_ids`, `reply_ids`, ending with the stop token it produced, and
`finish_reason` "stop" or "length"; a reply with reasoning goes into the messages as
`reasoning_content` + `content`) and `chunks/chunk_<K>.json` with the chunk's
done / failed / skipped and each failure's reason ("too long for the context (...)", "empty
reply", "engine error: ...", "chat template: ...") and source line, written atomically per
chunk. Run again with the same arguments (any world size), a job repeats no finished chunk; a
chunk cut short (SIGKILL) is made again from the start; other arguments into the same DIR are
refused (exit 2). SIGTERM or SIGINT: the rank finishes its current chunk, then exits 0 with
status "stopped" (a second signal exits at once, like a kill). Each rank keeps
DIR/ranks/rank_<R>.json (rank, world_size, assigned, done, failed, skipped, time, status, ...)
and prints one progress line per chunk; ranks other than 0 print into DIR/ranks/rank_<R>.log.
Rank 0 keeps DIR/state.json (kind, pid, started, total, status: starting, running once its
engine is up, then finished, stopped or failed; exit_code). A stop asked of it (SIGTERM) is
passed on to the other ranks of its machine that write into DIR (by their heartbeats' pid and
start time), so stopping the one pid in state.json stops the node. Every rank, as it ends, reconciles DIR
into DIR/manifest.json (`complete` once every chunk is there).

Exit codes: 0 done or stopped; 1 failed (an engine that does not start or dies); 2 bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workload.common.layout import RANKS_DIR
from workload.common.rank_files import Heartbeat, process_start_ticks, redirect_output
from workload.common.run_state import RunState
from workload.common.stop_flag import StopFlag
from workload.data.datagen import output as store
from workload.data.datagen.conversations import (
    NO_USER_TURN,
    Conversation,
    InputError,
    Source,
    has_user_turn,
    read_chunk,
    reply_points,
    scan,
)
from workload.data.datagen.engines import (
    EngineSettings,
    engine_version,
    make_engine,
    vllm_importable,
)
from workload.data.datagen.output import ChunkResult, OutputError

DEFAULT_CHUNK = 512
DEFAULT_MAX_NEW_TOKENS = 8192  # thinking replies run long: docs/workload-design.md
DEFAULT_BATCH = 64
TORCHRUN_PREFIXES = ("TORCHELASTIC_",)
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                 "MASTER_ADDR", "MASTER_PORT")  # fmt: skip


class UsageError(Exception):
    """Bad arguments or input: one line, exit 2."""


# ---------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m workload.datagen", description=__doc__.split("\n")[0]
    )
    p.add_argument("--prompts", required=True, help="JSONL conversations to answer again")
    p.add_argument("--target", help="the target model directory")
    p.add_argument("--out", help="the dataset directory to write")
    p.add_argument("--engine", choices=("vllm", "transformers"), default=None,
                   help="default: vllm where `import vllm` works, else transformers")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--chat-template-kwargs", default="{}", help="a JSON object")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--chunk", type=int, default=DEFAULT_CHUNK)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH, help="transformers only")
    p.add_argument("--check-only", action="store_true", help="check the input and exit")
    p.add_argument("--finalize", action="store_true", help="reconcile DIR into its manifest")
    p.add_argument("--nnodes", type=int, default=1, help="nodes started on their own")
    p.add_argument("--node-rank", type=int, default=0, help="this node of --nnodes")
    return p.parse_args(argv)


def check_args(a: argparse.Namespace) -> dict[str, Any]:
    """Refuse bad values in one line; returns the chat template kwargs."""
    for name in ("max_new_tokens", "chunk", "tensor_parallel_size", "batch_size"):
        if getattr(a, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}: {getattr(a, name)}: must be at least 1")
    if a.max_model_len is not None and a.max_model_len < 2:
        raise UsageError(f"--max-model-len: {a.max_model_len}: must be at least 2")
    if not a.temperature >= 0:
        raise UsageError(f"--temperature: {a.temperature}: must be 0 (greedy) or more")
    try:
        kwargs = json.loads(a.chat_template_kwargs)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--chat-template-kwargs: not JSON ({exc.msg}): "
                         f"{a.chat_template_kwargs}") from None  # fmt: skip
    if not isinstance(kwargs, dict):
        raise UsageError(f"--chat-template-kwargs: expected a JSON object, such as "
                         f'\'{{"enable_thinking": false}}\', got {a.chat_template_kwargs}')  # fmt: skip
    if not a.check_only:
        for name in ("target", "out"):
            if not getattr(a, name):
                raise UsageError(f"--{name} is required (unless --check-only)")
        if not (Path(a.target) / "config.json").is_file():
            raise UsageError(f"--target {a.target}: no config.json there (not a model directory)")
        if a.engine == "transformers" and a.tensor_parallel_size > 1:
            raise UsageError("--tensor-parallel-size above 1 needs --engine vllm")
    return kwargs


@dataclass(frozen=True)
class TargetInfo:
    path: Path
    dtype: str
    max_position_embeddings: int | None


def target_info(path: Path) -> TargetInfo:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"--target {path}: cannot read config.json: {exc}") from None
    text = config.get("text_config") or {}
    dtype = config.get("dtype") or config.get("torch_dtype") or text.get("dtype")
    dtype = dtype or text.get("torch_dtype") or "bfloat16"
    mpe = config.get("max_position_embeddings") or text.get("max_position_embeddings")
    return TargetInfo(path, str(dtype), mpe)


def context_length(asked: int | None, target: TargetInfo) -> int:
    """--max-model-len, within the target's max_position_embeddings (its default)."""
    mpe = target.max_position_embeddings
    if asked is None:
        if not mpe:
            raise UsageError(f"--target {target.path}: no max_position_embeddings in "
                             "config.json: give --max-model-len")  # fmt: skip
        return int(mpe)
    if mpe and asked > mpe:
        raise UsageError(f"--max-model-len {asked}: more than the target's "
                         f"max_position_embeddings ({mpe})")  # fmt: skip
    return asked


# ---------------------------------------------------------------- processes and devices


@dataclass(frozen=True)
class Place:
    rank: int
    local_rank: int
    world: int
    local_world: int


def take_place() -> Place:
    """This process's rank from torchrun's environment, then that environment removed (the
    engine's own processes must not mistake it for theirs: with TORCHELASTIC_USE_AGENT_STORE,
    a torch process group made in them would wait on torchrun's store)."""
    env = os.environ
    place = Place(int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)),
                  int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_WORLD_SIZE", 1)))  # fmt: skip
    for name in list(env):
        if name in TORCHRUN_VARS or name.startswith(TORCHRUN_PREFIXES):
            del env[name]
    return place


def on_node(place: Place, nnodes: int, node_rank: int) -> Place:
    """This process's place among `nnodes` nodes started on their own (no rendezvous): the
    node's local processes are its ranks, numbered after the nodes before it."""
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise UsageError(f"--node-rank {node_rank} --nnodes {nnodes}: need 0 <= node rank "
                         "< nnodes")  # fmt: skip
    if nnodes == 1:
        return place
    if place.world != place.local_world:
        raise UsageError(f"--nnodes {nnodes}: for nodes started on their own; this one is one "
                         f"of a rendezvous of {place.world} processes")  # fmt: skip
    local = place.local_world
    return Place(node_rank * local + place.local_rank, place.local_rank, nnodes * local, local)


def claim_devices(place: Place, tp: int) -> tuple[str, int | None]:
    """("cuda", None) with CUDA_VISIBLE_DEVICES narrowed to this local rank's GPUs, or
    ("cpu", threads): this local rank's share of the CPUs but one (vLLM's OpenMP threads bound
    to them when several ranks share the machine; on a shared CPU a second torch thread of
    a small model can make it many times slower, not faster)."""
    import torch

    count = torch.cuda.device_count()  # NVML: no CUDA context made, the env still decides
    if count:
        first = place.local_rank * tp
        if first + tp > count:
            raise UsageError(f"local rank {place.local_rank} needs GPUs {first}..{first + tp - 1}"
                             f" (--tensor-parallel-size {tp}) and {count} are visible: start at"
                             f" most {count // tp} processes per node")  # fmt: skip
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(count)]
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids[first : first + tp])
        return "cuda", None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > place.local_world:
        cpus = cpus[:-1]  # one core left for the rest of the work, as vLLM's CPU engine does
    per = max(1, len(cpus) // place.local_world)
    mine = cpus[place.local_rank * per : (place.local_rank + 1) * per]
    mine = mine or [cpus[place.local_rank % len(cpus)]]
    if place.local_world > 1:  # alone, vLLM's own binding ("auto") does the same
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, mine)))
    return "cpu", len(mine)


# ---------------------------------------------------------------- rendering and one chunk


class Renderer:
    """Chat template + kwargs -> token ids (the tokenizer's own rendering), and ids -> text."""

    def __init__(self, tokenizer: Any, kwargs: dict[str, Any]) -> None:
        self.tokenizer = tokenizer
        self.kwargs = kwargs

    def __call__(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **self.kwargs
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


@dataclass
class _Pending:
    conv: Conversation
    messages: list[dict[str, Any]]
    points: list[int]
    error: str | None = None
    turns: list[dict[str, Any]] = field(default_factory=list)  # the engine's own tokens


def regenerate_chunk(k: int, convs: list[Conversation], source_name: str, render: Renderer,
                     engine: Any, max_new_tokens: int, max_model_len: int) -> ChunkResult:  # fmt: skip
    """Answer every conversation of the chunk turn by turn: all its conversations' n-th
    assistant turns go to the engine in one call, each given the conversation so far (with
    the target's own earlier replies)."""
    t0 = time.time()
    result = ChunkResult(k, convs[0].line if convs else 0, len(convs))
    pending: list[_Pending] = []
    for c in convs:
        if has_user_turn(c.messages):
            pending.append(_Pending(c, copy.deepcopy(c.messages), reply_points(c.messages)))
        else:
            result.skips.append({"source": f"{source_name}:{c.line}", "reason": NO_USER_TURN})
    turn = 0
    while active := [p for p in pending if p.error is None and turn < len(p.points)]:
        asked, prompts, budgets = [], [], []
        for p in active:
            ids = _prompt(p, turn, render, max_model_len)
            if ids is not None:
                asked.append(p)
                prompts.append(ids)
                budgets.append(min(max_new_tokens, max_model_len - len(ids)))
        result.prompt_tokens += sum(map(len, prompts))
        replies = engine.generate(prompts, budgets)
        for p, ids, reply in zip(asked, prompts, replies, strict=True):
            result.generated_tokens += len(reply.token_ids)
            _answer(p, turn, ids, reply, render, result)
        turn += 1
    for p in pending:
        src = f"{source_name}:{p.conv.line}"
        if p.error is None:
            result.records.append({"messages": p.messages, "source": src, "turns": p.turns})
        else:
            result.failures.append({"source": src, "reason": p.error})
    result.seconds = time.time() - t0
    return result


def _turn_note(p: _Pending, turn: int) -> str:
    return f" (assistant turn {turn + 1})" if len(p.points) > 1 else ""


def _prompt(p: _Pending, turn: int, render: Renderer, max_model_len: int) -> list[int] | None:
    try:
        ids = render(p.messages[: p.points[turn]])
    except Exception as exc:  # a template that refuses this conversation (jinja raise_exception)
        p.error = f"chat template: {' '.join(str(exc).split())[:300]}{_turn_note(p, turn)}"
        return None
    if len(ids) >= max_model_len:
        p.error = (f"too long for the context ({len(ids)} tokens > {max_model_len - 1})"
                   f"{_turn_note(p, turn)}")  # fmt: skip
        return None
    return ids


def _answer(p: _Pending, turn: int, prompt: list[int], reply: Any, render: Renderer,
            result: ChunkResult) -> None:  # fmt: skip
    if reply.error:
        p.error = reply.error + _turn_note(p, turn)
        return
    text = render.decode(reply.token_ids)
    if not text.strip():
        p.error = "empty reply" + _turn_note(p, turn)
        return
    result.truncated += not reply.finished
    result.replies += 1
    ends = [reply.stop_id] if reply.finished and reply.stop_id is not None else []
    p.turns.append({"prompt_ids": list(prompt), "reply_ids": [*reply.token_ids, *ends],
                    "finish_reason": "stop" if reply.finished else "length"})  # fmt: skip
    at, message = p.points[turn], reply_message(text)
    if at == len(p.messages):
        p.messages.append(message)
    else:
        p.messages[at] = message


def reply_message(text: str) -> dict[str, Any]:
    """The reply as the next turn's history, as a served client sends it back: the reasoning
    (up to `</think>`) as `reasoning_content`, the answer as `content`; the template decides
    whether the reasoning is rendered."""
    if "</think>" not in text:
        return {"role": "assistant", "content": text}
    reasoning, answer = text.split("</think>", 1)
    reasoning = reasoning.split("<think>")[-1].strip("\n")
    return {"role": "assistant", "content": answer.lstrip("\n"), "reasoning_content": reasoning}


# ---------------------------------------------------------------- progress


class Progress:
    """This rank's counts (its chunks finished before included) and rates of this start."""

    def __init__(self, assigned: int, chunks: int, earlier: list[dict]) -> None:
        self.assigned, self.chunks = assigned, chunks
        self.counts = {key: sum(r[key] for r in earlier) for key in ("done", "failed", "skipped")}
        self.chunks_done = len(earlier)
        self.new_convs = self.new_tokens = 0
        self.t0 = time.time()

    def add(self, record: dict) -> None:
        for key in self.counts:
            self.counts[key] += record[key]
        self.chunks_done += 1
        self.new_convs += record["count"]
        self.new_tokens += record["generated_tokens"]

    def fields(self) -> dict[str, Any]:
        elapsed = max(time.time() - self.t0, 1e-9)
        rate = self.new_convs / elapsed
        left = self.assigned - sum(self.counts.values())
        return {"assigned": self.assigned, **self.counts, "chunks_assigned": self.chunks,
                "chunks_done": self.chunks_done, "conversations_per_s": round(rate, 3),
                "tokens_per_s": round(self.new_tokens / elapsed, 1),
                "eta_s": round(left / rate) if rate > 0 else None}  # fmt: skip

    def line(self, place: Place, k: int) -> str:
        f = self.fields()
        eta = "?" if f["eta_s"] is None else _duration(f["eta_s"])
        finished = f["done"] + f["failed"] + f["skipped"]
        return (f"[datagen] rank {place.rank}/{place.world} chunk {k} "
                f"({f['chunks_done']}/{self.chunks} chunks): {finished}/{self.assigned} "
                f"conversations (done {f['done']}, failed {f['failed']}, skipped "
                f"{f['skipped']}), {f['conversations_per_s']:.2f} conv/s, "
                f"{f['tokens_per_s']:.0f} tok/s, ETA {eta}")  # fmt: skip


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


# ---------------------------------------------------------------- the job


def say(msg: str) -> None:
    print(f"[datagen] {msg}", flush=True)


def load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not tokenizer.chat_template:
        raise UsageError(f"--target {path}: its tokenizer has no chat template")
    return tokenizer


def stop_ids(path: Path, tokenizer: Any) -> list[int]:
    """The generation config's eos ids and the tokenizer's eos: both engines stop at these."""
    ids: set[int] = set()
    try:
        gen = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        gen = None
    for value in ([gen] if isinstance(gen, int) else gen or []) + [tokenizer.eos_token_id]:
        if isinstance(value, int):
            ids.add(value)
    if not ids:
        raise UsageError(f"--target {path}: no eos token (generation_config.json, tokenizer)")
    return sorted(ids)


def job_settings(a: argparse.Namespace, source: Source, target: TargetInfo, engine: str,
                 kwargs: dict, tokenizer: Any, max_model_len: int) -> dict:  # fmt: skip
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else json.dumps(
        tokenizer.chat_template, sort_keys=True)  # fmt: skip
    return {
        "source": {"path": str(source.path.resolve()), "sha256": source.sha256,
                   "total": source.total},
        "target": {"path": str(target.path.resolve()), "digest": store.target_digest(target.path)},
        "engine": {"name": engine, "version": engine_version(engine)},
        "sampling": {"temperature": a.temperature, "max_new_tokens": a.max_new_tokens},
        "chat_template_kwargs": kwargs,
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(),
        "max_model_len": max_model_len, "chunk": a.chunk, "seed": a.seed,
    }  # fmt: skip


def pick_engine(requested: str | None) -> str:
    if requested:
        return requested

    return "vllm" if vllm_importable() else "transformers"


class Job:
    """One rank's run: its chunks, its engine, its files."""

    def __init__(self, a: argparse.Namespace, place: Place, source: Source, kwargs: dict) -> None:
        self.a, self.place, self.source, self.kwargs = a, place, source, kwargs
        self.out = Path(a.out)
        self.beat = Heartbeat(self.out, place.rank, place.local_rank, place.world)
        self.beat.fields.pop("step", None)
        self.keeps_state = place.rank == 0 or (a.nnodes > 1 and place.local_rank == 0)
        self.state = RunState(self.out, self.keeps_state)
        self.engine: Any = None
        self.stopped_ranks: set[int] = set()  # pids this rank passed a stop on to
        self.owner = False  # True once DIR's job.json accepted this run's settings

    def run(self, stop: Any) -> int:
        a, place = self.a, self.place
        device, threads = claim_devices(place, a.tensor_parallel_size)
        target = target_info(Path(a.target))
        tokenizer = load_tokenizer(target.path)
        max_model_len = context_length(a.max_model_len, target)
        engine_name = pick_engine(a.engine)
        settings = job_settings(a, self.source, target, engine_name, self.kwargs, tokenizer,
                                max_model_len)  # fmt: skip
        digest = store.ensure_job(self.out, settings)  # from here on, DIR's job is ours
        self.owner = True
        self.beat.update(status="starting")
        self.state.update(kind="datagen", pid=os.getpid(), pid_start=process_start_ticks(),
                          started=time.time(), finished=None, exit_code=None, status="starting",
                          world_size=place.world, total=self.source.total)  # fmt: skip
        stop.then(self._pass_stop_on)  # at once: the other ranks need not wait for our step
        store.remove_stale_temporaries(self.out)
        mine = [k for k in range(self.source.chunks) if k % place.world == place.rank]
        finished = store.read_records(self.out)
        earlier = [finished[k] for k in mine if k in finished]
        todo = [k for k in mine if k not in finished]
        progress = Progress(sum(self.source.chunk_size(k) for k in mine), len(mine), earlier)
        self.beat.update(engine=engine_name, **progress.fields())
        say(f"rank {place.rank}/{place.world}: {len(mine)} chunks of {self.source.chunks} "
            f"({progress.assigned} conversations), {len(earlier)} finished before; "
            f"engine {engine_name} on {device}")  # fmt: skip
        if todo and not stop.requested:
            try:
                self._start_engine(engine_name, target, device, threads, tokenizer,
                                   max_model_len)  # fmt: skip
            except Exception:
                if not stop.requested:
                    raise
                todo = []  # stopped while the engine started: nothing was begun
            progress.t0 = time.time()  # rates of generation, not of the engine's start
        self.beat.update(status="running")
        self.state.update(status="running")
        render = Renderer(tokenizer, self.kwargs)
        for k in todo:
            if stop.requested:
                break
            convs = read_chunk(self.source, k)
            try:
                result = regenerate_chunk(k, convs, self.source.name, render, self.engine,
                                          a.max_new_tokens, max_model_len)  # fmt: skip
            except Exception as exc:
                if not stop.requested:
                    raise
                # the signal reached the engine's processes too (sent to the process group)
                say(f"rank {place.rank}: chunk {k} dropped: the engine ended with the stop "
                    f"({type(exc).__name__})")  # fmt: skip
                break
            record = store.write_chunk(self.out, result, digest, place.rank)
            progress.add(record)
            self.beat.update(**progress.fields())
            print(progress.line(place, k), flush=True)
        if stop.requested:
            self._pass_stop_on()
        stopped = progress.chunks_done < len(mine)
        return self._finish("stopped" if stopped else "done")

    def _pass_stop_on(self) -> None:
        """The stop asked of the pid in state.json, to this machine's other ranks in DIR (once
        each: a second signal ends a rank at once). Run as the stop arrives, and again after
        the loop for a rank that had not written its record by then."""
        if not self.keeps_state or self.place.local_world == 1:
            return

        for beat in sorted((self.out / RANKS_DIR).glob("rank_*.json")):
            try:
                info = json.loads(beat.read_text())
                pid = int(info["pid"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if pid in self.stopped_ranks or pid == os.getpid():
                continue
            if info.get("status") not in ("starting", "running"):
                continue
            with contextlib.suppress(OSError):  # gone meanwhile
                if process_start_ticks(pid) == info.get("pid_start"):
                    os.kill(pid, signal.SIGTERM)
                    self.stopped_ranks.add(pid)

    def _start_engine(self, name: str, target: TargetInfo, device: str, threads: int | None,
                      tokenizer: Any, max_model_len: int) -> None:  # fmt: skip
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids(
            target.path, tokenizer)[0]  # fmt: skip
        settings = EngineSettings(
            target=target.path, dtype=target.dtype if device == "cuda" else "float32",
            device=device, max_model_len=max_model_len,
            tensor_parallel_size=self.a.tensor_parallel_size, seed=self.a.seed,
            temperature=self.a.temperature, stop_ids=tuple(stop_ids(target.path, tokenizer)),
            pad_id=pad, batch_size=self.a.batch_size, threads=threads,
        )  # fmt: skip
        t0 = time.time()
        self.engine = make_engine(name, settings)
        started = round(time.time() - t0, 1)
        say(f"rank {self.place.rank}: engine {name} {self.engine.version} up in {started}s")
        self.beat.update(engine_start_s=started, engine_version=self.engine.version)
        self.state.update(engine_start_s=started)

    def _finish(self, status: str) -> int:
        self.close()
        self.beat.update(status=status, exit_code=0)
        manifest = store.reconcile(self.out)
        nodes = self.a.nnodes
        share = f" (node {self.a.node_rank} of {nodes}: its share)" if nodes > 1 else ""
        say(f"rank {self.place.rank}: {status}; {self.out / store.MANIFEST}{share}: "
            f"{_manifest_summary(manifest)}")  # fmt: skip
        state = "finished" if status == "done" else status  # the operator's job contract
        self.state.update(status=state, finished=time.time(), exit_code=0)
        return 0

    def fail(self, code: int) -> None:
        """Record the failure, in DIR only when this run's settings were accepted there."""
        self.close()
        if not self.owner:
            return
        self.beat.update(status="failed", exit_code=code)
        self.state.update(status="failed", finished=time.time(), exit_code=code)

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            try:
                engine.close()
            except Exception as exc:  # shutting down must not hide how the job ended
                say(f"engine shutdown: {type(exc).__name__}: {exc}")


def _manifest_summary(m: dict) -> str:
    state = "complete" if m["complete"] else "not complete"
    missing = m["chunks"]["total"] - m["chunks"]["finished"]
    tail = f", {missing} of {m['chunks']['total']} chunks to go" if missing else ""
    return (f"{state}: done {m['done']}, failed {m['failed']}, skipped {m['skipped']} of "
            f"{m['input']}{tail}")  # fmt: skip


def finalize(a: argparse.Namespace, source: Source) -> int:
    out = Path(a.out)
    job = store.read_job(out)
    settings = job["settings"]
    if settings["source"]["sha256"] != source.sha256:
        raise UsageError(f"--prompts {a.prompts}: not the input {out} was made from "
                         f"({settings['source']['path']}, sha256 {settings['source']['sha256'][:12]})")  # fmt: skip  # noqa: E501
    digest = store.target_digest(Path(a.target))
    if settings["target"]["digest"] != digest:
        raise UsageError(f"--target {a.target}: not the target {out} was made with "
                         f"({settings['target']['path']})")  # fmt: skip
    manifest = store.reconcile(out, verify=True)
    print(f"{out / store.MANIFEST}: {_manifest_summary(manifest)}", flush=True)
    for problem in manifest["chunks"]["problems"]:
        print(f"  {problem}", flush=True)
    if not manifest["complete"] and manifest["chunks"]["missing"]:
        shown = ", ".join(map(str, manifest["chunks"]["missing"][:20]))
        print(f"  missing chunks: {shown}", flush=True)
    return 0 if manifest["complete"] else 1


def main(argv: list[str] | None = None) -> int:
    stop = StopFlag()  # before torch and transformers are imported (seconds): a stop then counts
    try:
        return _main(argv, stop)
    finally:
        stop.restore()


def _main(argv: list[str] | None, stop: StopFlag) -> int:
    a = parse_args(argv)
    place = take_place()
    try:
        place = on_node(place, a.nnodes, a.node_rank)
        if not a.check_only and a.out:
            redirect_output(Path(a.out), place.rank)
        kwargs = check_args(a)
        source = scan(a.prompts, a.chunk)
    except (UsageError, InputError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    if a.check_only:
        print(f"ok: {a.prompts}: {source.total} conversations", flush=True)
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        if a.finalize:
            return finalize(a, source)
    except (UsageError, OutputError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    return _run(a, place, source, kwargs, stop)


def _run(a: argparse.Namespace, place: Place, source: Source, kwargs: dict, stop: StopFlag) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    job = Job(a, place, source, kwargs)
    try:
        return job.run(stop)
    except (UsageError, OutputError) as exc:
        job.fail(2)
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except Exception as exc:
        traceback.print_exc()
        job.fail(1)
        print(f"error: rank {place.rank}: {type(exc).__name__}: {exc}", file=sys.stderr,
              flush=True)  # fmt: skip
        return 1
