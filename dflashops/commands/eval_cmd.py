"""`eval RUN (--step N | --steps A,B,C) --on TARGET [--reference PATH] [--check-real N]
[--budgets B,B] [--follow | --detach]`

An eval job: pulls each checkpoint TARGET lacks (pull-ckpt), then evaluates them one after the
other in a detached tmux session on TARGET (remote/launcher.py running remote/evaljob.py, as
`launch` runs a trainer: it survives a closed laptop). Each step runs `python -m workload.eval`
with the run's run.yaml and keeps its result in <ws>/evals/RUN/step_N.json there (with the
reference drafter's under "reference" when --reference is given; --check-real N adds the real
draft-and-verify loop's check on N prompts, --budgets more DDTree budgets). The job lives in
<ws>/evals/RUN/jobs/ID/ (launch.json, job.json, state.json, console.log, exit_code).

One --step is followed to the end and its table printed (--detach: leave it); --steps returns
once the job has started (--follow: stay). `eval RUN --follow --on TARGET` attaches to RUN's
newest job there. Ctrl-C while following only detaches (exit 130): the job goes on.
`dflashops evals RUN` lists the results.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import secrets as random_tokens
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
import yaml

from dflashops import context, lifecycle, runs, transfer
from dflashops.errors import ExitCode, NotFoundError, OpsError, UsageError
from dflashops.evalstore import gap, real_rounds, stored
from dflashops.inventory import Target
from dflashops.logstream import stream_log
from dflashops.pulls import pull
from dflashops.remote import source as helper_source
from dflashops.render import console, metric, table
from dflashops.ssh.session import Session
from dflashops.targets.base import Machine

JOB = "evaljob.py"


def register(app: typer.Typer) -> None:
    @app.command("eval")
    @context.command
    def eval_(
        ctx: typer.Context,
        run: str = typer.Argument(
            ..., metavar="RUN", help="The run whose checkpoints to evaluate."
        ),
        step: int = typer.Option(None, "--step", metavar="STEP", help="One checkpoint's step."),
        steps: str = typer.Option(
            None, "--steps", metavar="A,B,C", help="Several steps, evaluated one after another."
        ),
        on: str = typer.Option(..., "--on", metavar="TARGET", help="The target to evaluate on."),
        host: str = context.HOST_OPTION,
        prompts: str = typer.Option(
            None,
            "--prompts",
            metavar="FILE",
            help="JSONL prompts: a local file (copied there) or a path on the target "
            "(default: prompts.jsonl beside the config's data).",
        ),
        reference: str = typer.Option(
            None,
            "--reference",
            metavar="PATH",
            help="A reference drafter directory on the target (e.g. z-lab's), evaluated on the "
            "same prompts in the same job.",
        ),
        max_new_tokens: int = typer.Option(None, "--max-new-tokens", metavar="N"),
        max_prompts: int = typer.Option(None, "--max-prompts", metavar="N"),
        check_real: int = typer.Option(
            None,
            "--check-real",
            metavar="N",
            help="Also run the real draft-and-verify loop on the first N prompts: real tau "
            "against simulated, rounds equal, tokens/s against autoregressive.",
        ),
        budgets: str = typer.Option(
            None,
            "--budgets",
            metavar="B,B",
            help="DDTree budgets to add to the evaluator's (8, 16, 32, 64), e.g. 128,256.",
        ),
        sets: list[str] = typer.Option(
            None,
            "--set",
            metavar="KEY=VALUE",
            help="Override a key of the run's config here, "
            "e.g. --set target.path=/models/Qwen3-8B.",
        ),  # fmt: skip
        follow: bool = typer.Option(
            False, "--follow", help="Stay with the job until it ends (Ctrl-C detaches)."
        ),
        detach: bool = typer.Option(False, "--detach", help="Start the job and return at once."),
        json_out: bool = typer.Option(False, "--json", help="Print the result JSON."),
    ) -> None:
        """Evaluate a run's checkpoints on a target, as a job: tau, DDTree tau, per position."""
        opts = context.get(ctx)
        as_json = opts.want_json(json_out)
        runs.check_name(run)
        if follow and detach:
            raise UsageError("--follow and --detach: choose one")
        chosen = chosen_steps(step, steps, follow)
        if check_real is not None and check_real < 0:
            raise UsageError(f"--check-real {check_real}: a number of prompts, >= 0")
        dest = opts.inventory().target(on)
        if not chosen:  # --follow alone: the newest job of RUN there
            job = newest_job(opts.session(), run, dest)
            return finish(opts, as_json, dest, job)
        more = context.parse_steps(budgets, "--budgets", least=1, example="128,256")
        extra = Extra(prompts, reference, max_new_tokens, max_prompts, sets or [], check_real, more,
                      host)  # fmt: skip
        with runs.sessions(opts) as (reader, writer):
            job = start_job(reader, writer, run, chosen, dest, extra)
            if opts.dry_run:
                runs.dry_run_done(opts, run=run, steps=chosen, on=dest.name, job=job["dir"])
                return
        if detach or (len(chosen) > 1 and not follow):
            return started(opts, as_json, dest, job)
        finish(opts, as_json, dest, job)


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


def chosen_steps(step: int | None, steps: str | None, follow: bool) -> list[int]:
    if step is not None and steps:
        raise UsageError("--step and --steps: give one (--steps 1000,2000 for several)")
    if step is not None:
        if step < 0:
            raise UsageError(f"--step {step}: steps are >= 0")
        return [step]
    if steps:
        found = context.parse_steps(steps, "--steps", example="1000,2000,4000")
        if not found:
            raise UsageError(f"--steps {steps}: expected steps >= 0, e.g. 1000,2000,4000")
        return found
    if not follow:
        raise UsageError("give --step N or --steps A,B,C (or --follow to attach to a job)")
    return []


def start_job(
    reader: Session, writer: Session, run: str, steps: list[int], dest: Target, extra: Extra
) -> dict[str, Any]:
    """Check what the evaluation needs, pull the missing checkpoints, start the job."""
    view = runs.find(reader, run, host=extra.host, records="none", files=["run.yaml"])
    config = parse_config(view, extra.sets)
    machine = writer.machine(dest)
    base = eval_argv(reader.machine(dest), machine, run, config, extra)
    for s in steps:
        pull(reader, writer, view, s, dest)
    code = lifecycle.local_code()
    have = runs.probe(reader.machine(dest), names=[], paths=[code.path(dest)])
    code_dir = lifecycle.ensure_code(machine, code, have.paths.get(code.path(dest)) == "dir")
    job_id = time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + random_tokens.token_hex(2)
    job_dir = posixpath.join(dest.workspace, "evals", run, "jobs", job_id)
    name = f"eval-{run}-{job_id}"
    plan = {
        "run": run,
        "evals": [
            {"step": s, "argv": base + ["--checkpoint", runs.ckpt_copy_dir(dest, run, s),
                                        "--out", runs.eval_result_path(dest, run, s)]}
            for s in steps
        ],
    }  # fmt: skip
    launch = {
        "run": name,
        "target": dest.name,
        "code": code_dir,
        "argv": ["python3", posixpath.join(job_dir, JOB), job_dir],
        "env": lifecycle.launch_env(dest, code_dir, None),
        "secrets": None,
    }
    state = {
        "kind": "eval", "run": run, "job": job_id, "steps": steps, "target": dest.name,
        "tmux": runs.tmux_session(name), "launched": time.time(), "reference": extra.reference,
    }  # fmt: skip
    files = {
        "job.json": json.dumps(plan, indent=2) + "\n",
        "launch.json": json.dumps(launch, indent=2) + "\n",
        "state.json": json.dumps(state, indent=2) + "\n",
        lifecycle.LAUNCHER: helper_source(lifecycle.LAUNCHER),
        JOB: helper_source(JOB),
    }
    lifecycle.write_run_files(machine, job_dir, files)
    lifecycle.start(machine, name, job_dir)
    context.note(f"{dest.name}: eval job {job_id} of {run} started (steps "
                 f"{', '.join(map(str, steps))}; tmux {state['tmux']})")  # fmt: skip
    return {**state, "dir": job_dir, "name": name}


def started(opts: context.Context, as_json: bool, dest: Target, job: dict[str, Any]) -> None:
    run = job["run"]
    results = [runs.eval_result_path(dest, run, s) for s in job["steps"]]
    if as_json:
        opts.emit({**job, "results": results})
        return
    console().print(
        f"eval job {job['job']} of {run} running on {dest.name} (tmux {job['tmux']}); "
        f"follow it: dflashops eval {run} --follow --on {dest.name}; "
        f"results: dflashops evals {run}"
    )


def newest_job(session: Session, run: str, dest: Target) -> dict[str, Any]:
    jobs = [j for j in stored(session, [run]).jobs if j["target"] == dest.name]
    if not jobs:
        raise NotFoundError(f"{run}: no eval job on {dest.name}")
    job = max(jobs, key=lambda j: j.get("launched") or 0)
    return {**job, "name": f"eval-{run}-{job['job']}"}


def finish(opts: context.Context, as_json: bool, dest: Target, job: dict[str, Any]) -> None:
    """Follow the job's console.log (to stderr) to its end, then print its results."""
    session = opts.session()
    machine = session.machine(dest)
    view = runs.RunView(job["name"], dest.name, "evals", job["dir"], "running", 0.0)
    try:
        stream_log(machine, view, tail=0, follow=True, out=context.stream_sink(sys.stderr))
    except KeyboardInterrupt:
        context.note(f"detached; eval job {job['job']} keeps running on {dest.name}")
        raise typer.Exit(int(ExitCode.INTERRUPTED)) from None
    check_end(machine, job)
    found = {r["step"]: r for r in stored(session, [job["run"]]).results
             if r["target"] == dest.name}  # fmt: skip
    done = [found[s] for s in job["steps"] if s in found]
    if len(job["steps"]) == 1:
        result = json.loads(transfer.read_text(machine, done[0]["file"]))
        if as_json:
            return opts.emit(result)
        return show(job["run"], job["steps"][0], dest, done[0]["file"], result)
    if as_json:
        return opts.emit({"run": job["run"], "job": job["job"], "target": dest.name,
                          "results": done})  # fmt: skip
    show_steps(job["run"], dest, done)


def check_end(machine: Machine, job: dict[str, Any]) -> None:
    """The job's exit code as ours: an evaluator's refusal is one line, exit 2."""
    try:
        code = int(transfer.read_text(machine, posixpath.join(job["dir"], "exit_code")))
    except (OpsError, ValueError):
        raise OpsError(f"{machine.name}: eval job {job['job']} ended without an exit code; "
                       f"see {job['dir']}/console.log") from None  # fmt: skip
    if code == 0:
        return
    text = transfer.read_text(machine, posixpath.join(job["dir"], "console.log"))
    lines = [x for x in text.splitlines() if x.strip() and not x.startswith("[")]
    refusal = [x for x in lines if x.startswith("eval: error: ")]
    if code == 2 and refusal:
        raise UsageError(f"{machine.name}: {refusal[-1].removeprefix('eval: error: ')}")
    if code == 127:
        raise OpsError(f"{machine.name}: the target's python not found; run "
                       f"`dflashops setup {machine.name}`")  # fmt: skip
    raise OpsError(f"{machine.name}: the evaluation failed (exit {code}): "
                   f"{lines[-1] if lines else 'no output'}")  # fmt: skip


def eval_argv(
    reader: Machine, machine: Machine, run: str, config: dict[str, Any], extra: Extra
) -> list[str]:
    """The evaluator's command line without its checkpoint and output; checks first that what
    it names exists on the target."""
    target = machine.target
    config_path = posixpath.join(target.workspace, "ckpts", run, "run.yaml")  # pull-ckpt's
    base = posixpath.dirname(config_path)
    model = _resolve((config.get("target") or {}).get("path"), base)
    if model is None:
        raise UsageError(f"{run}: its run.yaml has no target.path; give --set target.path=PATH")
    checks = {model: "target.path (the target model)"}
    argv = [target.python, "-m", "workload.eval", "--config", config_path]
    prompts = extra.prompts
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
        lifecycle.apply_set(data, item)
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


def show(run: str, step: int, dest: Target, out: str, result: dict[str, Any]) -> None:
    """One result: our drafter, the reference's, and the gap per budget."""
    rows = [(f"{run} step_{step}", result)]
    ref = result.get("reference") if isinstance(result.get("reference"), dict) else None
    if ref is not None:
        rows.append(("reference", ref))
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
    if ref is not None:
        cells = ["gap (ours - ref)", _diff(result.get("tau"), ref.get("tau"))]
        cells += [_diff((result.get("ddtree") or {}).get(b), (ref.get("ddtree") or {}).get(b))
                  for b in budgets]  # fmt: skip
        grid.add_row(*cells, *(["-"] * width))
    c = console()
    c.print(grid)
    c.print(
        f"{result.get('n_prompts', '?')} prompts, max {result.get('max_new_tokens', '?')} new "
        f"tokens; tau = mean accepted + 1 per round; Pk = acceptance of draft slot k; "
        f"result: {dest.name}:{out}"
    )
    if isinstance(result.get("check_real"), dict):
        show_real(result["check_real"])


def show_real(check: dict[str, Any]) -> None:
    """The real draft-and-verify loop against the simulation (--check-real): per loop, its
    rounds as simulated and both taus; the chain loop's tokens/s against autoregressive."""
    grid = table("REAL LOOP", "ROUNDS EQUAL", "REAL TAU", "SIMULATED TAU", "TOKENS/S",
                 "AR TOKENS/S", "SPEEDUP")  # fmt: skip
    trees = check.get("ddtree") or {}
    chain = {
        k: check.get(k, 0) - sum(t.get(k, 0) for t in trees.values())
        for k in ("rounds_equal", "rounds_checked")
    }  # the totals count every loop's
    speedup = check.get("speedup")
    grid.add_row("chain", real_rounds(chain), metric(check.get("real_tau"), "streak"),
                 metric(check.get("simulated_tau"), "streak"),
                 metric(check.get("real_tokens_per_s"), "tok_s"),
                 metric(check.get("ar_tokens_per_s"), "tok_s"),
                 "-" if speedup is None else f"{speedup:.2f}x")  # fmt: skip
    for b in sorted(trees, key=int):
        t = trees[b]
        grid.add_row(f"DDTree {b}", real_rounds(t), metric(t.get("real_tau"), "streak"),
                     metric(t.get("simulated_tau"), "streak"), "-", "-", "-")  # fmt: skip
    n = check.get("prompts", "?")
    c = console()
    c.print()
    c.print(grid)
    c.print(f"real loop on {n} prompt{'' if n == 1 else 's'} (--check-real): ROUNDS EQUAL = "
            f"rounds as simulated / rounds run ({real_rounds(check)} in all); TOKENS/S: the "
            "chain loop's generated tokens per second, AR: plain greedy decoding's")  # fmt: skip


def _diff(ours: float | None, ref: float | None) -> str:
    return "-" if ours is None or ref is None else f"{ours - ref:+.2f}"


def show_steps(run: str, dest: Target, done: list[dict[str, Any]]) -> None:
    """A sweep: one row per step (and the reference's tau beside it)."""
    budgets = sorted({b for r in done for b in (r.get("ddtree") or {})}, key=int)
    checked = any("check_real" in r for r in done)
    grid = table("STEP", "PROMPTS", "TAU", *(f"DDTREE {b}" for b in budgets), "REF TAU",
                 *(["REAL ROUNDS"] if checked else []))  # fmt: skip
    for r in done:
        ref = r.get("reference") or {}
        cells = [str(r["step"]), metric(r.get("n_prompts")), metric(r.get("tau"), "streak")]
        cells += [metric((r.get("ddtree") or {}).get(b), "streak") for b in budgets]
        cells += [gap(r.get("tau"), ref.get("tau"))]
        grid.add_row(*cells, *([real_rounds(r.get("check_real"))] if checked else []))
    c = console()
    c.print(f"{run} on {dest.name}:")
    c.print(grid)
    c.print("tau = mean accepted + 1 per round; REF TAU: the reference's (ours - reference); "
            f"all results: dflashops evals {run}")  # fmt: skip
