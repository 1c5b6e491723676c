"""Starting, following and combining a datagen job (the kind: runs/datagen/kind.py).

Start: one read of the chosen targets (the target model there, the engine's environment, the
code snapshot, GPUs), then the job starts as any job starts (lifecycle/start.py: its name claimed, the
code snapshot, launch.json, the launcher in a detached tmux session on each target), after its
input is pushed into every node's <ws>/data/NAME/input/ (a verified copy) and checked there by
the generator (`--check-only`): a malformed line is refused in one line naming FILE:LINE, exit
2, and what was made is taken back.

Several targets share the input by chunks (chunk k goes to rank k % WORLD; node i's processes
are ranks i*L .. i*L+L-1): no conversation is generated twice, and each node's directory holds
its share. Combining (`collect`, run by `--follow` at the end or by `datagen NAME --collect`):
the chunks node 0 lacks are copied from the other nodes into its directory, each node to node 0
through this process (relay.py: tar there, remote/receive.py here, every file landing
atomically, hashed as it lands), then the generator's `--finalize` on node 0 checks every chunk
against its record (size and sha256) and writes the complete manifest. A copy cut short is
resumed by running it again: the chunks that arrived are not sent again. The other nodes keep
their share.
"""

from __future__ import annotations

import json
import posixpath
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflashops import context, engine_envs, transfer
from dflashops import remote as helpers
from dflashops.errors import NotFoundError, OpsError, TransferError, UsageError
from dflashops.inventory import Target
from dflashops.relay import relay
from dflashops.remote import layout
from dflashops.render import Stopwatch, duration
from dflashops.runs.datagen.kind import DATAGEN, SETTINGS
from dflashops.runs.lifecycle.claim import take_back
from dflashops.runs.lifecycle.placement import Node, Placement, new_run_id, nproc_of, torchrun
from dflashops.runs.lifecycle.snapshot import Code, local_code
from dflashops.runs.lifecycle.start import NotRead, each_node, start_job, wait_for_life
from dflashops.runs.reading.probe import Probe, probe
from dflashops.runs.reading.survey import refresh
from dflashops.runs.reading.view import RunView
from dflashops.runs.watching.log_stream import stream_log
from dflashops.ssh.session import Session
from dflashops.targets.base import Machine

LONG_S = 900.0  # the deadline of a pass over the whole input or dataset (it prints at the end)
BATCH = 400  # chunks per copy (each a tar of 800 names)
INPUT = "input"  # <ws>/data/NAME/input/<the prompts file's name>: not a *.jsonl of the dataset
MANIFEST = "manifest.json"


@dataclass
class Request:
    """What the user asked of the generator."""

    prompts: Path  # the local input file
    target: str  # the target model's directory, on every target
    engine: str | None  # None: vllm where every target has its environment, else transformers
    max_new_tokens: int
    temperature: float
    chat_template_kwargs: dict[str, Any]
    chunk: int | None = None
    tensor_parallel_size: int = 1
    nproc: int | None = None

    def options(self) -> list[str]:
        out = ["--max-new-tokens", str(self.max_new_tokens),
               "--temperature", repr(self.temperature),
               "--chat-template-kwargs", json.dumps(self.chat_template_kwargs)]  # fmt: skip
        if self.chunk is not None:
            out += ["--chunk", str(self.chunk)]
        if self.tensor_parallel_size > 1:
            out += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        return out


@dataclass
class Started:
    placement: Placement
    view: RunView | None  # None under --dry-run


def long(machine: Machine) -> float:
    return max(machine.timeout or 0.0, LONG_S)


def input_path(target: Target, name: str, prompts: Path) -> str:
    return posixpath.join(DATAGEN.dir(target, name), INPUT, prompts.name)


def config_path(target: str) -> str:
    return posixpath.join(target, "config.json")


# ---------------------------------------------------------------- starting


def start_datagen(
    reader: Session, writer: Session, name: str, targets: list[Target], req: Request,
    *, wait: float,
) -> Started:  # fmt: skip
    if not req.prompts.is_file():
        raise UsageError(f"--prompts {req.prompts}: not a file")
    code = local_code()
    probes = read_targets(reader, targets, req, code)
    engine = req.engine or default_engine(targets, probes)
    placement = place_job(name, targets, probes, req)
    programs = {n.target.name: program_argv(n, name, engine, req) for n in placement.nodes}
    argvs = {n.target.name: node_argv(placement, n, programs[n.target.name])
             for n in placement.nodes}  # fmt: skip
    doc = {"settings": {"prompts": str(req.prompts), "target": req.target, "engine": engine,
                        "temperature": req.temperature, "max_new_tokens": req.max_new_tokens,
                        "chat_template_kwargs": req.chat_template_kwargs,
                        "nodes": [n.target.name for n in placement.nodes]},
           "argv": argvs, "program": programs}  # fmt: skip
    files = {SETTINGS: json.dumps(doc, indent=2) + "\n"}
    context.note(f"{name}: {engine} on {placement.describe()}")

    def have(target: Target, c: Code) -> bool:
        return probes[target.name].paths.get(c.path(target)) == "dir"

    def check() -> None:
        push_input(writer, placement, req.prompts)
        check_input(writer.machine(placement.nodes[0].target), placement, req, code, programs)

    start_job(reader, writer, placement, code, have, files, {}, check=check)
    if writer.dry_run:
        context.note("dry run: nothing was changed")
        return Started(placement, None)
    try:
        view = wait_for_life(reader, placement, timeout=wait)
    except NotRead:
        raise
    except OpsError:
        context.note(f"{name}: the start failed; taking back its directory")
        take_back(writer, placement, placement.nodes)
        raise
    return Started(placement, view)


def read_targets(
    reader: Session, targets: list[Target], req: Request, code: Code
) -> dict[str, Probe]:
    """Each chosen target read once, in parallel; the target model must be there."""

    def read(target: Target) -> Probe:
        paths = [config_path(req.target), engine_envs.python_of(target, "vllm"), code.path(target)]
        return probe(reader.machine(target), names=[], paths=paths, gpus=True)

    answers = reader.each(read, targets)
    for answer in answers:
        if isinstance(answer, BaseException):
            raise answer
    probes = {t.name: a for t, a in zip(targets, answers, strict=True)}
    if reader.offline:  # --dry-run: nothing was read
        return probes
    missing = [t.name for t in targets
               if probes[t.name].paths.get(config_path(req.target)) != "file"]  # fmt: skip
    if missing:
        raise NotFoundError(f"--target {req.target}: no model there (no config.json) on "
                            f"{', '.join(missing)}; copy it there (dflashops push)")  # fmt: skip
    if req.engine == "vllm":
        lacking = [t.name for t in targets if not has_vllm(t, probes[t.name])]
        if lacking:
            raise NotFoundError(f"--engine vllm: no vLLM environment on {', '.join(lacking)}; "
                                f"make one with `dflashops setup {lacking[0]} --engine vllm` "
                                "(or name it in hosts.yaml: engines: {vllm: PYTHON})")  # fmt: skip
    return probes


def has_vllm(target: Target, found: Probe) -> bool:
    return found.paths.get(engine_envs.python_of(target, "vllm")) == "file"


def default_engine(targets: list[Target], probes: dict[str, Probe]) -> str:
    """vllm where every target has its environment (setup --engine vllm, or hosts.yaml's)."""
    if all(has_vllm(t, probes[t.name]) for t in targets):
        return "vllm"
    return "transformers"


def place_job(
    name: str, targets: list[Target], probes: dict[str, Probe], req: Request
) -> Placement:
    """One node per target, each its GPUs' processes (one engine per GPU, or per
    --tensor-parallel-size GPUs); every node the same number (ranks are numbered by it)."""
    nodes = []
    for i, target in enumerate(targets):
        gpus = len((probes[target.name].gpus or {}).get("gpus") or []) or None
        per = gpus // req.tensor_parallel_size if gpus else None
        if target.gpus:
            per = max(1, target.gpus // req.tensor_parallel_size)
        nodes.append(Node(i, target, nproc_of(target, req.nproc, per) if req.nproc else per or 1))
    counts = {n.target.name: n.nproc for n in nodes}
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"{k} {v}" for k, v in counts.items())
        raise UsageError(f"--host: the targets would run different numbers of processes "
                         f"({shown}); pass --nproc N for all of them")  # fmt: skip
    return Placement(DATAGEN, name, new_run_id(), nodes, state={"kind": DATAGEN.name})


def program_argv(node: Node, name: str, engine: str, req: Request) -> list[str]:
    """The generator on `node` as one process, without its --nnodes/--node-rank (the job's
    helper adds them from launch.json)."""
    target = node.target
    python = engine_envs.python_of(target, "vllm") if engine == "vllm" else target.python
    return [python, "-m", "workload.datagen",
            "--prompts", input_path(target, name, req.prompts), "--target", req.target,
            "--out", DATAGEN.dir(target, name), "--engine", engine, *req.options()]  # fmt: skip


def node_argv(placement: Placement, node: Node, program: list[str]) -> list[str]:
    """The program alone, or under a one-node torchrun for several processes."""
    if node.nproc == 1:
        return program
    alone = Placement(placement.kind, placement.run, placement.run_id, [node])
    return [program[0], *torchrun(alone, node)[1:], *program[1:]]


def push_input(writer: Session, placement: Placement, prompts: Path) -> None:
    """The input file into every node's job directory (a verified copy)."""

    def one(node: Node) -> None:
        dest = input_path(node.target, placement.run, prompts)
        transfer.put(writer.machine(node.target), prompts, dest)

    each_node(writer, placement, one)


def check_input(
    machine: Machine, placement: Placement, req: Request, code: Code, argvs: dict[str, list[str]]
) -> None:
    """The generator's own check of every line, on node 0 before anything starts."""
    target = machine.target
    remote = input_path(target, placement.run, req.prompts)
    python = argvs[target.name][0]
    argv = [python, "-m", "workload.datagen", "--check-only", "--prompts", remote]
    if req.chunk is not None:
        argv += ["--chunk", str(req.chunk)]
    result = machine.run(argv, env={"PYTHONPATH": code.path(target)}, timeout=long(machine))
    if machine.dry_run or result.ok:
        return
    text = result.error_text.removeprefix("error: ").replace(remote, str(req.prompts))
    if result.returncode == 2:
        raise UsageError(text)
    if result.returncode == 127:
        raise OpsError(f"{target.name}: {python} not found; run `dflashops setup {target.name}`")
    raise OpsError(f"{target.name}: checking the input failed: {text}")


# ---------------------------------------------------------------- following


def follow(reader: Session, writer: Session, view: RunView) -> dict[str, Any]:
    """Node 0's console to stderr until the job ends on every node; then, over several
    targets, the shares combined on node 0; its manifest (Ctrl-C: the job goes on)."""
    machine = reader.machine(reader.inventory.target(view.target))
    stream_log(machine, view, tail=0, follow=True, out=context.stream_sink(sys.stderr))
    view = wait_ended(reader, view)
    if view.state != "finished":
        raise OpsError(f"{view.name}: {view.state}" + (f" ({view.note})" if view.note else "")
                       + f"; `dflashops logs {view.name}` shows why, `dflashops resume "
                       f"{view.name}` goes on")  # fmt: skip
    if view.multi:
        return collect(reader, writer, view)
    return read_manifest(machine, view.dir)


def wait_ended(reader: Session, view: RunView, timeout: float = 600) -> RunView:
    """Until no node of the job runs (node 0 may end before the others)."""
    clock = Stopwatch()
    while True:
        view = refresh(reader, view, records="none", files=[SETTINGS])
        if not any(v.running for v in view.nodes or [view]) and not view.running:
            return view
        if clock.seconds > timeout:
            raise OpsError(f"{view.name}: still running after {duration(clock.seconds)}")
        context.note(f"{view.name}: {view.progress.text()}; waiting for every node to end")
        time.sleep(2.0)


def read_manifest(machine: Machine, job_dir: str) -> dict[str, Any]:
    try:
        return json.loads(transfer.read_text(machine, posixpath.join(job_dir, MANIFEST)))
    except ValueError:
        raise OpsError(f"{machine.name}: {job_dir}/{MANIFEST} is not JSON") from None


# ---------------------------------------------------------------- combining the shares


def collect(reader: Session, writer: Session, view: RunView) -> dict[str, Any]:
    """The other nodes' chunks into node 0's directory, then its complete manifest."""
    if view.where != DATAGEN.home:
        raise UsageError(f"{view.name} is not a datagen job ({view.target}:{view.where}/); "
                         f"--collect combines a datagen job's shares")  # fmt: skip
    nodes = view.nodes or [view]
    if view.running or any(v.running for v in nodes):
        raise UsageError(f"{view.name} is {view.state}; its shares are combined once it ends")
    unread = [t for t in view.node_targets if t not in {v.target for v in nodes}]
    if unread:
        raise OpsError(f"{view.name}: {', '.join(unread)} not read; every node is needed")
    unfinished = [f"{v.target} ({v.state})" for v in nodes if v.state != "finished"]
    if unfinished:
        raise UsageError(f"{view.name}: not finished on {', '.join(unfinished)}; "
                         f"`dflashops resume {view.name}` first")  # fmt: skip
    head = nodes[0]
    dst = writer.machine(reader.inventory.target(head.target))
    have = set(chunk_names(dst, head.dir))
    for node in nodes[1:]:
        src = writer.machine(reader.inventory.target(node.target))
        wanted = [k for k in chunk_names(src, node.dir) if k not in have]
        if wanted:
            context.note(f"{view.name}: {len(wanted)} chunk(s) {node.target} -> {head.target}")
        for at in range(0, len(wanted), BATCH):  # a command line of bounded length
            copy_chunks(src, node.dir, wanted[at : at + BATCH], dst, head.dir)
    return finalize(dst, head)


def chunk_names(machine: Machine, job_dir: str) -> list[str]:
    """The finished chunks there (a record, and its jsonl beside it), as chunk_<K>."""
    records = listing(machine, posixpath.join(job_dir, "chunks"))
    files = set(listing(machine, job_dir))
    names = [x.removesuffix(".json") for x in records if x.endswith(".json")]
    return sorted(n for n in names if n.startswith("chunk_") and f"{n}.jsonl" in files)


def listing(machine: Machine, path: str) -> list[str]:
    listed = machine.run(["ls", "-1", "--", path])
    return listed.text.split() if listed.ok and not machine.dry_run else []


def copy_chunks(src: Machine, src_dir: str, chunks: list[str], dst: Machine, dst_dir: str) -> None:
    """Each chunk's jsonl, then its record (a record there means its jsonl arrived whole)."""
    members = [f"{k}.jsonl" for k in chunks] + [f"chunks/{k}.json" for k in chunks]
    tar = ["tar", "-C", src_dir, "--format=pax", "-cf", "-", "--", *members]
    relayed = relay(src, tar, dst, helpers.argv("receive.py", dst_dir, "--unsealed"))
    if dst.dry_run:
        return
    if relayed.error is not None:
        raise relayed.error
    if relayed.sent is not None and not relayed.sent.ok:
        raise TransferError(f"{src.name}: tar in {src_dir} failed: {relayed.sent.error_text}")
    if not relayed.received.ok:
        text = relayed.received.error_text.removeprefix("receive: ")
        raise TransferError(f"{dst.name}: receiving chunks into {dst_dir} failed: {text}; what "
                            "arrived is kept: run it again")  # fmt: skip


def finalize(machine: Machine, head: RunView) -> dict[str, Any]:
    """The generator's --finalize on node 0: every chunk checked against its record (size and
    sha256), the manifest written; complete, or an error naming what is missing."""
    launch = json.loads(transfer.read_text(machine, posixpath.join(head.dir, layout.LAUNCH_FILE)))
    doc = json.loads(transfer.read_text(machine, posixpath.join(head.dir, SETTINGS)))
    argv = [*doc["program"][head.target], "--finalize"]
    result = machine.run(argv, env={"PYTHONPATH": launch["code"]}, timeout=long(machine))
    if machine.dry_run:
        return {}
    if result.returncode not in (0, 1):
        raise OpsError(f"{machine.name}: --finalize failed: {result.error_text}")
    manifest = read_manifest(machine, head.dir)
    if not manifest.get("complete"):
        lines = [x.strip() for x in result.text.splitlines()[1:] if x.strip()]
        raise OpsError(f"{head.name}: not complete on {head.target} after combining "
                       f"({'; '.join(lines[:3]) or 'see its manifest'})")  # fmt: skip
    return manifest


# ---------------------------------------------------------------- a run's dataset


def dataset_of(machine: Machine, data_path: str) -> dict[str, Any] | None:
    """What a datagen dataset's manifest says of how it was made (None: not one, or not
    readable there): {"target", "engine", "temperature", "max_new_tokens", "cut", "replies",
    "chat_template_kwargs", "complete", "input", "done"}."""
    found = machine.run(["cat", "--", posixpath.join(data_path, MANIFEST)])
    if machine.dry_run or not found.ok:
        return None
    try:
        m = json.loads(found.text)
    except ValueError:
        return None
    if not isinstance(m, dict) or "engine" not in m:
        return None
    sampling = m.get("sampling") or {}
    return {"target": m.get("target"), "engine": m.get("engine"),
            "temperature": sampling.get("temperature"),
            "max_new_tokens": sampling.get("max_new_tokens"),
            "chat_template_kwargs": m.get("chat_template_kwargs"),
            "complete": m.get("complete"), "input": m.get("input"), "done": m.get("done"),
            "cut": m.get("cut"), "replies": m.get("replies")}  # fmt: skip
