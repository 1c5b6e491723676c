"""`eval RUN (--step N | --steps A,B,C) --on TARGET [--engine sim|vllm] [--reference PATH]
[--check-real N] [--budgets B,B] [--follow | --detach]`

An eval job: pulls each checkpoint TARGET lacks (pull-ckpt), then evaluates them one after the
other in a detached tmux session on TARGET (remote/launcher.py running remote/evaljob.py, as
`launch` runs a trainer: it survives a closed laptop). Each step runs `python -m workload.eval`
(--engine vllm: with the eval target's vLLM environment, engines.python_of; none there: one
line, exit 2, before anything starts) with the run's run.yaml and keeps its result in
<ws>/evals/RUN/step_N.json there (with the reference drafter's under "reference" when
--reference is given; --check-real N adds the real draft-and-verify loop's check on N prompts,
--budgets more DDTree budgets). The job lives in
<ws>/evals/RUN/jobs/ID/ (launch.json, job.json, state.json, console.log, exit_code).

One --step is followed to the end and its table printed (--detach: leave it); --steps returns
once the job has started (--follow: stay). `eval RUN --follow --on TARGET` attaches to RUN's
newest job there. Ctrl-C while following only detaches (exit 130): the job goes on.
`--every N` starts a continuous eval instead (runs/evaluation/continuous.py), and returns once it runs.
`dflashops evals RUN` lists the results.
"""

from __future__ import annotations

from typing import Any

import typer

from dflashops import context
from dflashops.commands import _options
from dflashops.errors import ExitCode, UsageError
from dflashops.inventory import Target
from dflashops.render import console, metric, table
from dflashops.runs.evaluation.continuous_cli import continuous
from dflashops.runs.evaluation.job import Extra, newest_job, read_result, start_eval
from dflashops.runs.evaluation.job import follow as follow_job
from dflashops.runs.evaluation.results import engine_note, gap, real_rounds
from dflashops.runs.evaluation.serving import (
    ServingChat,
    concurrency_levels,
    parse_vs,
    serve_result_path,
)
from dflashops.runs.evaluation.serving_table import show_serve
from dflashops.runs.lifecycle.rehearse import unread_is_said
from dflashops.runs.reading.view import check_name, eval_result_path


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
        every: int = typer.Option(
            None,
            "--every",
            metavar="N",
            help="Follow the run: each complete checkpoint whose step is a multiple of N, and "
            "its last, evaluated once as it appears (a continuous eval job on TARGET).",
        ),
        on: str = typer.Option(..., "--on", metavar="TARGET", help="The target to evaluate on."),
        host: str = _options.HOST_OPTION,
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
        engine: str = typer.Option(
            "auto",
            "--engine",
            metavar="auto|sim|vllm",
            help="vllm: the checkpoint served by the eval target's vLLM as the target's DFlash "
            "speculator (`setup TARGET --engine vllm`); sim: the simulation; auto (default): "
            "vllm where the eval target has it, else sim.",
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
        sets: list[str] = _options.set_option(
            "Override a key of the run's config here, e.g. --set target.path=/models/Qwen3-8B."
        ),
        follow: bool = typer.Option(
            False, "--follow", help="Stay with the job until it ends (Ctrl-C detaches)."
        ),
        detach: bool = typer.Option(False, "--detach", help="Start the job and return at once."),
        force: bool = typer.Option(
            False,
            "--force",
            help="Evaluate despite train-to-serve parity mismatches (the "
            "result records them; see `dflashops check`).",
        ),  # fmt: skip
        serve: bool = typer.Option(
            False,
            "--serve",
            help="The serving benchmark instead: the target served by the eval target's vLLM "
            "server with the checkpoint as its speculator and without it, driven by vLLM's "
            "benchmark client at each --concurrency: tokens/s, TTFT, TPOT, speedup.",
        ),
        concurrency: str = typer.Option(
            None, "--concurrency", metavar="1,4,16", help="--serve's concurrencies."
        ),
        vs: str = typer.Option(
            None,
            "--vs",
            metavar="RUN2:STEP|PATH",
            help="--serve beside another drafter: a run's checkpoint, a drafter directory on "
            "the target, or a stored serving result (.json); the difference where the "
            "fingerprints agree.",
        ),
        vs_engine: str = typer.Option(
            None,
            "--vs-engine",
            metavar="NAME|PATH",
            help="--serve the checkpoint also in another vLLM environment of the target (an "
            "`engines:` name in hosts.yaml, e.g. vllm-0.31, or its python's absolute path), "
            "side by side: does a new engine version lower acceptance or speedup?",
        ),
        serve_template: str = _options.SERVE_CHAT_TEMPLATE_OPTION,
        serve_kwargs: str = _options.SERVE_CHAT_TEMPLATE_KWARGS_OPTION,
        json_out: bool = _options.json_option("Print the result JSON."),
    ) -> None:
        """Evaluate a run's checkpoints on a target, as a job: tau, DDTree tau, per position."""
        opts = context.begin(ctx, json_out)
        check_name(run)
        if follow and detach:
            raise UsageError("--follow and --detach: choose one")
        if every is not None and (step is not None or steps):
            raise UsageError("--every and --step/--steps: give one")
        chosen = [] if every is not None else chosen_steps(step, steps, follow)
        check_serve(serve, concurrency, vs, vs_engine, chosen, every, reference, check_real,
                    budgets, engine, serve_template, serve_kwargs)  # fmt: skip
        chat = ServingChat(serve_template, _options.json_object(serve_kwargs,
                                                                "--serve-chat-template-kwargs"))  # fmt: skip
        if check_real is not None and check_real < 0:
            raise UsageError(f"--check-real {check_real}: a number of prompts, >= 0")
        dest = opts.inventory().target(on)
        if not chosen and every is None:  # --follow alone: the newest job of RUN there
            job = newest_job(opts.session(), run, dest)
            return finish(opts, opts.json, dest, job)
        more = _options.parse_steps(budgets, "--budgets", least=1, example="128,256")
        extra = Extra(prompts, reference, max_new_tokens, max_prompts, sets or [], check_real, more,
                      host, engine, force, serve, concurrency_levels(concurrency) if serve
                      else None, parse_vs(vs), vs_engine, chat)  # fmt: skip
        if every is not None:
            return continuous(opts, opts.json, run, every, dest, extra)
        with opts.sessions() as (reader, writer), unread_is_said(reader, f"run {run}"):
            job = start_eval(reader, writer, run, chosen, dest, extra)
            if opts.dry_run:
                opts.dry_run_done(run=run, steps=chosen, on=dest.name, job=job["dir"])
                return
        if detach or (len(chosen) > 1 and not follow):
            return started(opts, opts.json, dest, job)
        finish(opts, opts.json, dest, job)


def check_serve(serve: bool, concurrency: str | None, vs: str | None, vs_engine: str | None,
                chosen: list[int], every: int | None, reference: str | None,
                check_real: int | None, budgets: str | None, engine: str,
                serve_template: str | None = None, serve_kwargs: str | None = None) -> None:  # fmt: skip
    """--serve takes one --step, one side-by-side axis, and none of the offline eval's own
    options."""
    if not serve:
        given = [n for n, v in (("--concurrency", concurrency), ("--vs", vs),
                                ("--vs-engine", vs_engine),
                                ("--serve-chat-template", serve_template),
                                ("--serve-chat-template-kwargs", serve_kwargs))
                 if v is not None]  # fmt: skip
        if given:
            raise UsageError(f"{', '.join(given)}: only with --serve")
        return
    if vs is not None and vs_engine is not None:
        raise UsageError("--vs and --vs-engine: give one (another drafter, or the same drafter "
                         "in another engine environment)")  # fmt: skip
    if every is not None or len(chosen) > 1:
        raise UsageError("--serve: one checkpoint at a time; give --step N")
    offline = [n for n, v in (("--reference", reference), ("--check-real", check_real),
                              ("--budgets", budgets)) if v is not None]  # fmt: skip
    if engine == "sim":
        offline.append("--engine sim")
    if offline:
        raise UsageError(f"--serve: {', '.join(offline)} belong to the offline eval (--vs puts "
                         "another drafter beside it)")  # fmt: skip


def chosen_steps(step: int | None, steps: str | None, follow: bool) -> list[int]:
    if step is not None and steps:
        raise UsageError("--step and --steps: give one (--steps 1000,2000 for several)")
    if step is not None:
        if step < 0:
            raise UsageError(f"--step {step}: steps are >= 0")
        return [step]
    if steps:
        found = _options.parse_steps(steps, "--steps", example="1000,2000,4000")
        if not found:
            raise UsageError(f"--steps {steps}: expected steps >= 0, e.g. 1000,2000,4000")
        return found
    if not follow:
        raise UsageError("give --step N or --steps A,B,C (or --follow to attach to a job)")
    return []


def started(opts: context.Context, as_json: bool, dest: Target, job: dict[str, Any]) -> None:
    run = job["run"]
    results = [eval_result_path(dest, run, s) for s in job["steps"]]
    if as_json:
        opts.emit({**job, "results": results})
        return
    console().print(
        f"eval job {job['job']} of {run} running on {dest.name} (tmux {job['tmux']}); "
        f"follow it: dflashops eval {run} --follow --on {dest.name}; "
        f"results: dflashops evals {run}"
    )


def finish(opts: context.Context, as_json: bool, dest: Target, job: dict[str, Any]) -> None:
    """Follow the job's console.log (to stderr) to its end, then print its results."""
    session = opts.session()
    try:
        done = follow_job(session, dest, job)
    except KeyboardInterrupt:
        context.note(f"detached; eval job {job['job']} keeps running on {dest.name}")
        raise typer.Exit(int(ExitCode.INTERRUPTED)) from None
    if job.get("serve"):
        out = serve_result_path(dest, job["run"], job["steps"][0])
        result = read_result(session, dest, out)
        if as_json:
            return opts.emit(result)
        return show_serve(job["run"], job["steps"][0], dest, out, result)
    if len(job["steps"]) == 1:
        result = read_result(session, dest, done[0]["file"])
        if as_json:
            return opts.emit(result)
        return show(job["run"], job["steps"][0], dest, done[0]["file"], result)
    if as_json:
        return opts.emit({"run": job["run"], "job": job["job"], "target": dest.name,
                          "results": done})  # fmt: skip
    show_steps(job["run"], dest, done)


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
    if engine_note(result):
        c.print(engine_note(result))
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
