"""`eval RUN --step STEP --on TARGET [--prompts FILE] [--reference PATH] [--max-new-tokens N]`

Pulls the checkpoint to TARGET when it is not there (pull-ckpt), runs `python -m workload.eval`
there with the run's run.yaml, streams its progress to stderr, keeps the result in
<ws>/evals/RUN/step_STEP.json on TARGET and prints tau, the DDTree taus and the per-position
acceptance (and the reference drafter's, when given).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import sys
from pathlib import Path
from typing import Any

import typer
import yaml

from dflashops import context, lifecycle, runs, transfer
from dflashops.commands.launch import apply_set
from dflashops.commands.pull_ckpt import pull
from dflashops.errors import NotFoundError, OpsError, UsageError
from dflashops.inventory import Target
from dflashops.render import console, metric, table
from dflashops.targets.base import Machine


def register(app: typer.Typer) -> None:
    @app.command("eval")
    @context.command
    def eval_(
        ctx: typer.Context,
        run: str = typer.Argument(..., metavar="RUN", help="The run whose checkpoint to evaluate."),
        step: int = typer.Option(..., "--step", metavar="STEP", help="The checkpoint's step."),
        on: str = typer.Option(..., "--on", metavar="TARGET", help="The target to evaluate on."),
        prompts: str = typer.Option(
            None,
            "--prompts",
            metavar="FILE",
            help="JSONL prompts: a local file (copied there) or a path on the target "
            "(default: prompts.jsonl beside the config's data).",
        ),
        reference: str = typer.Option(
            None, "--reference", metavar="PATH", help="A reference drafter directory on the target."
        ),
        max_new_tokens: int = typer.Option(None, "--max-new-tokens", metavar="N"),
        max_prompts: int = typer.Option(None, "--max-prompts", metavar="N"),
        sets: list[str] = typer.Option(
            None,
            "--set",
            metavar="KEY=VALUE",
            help="Override a key of the run's config here, "
            "e.g. --set target.path=/models/Qwen3-8B.",
        ),  # fmt: skip
        json_out: bool = typer.Option(False, "--json", help="Print the result JSON."),
    ) -> None:
        """Evaluate a run's checkpoint on a target: tau, DDTree tau, per-position acceptance."""
        opts = context.get(ctx)
        as_json = opts.want_json(json_out)
        dest = opts.inventory().target(on)
        with runs.sessions(opts) as (reader, writer):
            view = runs.find(reader, run, records="none", files=["run.yaml"])
            config = parse_config(view, sets or [])
            machine = writer.machine(dest)
            argv = eval_argv(
                reader.machine(dest), machine, run, step, config, prompts, reference, sets or []
            )
            pull(reader, writer, view, step, dest)
            code = lifecycle.local_code()
            have = runs.probe(reader.machine(dest), names=[], paths=[code.path(dest)])
            code_dir = lifecycle.ensure_code(
                machine, code, have.paths.get(code.path(dest)) == "dir"
            )
            if max_new_tokens is not None:
                argv += ["--max-new-tokens", str(max_new_tokens)]
            if max_prompts is not None:
                argv += ["--max-prompts", str(max_prompts)]
            out = runs.eval_result_path(dest, run, step)
            run_eval(machine, argv + ["--out", out], code_dir)
            if opts.dry_run:
                runs.dry_run_done(opts, run=run, step=step, on=dest.name, out=out, argv=argv)
                return
            result = json.loads(transfer.read_text(machine, out))
        if as_json:
            opts.emit(result)
        else:
            show(run, step, dest, out, result)


def eval_argv(
    reader: Machine,
    machine: Machine,
    run: str,
    step: int,
    config: dict[str, Any],
    prompts: str | None,
    reference: str | None,
    sets: list[str],
) -> list[str]:
    """The eval command line; checks first that what it names exists on the target."""
    target = machine.target
    ckpt = runs.ckpt_copy_dir(target, run, step)
    config_path = posixpath.join(posixpath.dirname(ckpt), "run.yaml")
    base = posixpath.dirname(config_path)
    model = _resolve((config.get("target") or {}).get("path"), base)
    if model is None:
        raise UsageError(f"{run}: its run.yaml has no target.path; give --set target.path=PATH")
    checks = {model: "target.path (the target model)"}
    argv = [target.python, "-m", "workload.eval", "--config", config_path, "--checkpoint", ckpt]
    if prompts is not None and Path(prompts).is_file():
        argv += ["--prompts", push_prompts(machine, Path(prompts), run)]
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
    if reference is not None:
        checks[reference] = "--reference"
        argv += ["--reference", reference]
    for item in sets:
        argv += ["--set", item]
    found = runs.probe(reader, paths=list(checks)).paths
    missing = [f"{what} {path}" for path, what in checks.items() if found.get(path) == "missing"]
    if missing and not reader.dry_run:
        raise NotFoundError(
            f"{target.name}: not there: {'; '.join(missing)} (copy it there, or point the run's "
            "config elsewhere with --set target.path=PATH / --prompts FILE)"
        )
    return argv


def parse_config(view: runs.RunView, sets: list[str]) -> dict[str, Any]:
    """The run's run.yaml (the one pull-ckpt puts beside the checkpoint), with --set applied."""
    text = (view.raw.get("files") or {}).get("run.yaml")
    if text is None:
        raise NotFoundError(f"{view.name}: no run.yaml in {view.target}:{view.dir}")
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError:
        raise UsageError(f"{view.name}: its run.yaml is not valid YAML") from None
    if not isinstance(data, dict):
        raise UsageError(f"{view.name}: its run.yaml is not a run config")
    for item in sets:
        apply_set(data, item)
    return data


def _resolve(path: Any, base: str) -> str | None:
    if not isinstance(path, str) or not path:
        return None
    return path if path.startswith("/") else posixpath.join(base, path)


def push_prompts(machine: Machine, local: Path, run: str) -> str:
    digest = hashlib.sha256(local.read_bytes()).hexdigest()[:12]
    remote = posixpath.join(machine.target.workspace, "evals", run, f"prompts-{digest}.jsonl")
    transfer.put(machine, local, remote)
    return remote


def run_eval(machine: Machine, argv: list[str], code_dir: str) -> None:
    """The evaluator from a code snapshot of its own (a later launch never changes it)."""
    env = {"PYTHONPATH": code_dir}
    context.note(f"{machine.name}: evaluating (progress below)")
    to_stderr = context.stream_sink(sys.stderr)
    result = machine.run(argv, env=env, stdout=to_stderr, stderr=to_stderr)
    if machine.dry_run or result.ok:
        return
    lines = [x for x in result.stderr.decode("utf-8", "replace").splitlines() if x.strip()]
    refusal = [x for x in lines if x.startswith("eval: error: ")]
    if result.returncode == 2 and refusal:
        raise UsageError(f"{machine.name}: {refusal[-1].removeprefix('eval: error: ')}")
    if result.returncode == 127:
        raise OpsError(f"{machine.name}: {argv[0]} not found; run `dflashops setup {machine.name}`")
    raise OpsError(f"{machine.name}: the evaluation failed (exit {result.returncode}): "
                   f"{lines[-1] if lines else 'no output'}")  # fmt: skip


def show(run: str, step: int, dest: Target, out: str, result: dict[str, Any]) -> None:
    rows = [(f"{run} step_{step}", result)]
    if isinstance(result.get("reference"), dict):
        rows.append(("reference", result["reference"]))
    budgets = sorted({b for _, r in rows for b in (r.get("ddtree") or {})}, key=int)
    width = max(len(r.get("per_position") or []) for _, r in rows)
    grid = table(
        "DRAFTER", "TAU", *(f"DDTREE {b}" for b in budgets), *(f"P{i + 1}" for i in range(width))
    )
    for name, r in rows:
        per = r.get("per_position") or []
        cells = [name, metric(r.get("tau"), "streak")]
        cells += [metric((r.get("ddtree") or {}).get(b), "streak") for b in budgets]
        cells += [metric(per[i], "acc") if i < len(per) else "-" for i in range(width)]
        grid.add_row(*cells)
    c = console()
    c.print(grid)
    c.print(
        f"{result.get('n_prompts', '?')} prompts, max {result.get('max_new_tokens', '?')} new "
        f"tokens; tau = mean accepted + 1 per round; Pk = acceptance of draft slot k; "
        f"result: {dest.name}:{out}"
    )
