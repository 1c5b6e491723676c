"""Train-to-serve parity of a run (`check`): `python -m workload.parity` in the run's target
(what training used: its config, its dataset's manifest, the checkpoint), then, with an eval
target, there too (the target model, the engine that will serve and the checkpoint's eval
results there), given the first one's facts. Without an eval target, the run's own target is
both sides. Serving is what the user says (ServingChat, --num-speculative-tokens), the engine's
defaults where not said."""

from __future__ import annotations

import json
import posixpath
from typing import Any

from dflashops import engine_envs
from dflashops.errors import NotFoundError, OpsError, UsageError
from dflashops.inventory import Target
from dflashops.remote import layout
from dflashops.runs.datagen.job import long
from dflashops.runs.evaluation.serving import ServingChat
from dflashops.runs.lifecycle.snapshot import ensure_code, local_code
from dflashops.runs.reading.probe import probe
from dflashops.runs.reading.survey import find, reread
from dflashops.runs.reading.view import RunView
from dflashops.ssh.session import Session


def check_run(
    reader: Session,
    writer: Session,
    run: str,
    *,
    on: Target | None,
    step: int | None,
    host: str | None,
    spec_tokens: int | None,
    chat: ServingChat | None = None,
) -> dict[str, Any]:
    """{"run", "target", "on", "step", "mismatches": [{"key", "line"}], "facts", "notes",
    "assumed"}."""
    chat = chat or ServingChat()
    view = find(reader, run, host=host, records="none", files=[layout.RUN_CONFIG])
    home = reader.inventory.target(view.target)
    step = chosen_step(reader, view, step)
    argv = ["--config", posixpath.join(view.dir, layout.RUN_CONFIG), "--json"]
    if step is not None:
        argv += ["--checkpoint", posixpath.join(view.dir, "checkpoints", f"step_{step}")]
    dest = on if on is not None else home
    serving = ["--serving-defaults", *chat.argv(None if chat.local else chat.template)]
    if spec_tokens is not None:
        serving += ["--num-speculative-tokens", str(spec_tokens)]
    serving += engine_args(reader, dest) + eval_results(dest, view.name, step)
    given: dict[str, Any] = {}
    if chat.local is not None:  # read here, compared there
        given["serving"] = {"chat_template": chat.local.read_text(encoding="utf-8"),
                            "chat_template_file": chat.template}  # fmt: skip
    if dest.name == home.name:
        doc = parity(reader, writer, home, [*argv, *serving, "--given", "-"],
                     stdin=json.dumps(given))  # fmt: skip
    else:
        facts = parity(reader, writer, home, [*argv, "--gather-only"])["facts"]
        there = [*serving, "--given", "-", "--json"]
        model = (facts.get("train") or {}).get("target_path")
        if model:
            there += ["--target", model]
        doc = parity(reader, writer, on, there, stdin=json.dumps({**facts, **given}))
    return {"run": view.name, "target": home.name, "on": dest.name, "step": step, **doc}


def eval_results(target: Target, run: str, step: int | None) -> list[str]:
    """The checkpoint's eval and serving results on `target` (those there are compared)."""
    if step is None:
        return []
    paths = (layout.eval_result_path(target.workspace, run, step),
             layout.serve_result_path(target.workspace, run, step))  # fmt: skip
    return [a for p in paths for a in ("--eval-result", p)]


def chosen_step(reader: Session, view: RunView, step: int | None) -> int | None:
    """`step` if the run has it complete, else its newest complete checkpoint (None: none
    yet, the chat settings alone)."""
    seen = reread(reader.machine(reader.inventory.target(view.target)), view.name,
                  records="none", checkpoints=True)  # fmt: skip
    steps = sorted(c.step for c in seen.checkpoints if c.complete)
    if step is None:
        return steps[-1] if steps else None
    if step not in steps:
        have = ", ".join(map(str, steps)) or "none yet"
        raise NotFoundError(f"{view.name}: no complete checkpoint at step {step} on "
                            f"{view.target} (complete: {have})")  # fmt: skip
    return step


def engine_args(reader: Session, target: Target) -> list[str]:
    """--vllm-python where the target has a vLLM environment: what will serve there."""
    python = engine_envs.python_of(target, "vllm")
    if probe(reader.machine(target), paths=[python]).paths.get(python) == "missing":
        return []
    return ["--vllm-python", python]


def parity(
    reader: Session, writer: Session, target: Target, args: list[str], stdin: str | None = None
) -> dict[str, Any]:
    """workload.parity's JSON from `target` (the workload's code sent there first if missing)."""
    code = local_code()
    have = probe(reader.machine(target), paths=[code.path(target)]).paths
    machine = writer.machine(target)
    code_dir = ensure_code(machine, code, have.get(code.path(target)) == "dir")
    argv = [target.python, "-m", "workload.parity", *args]
    result = machine.run(argv, env={"PYTHONPATH": code_dir}, timeout=long(machine),
                         stdin=stdin.encode() if stdin is not None else None)  # fmt: skip
    if machine.dry_run:
        return {"mismatches": [], "facts": {}, "notes": [], "assumed": []}
    if result.returncode in (0, 2) and result.stdout.strip():
        return json.loads(result.stdout)
    text = result.error_text.removeprefix("parity: error: ")
    if result.returncode == 2:
        raise UsageError(f"{target.name}: {text}")
    if result.returncode == 127:
        raise OpsError(f"{target.name}: {target.python} not found; run `dflashops setup "
                       f"{target.name}`")  # fmt: skip
    raise OpsError(f"{target.name}: the parity check failed (exit {result.returncode}): {text}")
