"""Starting and following an eval job (the kind: runs/evaluation/kind.py): it pulls each checkpoint
the eval target lacks (pull-ckpt's copy), then starts the job as any job starts (lifecycle/start.py:
claimed, the code snapshot, launch.json, the launcher in a detached tmux session there, which
runs remote/evaljob.py: it survives a closed laptop), evaluating the steps one after the other.
Each step runs `python -m workload.eval` with the run's run.yaml and keeps its result in
<ws>/evals/RUN/step_N.json there. The job lives in <ws>/evals/RUN/jobs/ID/ (launch.json,
job.json, state.json, console.log, exit_code)."""

from __future__ import annotations

import hashlib
import json
import posixpath
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflashops import context, engine_envs, transfer
from dflashops.errors import NotFoundError, OpsError, UsageError
from dflashops.inventory import Target
from dflashops.remote import layout
from dflashops.runs.evaluation.kind import EVAL
from dflashops.runs.evaluation.pulls import pull
from dflashops.runs.evaluation.results import stored
from dflashops.runs.evaluation.serving import (
    ServingChat,
    Vs,
    serve_argv,
    serve_result_path,
    vs_engine_argv,
)
from dflashops.runs.lifecycle.placement import Node, Placement, new_run_id
from dflashops.runs.lifecycle.snapshot import local_code
from dflashops.runs.lifecycle.start import start_job
from dflashops.runs.reading.probe import probe
from dflashops.runs.reading.survey import find
from dflashops.runs.reading.view import RunView, ckpt_copy_dir, eval_result_path, tmux_session
from dflashops.runs.training.config import parse_config
from dflashops.runs.watching.log_stream import stream_log
from dflashops.ssh.session import Session
from dflashops.targets.base import Machine

EVAL_ENGINES = ("auto", "sim", "vllm")


@dataclass
class Extra:
    """What the user added to every step's evaluation."""

    prompts: str | None
    reference: str | None
    max_new_tokens: int | None
    max_prompts: int | None
    sets: list[str]
    check_real: int | None = None  # prompts checked against the real loop
    budgets: list[int] | None = None  # DDTree budgets besides the evaluator's
    host: str | None = None  # --host: the run's target where its name is on several
    engine: str = "auto"  # --engine: vllm where the target has it, else sim (the simulation)
    force: bool = False  # --force: evaluate despite train-to-serve parity mismatches
    serve: bool = (
        False  # --serve: the serving benchmark (runs/evaluation/serving.py) instead of the eval
    )
    concurrency: list[int] | None = None  # --serve's concurrencies
    vs: Vs | None = None  # --serve's second subject
    vs_engine: str | None = None  # --serve's second engine environment (a name or a python)
    chat: ServingChat | None = None  # --serve's server chat settings (vLLM's own options)


def start_eval(
    reader: Session, writer: Session, run: str, steps: list[int], dest: Target, extra: Extra
) -> dict[str, Any]:
    """Check what the evaluation needs, pull the missing checkpoints, start the job."""
    chosen = "vllm" if extra.serve else chosen_engine(reader.machine(dest), extra.engine)
    extra.engine = chosen.removesuffix("-auto")
    engine = engine_argv(reader.machine(dest), extra.engine)  # before anything starts
    vs_engine = vs_engine_argv(reader.machine(dest), extra.vs_engine)
    view = find(reader, run, host=extra.host, records="none", files=[layout.RUN_CONFIG])
    config = parse_config(view, extra.sets)
    machine = writer.machine(dest)
    base = eval_argv(reader.machine(dest), machine, run, config, extra)
    vs_view = None
    if extra.serve:
        base = serve_argv(base, engine[-1], extra.concurrency or [], extra.vs, dest,
                          vs_config(dest, extra.vs)) + vs_engine  # fmt: skip
        base += serving_chat_argv(reader.machine(dest), machine, run, extra.chat)
        vs_view = pull_vs(reader, writer, extra.vs, dest)
    else:
        base += engine
    for s in steps:
        pull(reader, writer, view, s, dest)
    if vs_view is not None and extra.vs is not None and extra.vs.step is not None:
        pull(reader, writer, vs_view, extra.vs.step, dest)
    result_path = serve_result_path if extra.serve else eval_result_path
    name, job_id = EVAL.new_job(run)
    plan = {
        "run": run,
        "evals": [
            {"step": s, "argv": base + ["--checkpoint", ckpt_copy_dir(dest, run, s),
                                        "--out", result_path(dest, run, s)]}
            for s in steps
        ],
    }  # fmt: skip
    own = {"kind": EVAL.name, "run": run, "job": job_id, "steps": steps,
           "reference": extra.reference, "engine": extra.engine}  # fmt: skip
    if extra.serve:
        own.update(serve=True, concurrency=extra.concurrency,
                   vs=extra.vs.on(dest) if extra.vs else None, vs_engine=extra.vs_engine)  # fmt: skip
    placement = start_on(reader, writer, Placement(EVAL, name, new_run_id(), [Node(0, dest, 1)],
                                                   state=own), plan)  # fmt: skip
    job = {**own, "target": dest.name, "tmux": tmux_session(name), "launched": time.time()}
    context.note(f"{dest.name}: eval job {job_id} of {run} started (steps "
                 f"{', '.join(map(str, steps))}, {engine_said(dest, chosen)}; tmux "
                 f"{job['tmux']})")  # fmt: skip
    return {**job, "dir": placement.dir(placement.nodes[0]), "name": name}


def start_on(reader: Session, writer: Session, placement: Placement, plan: dict[str, Any]
             ) -> Placement:  # fmt: skip
    """Start a one-node job with its job.json (`plan`) and the code as it is here."""
    code = local_code()
    dest = placement.nodes[0].target
    have = probe(reader.machine(dest), names=[], paths=[code.path(dest)])
    in_place = have.paths.get(code.path(dest)) == "dir"
    files = {"job.json": json.dumps(plan, indent=2) + "\n"}
    start_job(reader, writer, placement, code, lambda t, c: in_place, files, {})
    return placement


def vs_config(dest: Target, vs: Vs | None) -> str | None:
    """--vs RUN2:STEP: that run's run.yaml there, as pull-ckpt leaves it beside its copies."""
    if vs is None or vs.run is None:
        return None
    return posixpath.join(dest.workspace, layout.CKPTS, vs.run, layout.RUN_CONFIG)


def serving_chat_argv(reader: Machine, machine: Machine, run: str, chat: ServingChat | None
                      ) -> list[str]:  # fmt: skip
    """The serving benchmark's server chat settings: a template file here copied there first
    (beside the run's results, by its digest), one there checked."""
    if chat is None:
        return []
    path = chat.template
    if chat.local is not None:
        path = push_file(machine, chat.local, run, "chat-template", ".jinja")
    elif (path is not None and probe(reader, paths=[path]).paths.get(path) == "missing"
          and not reader.dry_run):  # fmt: skip
        raise UsageError(f"{machine.target.name}: --serve-chat-template {path}: no such file")
    return chat.argv(path)


def pull_vs(reader: Session, writer: Session, vs: Vs | None, dest: Target) -> RunView | None:
    """--vs RUN2:STEP: that run (its checkpoint is pulled with ours); --vs PATH: checked there."""
    if vs is None:
        return None
    if vs.run is not None:
        return find(reader, vs.run, records="none", files=[layout.RUN_CONFIG])
    there = probe(reader.machine(dest), paths=[vs.path]).paths.get(vs.path)
    if there == "missing" and not reader.dry_run:
        raise NotFoundError(f"{dest.name}: not there: --vs {vs.path}")
    return None


def newest_job(session: Session, run: str, dest: Target) -> dict[str, Any]:
    jobs = [j for j in stored(session, [run]).jobs if j["target"] == dest.name]
    if not jobs:
        raise NotFoundError(f"{run}: no eval job on {dest.name}")
    job = max(jobs, key=lambda j: j.get("launched") or 0)
    return {**job, "name": EVAL.template.format(run, job["job"])}


def follow(session: Session, dest: Target, job: dict[str, Any]) -> list[dict[str, Any]]:
    """Follow the job's console.log (to stderr) to its end; the results it stored, in the
    order of its steps (Ctrl-C raises KeyboardInterrupt: the job goes on)."""
    machine = session.machine(dest)
    view = RunView(job["name"], dest.name, EVAL.home, job["dir"], "running", 0.0, kind=EVAL)
    stream_log(machine, view, tail=0, follow=True, out=context.stream_sink(sys.stderr))
    check_end(machine, job)
    found = {r["step"]: r for r in stored(session, [job["run"]]).results
             if r["target"] == dest.name}  # fmt: skip
    return [found[s] for s in job["steps"] if s in found]


def read_result(session: Session, dest: Target, path: str) -> dict[str, Any]:
    """One stored result, whole (per-prompt records and all)."""
    return json.loads(transfer.read_text(session.machine(dest), path))


def check_end(machine: Machine, job: dict[str, Any]) -> None:
    """The job's exit code as ours: an evaluator's refusal is one line, exit 2."""
    try:
        code = int(transfer.read_text(machine, posixpath.join(job["dir"], layout.EXIT_CODE_FILE)))
    except (OpsError, ValueError):
        raise OpsError(f"{machine.name}: eval job {job['job']} ended without an exit code; "
                       f"see {job['dir']}/console.log") from None  # fmt: skip
    if code == 0:
        return
    text = transfer.read_text(machine, posixpath.join(job["dir"], layout.CONSOLE_LOG))
    lines = [x for x in text.splitlines() if x.strip() and not x.startswith("[")]
    refusal = last_refusal(text.splitlines())
    if code == 2 and refusal:  # one line each (the parity check's mismatches)
        raise UsageError("\n".join(f"{machine.name}: {x}" for x in refusal))
    if code == 127:
        raise OpsError(f"{machine.name}: the target's python not found; run "
                       f"`dflashops setup {machine.name}`")  # fmt: skip
    raise OpsError(f"{machine.name}: the evaluation failed (exit {code}): "
                   f"{lines[-1] if lines else 'no output'}")  # fmt: skip


def last_refusal(lines: list[str]) -> list[str]:
    """The last evaluator's refusal: its run of `eval: error: ` lines (one per mismatch of
    the parity check; the job's own lines come between its steps)."""
    out: list[str] = []
    for line in reversed(lines):
        if line.startswith("eval: error: "):
            out.insert(0, line.removeprefix("eval: error: "))
        elif out:
            break
    return out


def eval_argv(
    reader: Machine, machine: Machine, run: str, config: dict[str, Any], extra: Extra
) -> list[str]:
    """The evaluator's command line without its checkpoint and output; checks first that what
    it names exists on the target."""
    target = machine.target
    config_path = posixpath.join(
        target.workspace, layout.CKPTS, run, layout.RUN_CONFIG
    )  # pull-ckpt's
    base = posixpath.dirname(config_path)
    model = _resolve((config.get("target") or {}).get("path"), base)
    if model is None:
        raise UsageError(f"{run}: its run.yaml has no target.path; give --set target.path=PATH")
    checks = {model: "target.path (the target model)"}
    argv = [target.python, "-m", "workload.eval", "--config", config_path]
    prompts = extra.prompts
    if prompts is not None and Path(prompts).is_file():
        argv += ["--prompts", push_file(machine, Path(prompts), run, "prompts", ".jsonl")]
    elif prompts is not None:
        checks[prompts] = "--prompts"
        argv += ["--prompts", prompts]
    else:
        data = _resolve((config.get("data") or {}).get("path"), base)
        if data is None:
            raise UsageError(
                f"{run}: its config has no data.path to find prompts.jsonl by; give --prompts"
            )
        checks[posixpath.join(posixpath.dirname(data), "prompts.jsonl")] = "the default prompts"
    if extra.reference is not None:
        checks[extra.reference] = "--reference"
        argv += ["--reference", extra.reference]
    for item in extra.sets:
        argv += ["--set", item]
    if extra.max_new_tokens is not None:
        argv += ["--max-new-tokens", str(extra.max_new_tokens)]
    if extra.max_prompts is not None:
        argv += ["--max-prompts", str(extra.max_prompts)]
    if extra.check_real:
        argv += ["--check-real", str(extra.check_real)]
    if extra.budgets:
        argv += ["--budgets", ",".join(map(str, extra.budgets))]
    if extra.force:
        argv += ["--force"]
    found = probe(reader, paths=list(checks)).paths
    missing = [f"{what} {path}" for path, what in checks.items() if found.get(path) == "missing"]
    if missing and not reader.dry_run:
        raise NotFoundError(
            f"{target.name}: not there: {'; '.join(missing)} (copy it there, or point the run's "
            "config elsewhere with --set target.path=PATH / --prompts FILE)"
        )
    return argv


def chosen_engine(machine: Machine, engine: str) -> str:
    """`auto`: vLLM, the engine the drafter will serve in, where the eval target has it; else
    the simulation (`engine_said` says so once the job started)."""
    if engine not in EVAL_ENGINES:
        raise UsageError(f"--engine {engine}: expected one of {', '.join(EVAL_ENGINES)}")
    if engine != "auto":
        return engine
    python = engine_envs.python_of(machine.target, "vllm")
    return "sim-auto" if probe(machine, paths=[python]).paths.get(python) == "missing" else "vllm"


def engine_said(target: Target, engine: str) -> str:
    """The engine an eval runs in, as its start line says it ('sim-auto': chosen for want of
    vLLM there)."""
    if engine == "sim-auto":
        return (f"by simulation: no vLLM environment on {target.name} (`dflashops setup "
                f"{target.name} --engine vllm` evaluates in the engine)")  # fmt: skip
    return "in vLLM" if engine == "vllm" else "by simulation"


def engine_argv(machine: Machine, engine: str) -> list[str]:
    """The evaluator's engine options; refuses an engine the eval target does not have."""
    if engine not in EVAL_ENGINES:
        raise UsageError(f"--engine {engine}: expected one of {', '.join(EVAL_ENGINES)}")
    if engine == "sim":
        return []
    name, python = machine.target.name, engine_envs.python_of(machine.target, engine)
    if probe(machine, paths=[python]).paths.get(python) == "missing" and not machine.dry_run:
        raise UsageError(f"no vLLM engine on {name}: run `dflashops setup {name} --engine vllm` "
                         "or set engines.vllm in hosts.yaml")  # fmt: skip
    return ["--engine", engine, "--vllm-python", python]


def _resolve(path: Any, base: str) -> str | None:
    if not isinstance(path, str) or not path:
        return None
    return path if path.startswith("/") else posixpath.join(base, path)


def push_file(machine: Machine, local: Path, run: str, stem: str, suffix: str) -> str:
    """A local file copied beside the run's results there, named by its digest."""
    digest = hashlib.sha256(local.read_bytes()).hexdigest()[:12]
    remote = posixpath.join(machine.target.workspace, layout.EVALS, run, f"{stem}-{digest}{suffix}")
    transfer.put(machine, local, remote)
    return remote
