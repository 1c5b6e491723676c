"""`launch RUN --host TARGET[,TARGET...]|any[:ROLE] [--config FILE|TEMPLATE] [--set KEY=VALUE]...
[--sweep KEY=A,B]... [--queue] [--nproc N] [--secret NAME]... [--force]`

One read of every target first (name free everywhere, chosen targets not busy, their GPUs),
then: the name claimed on each node, the workload snapshot, the run directory (run.yaml,
launch.json, launcher.py), the memory plan checked on node 0, and the launcher started in a
detached session of our own tmux server on each node; then it waits for the trainer's first
sign of life. A launch that fails takes back what it made (runs/training/launch.py).
`--host any` takes the first free target of the role (runs/lifecycle/choose.py); `--queue` waits
for a busy one where none is free (runs/lifecycle/queue.py); `--sweep` makes one run per
combination of values (runs/lifecycle/sweep.py), one launch after the other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer

from dflashops import context
from dflashops.commands import _options
from dflashops.errors import OpsError, UsageError
from dflashops.inventory import Target
from dflashops.runs.evaluation.continuous_cli import with_launch
from dflashops.runs.evaluation.job import Extra
from dflashops.runs.lifecycle.choose import of_role, wanted_role
from dflashops.runs.lifecycle.rehearse import check_config, template_target_config
from dflashops.runs.lifecycle.sweep import Member, axes, members
from dflashops.runs.reading.view import check_name
from dflashops.runs.training.config import resolve_config
from dflashops.runs.training.launch import launch as start_run
from dflashops.runs.watching.status_follow import report, then_follow
from dflashops.ssh.session import Session

FORCE_OPTION = typer.Option(
    False,
    "--force",
    help="Launch even where the GPUs are held (another run, a process nvidia-smi shows) or "
    "the memory plan does not fit.",
)


def register(app: typer.Typer) -> None:
    @app.command("launch")
    @context.command
    def launch(
        ctx: typer.Context,
        run: str = typer.Argument(
            ..., metavar="RUN", help="A new run name, unique across the inventory."
        ),
        host: str = typer.Option(
            ...,
            "--host",
            metavar="TARGET[,TARGET...]|any[:ROLE]",
            help="The target(s) to train on; several make one run (one torchrun each, "
            "rank 0 on the target whose address sorts first). `any` (`any:ROLE`): the first "
            "target of role train (ROLE) that is up, free (no run of ours, no process on its "
            "GPUs) and fits the memory plan; -v says why each other was passed over.",
        ),
        sweeps: list[str] = typer.Option(
            None,
            "--sweep",
            metavar="KEY=A,B[,...]",
            help="Make RUN a sweep: one run per combination of the values (repeat for more "
            "keys), named RUN-<key><value>..., each placed as --host says; `status`, "
            "`compare` and `diff` take RUN for its runs.",
        ),
        queue: bool = typer.Option(
            False,
            "--queue",
            help="Where the target (or every target of `any`) is busy, return at once and wait "
            "there, queued: the run starts when it frees, after the launches queued there "
            "before it; `status` lists it, `stop RUN` cancels it.",
        ),
        config: str = typer.Option(
            None,
            "--config",
            metavar="FILE|TEMPLATE",
            help="A run config: a YAML file, or a template of templates/runs/.",
        ),
        sets: list[str] = _options.set_option(
            "Override a config key (dotted, YAML-typed), e.g. --set optim.max_steps=500."
        ),
        nproc: int = typer.Option(
            None,
            "--nproc",
            min=1,
            metavar="N",
            help="Processes per target (default: its gpus in the inventory, else the GPUs "
            "nvidia-smi shows there, else 1).",
        ),
        secrets: list[str] = _options.SECRETS_OPTION,
        force: bool = FORCE_OPTION,
        skip_unreadable: str = typer.Option(
            None,
            "--skip-unreadable",
            metavar="TARGET[,TARGET...]",
            help="Targets not to warn about when they cannot be read (the name is checked "
            "where it can be).",
            hidden=True,
        ),
        eval_on: str = typer.Option(
            None,
            "--eval-on",
            metavar="TARGET",
            help="Evaluate its checkpoints there as they "
            "appear (a continuous eval; with --eval-every).",
        ),
        eval_every: int = typer.Option(
            None, "--eval-every", metavar="N", help="The steps between evaluated checkpoints."
        ),
        eval_max_new_tokens: int = typer.Option(
            None, "--eval-max-new-tokens", metavar="N", help="Its evaluator's --max-new-tokens."
        ),
        eval_max_prompts: int = typer.Option(
            None, "--eval-max-prompts", metavar="N", help="Its evaluator's --max-prompts."
        ),
        target_config: str = typer.Option(
            None,
            "--target-config",
            metavar="PATH",
            help="With --dry-run: a local copy of the target model's config.json (or its "
            "directory), for the memory plan computed here (where torch is installed).",
        ),
        follow: bool = _options.FOLLOW_OPTION,
        wait: float = _options.WAIT_OPTION,
        json_out: bool = _options.JSON_OPTION,
    ) -> None:
        """Start a training run in a detached tmux session on one target or several."""
        opts = context.begin(ctx, json_out)
        check_name(run)
        if (eval_on is None) != (eval_every is None):
            raise UsageError("--eval-on TARGET and --eval-every N go together: give both")
        if eval_every is not None and eval_every < 1:
            raise UsageError(f"--eval-every {eval_every}: a number of steps, >= 1")
        text = resolve_config(config, sets or [], run)
        if target_config is not None and not opts.dry_run:
            raise UsageError("--target-config goes with --dry-run (a launch reads the target's)")
        if opts.dry_run:
            check_config(run, text)
            target_config = target_config or template_target_config(run, config)
        values = _options.secret_values(secrets or [])
        inventory = opts.inventory()
        role = wanted_role(host)
        if role is not None:
            if force:
                raise UsageError(f"--host {host} takes free targets only: name one to --force")
            targets = of_role(inventory, role)
        else:
            targets = [inventory.target(name) for name in _options.parse_hosts(host)]
            if queue and len(targets) > 1:
                raise UsageError(f"--queue waits for one target: --host {host} names "
                                 f"{len(targets)}; name one, or any[:ROLE]")  # fmt: skip
        if queue and eval_on is not None:
            raise UsageError("--queue: --eval-on follows a started run; give it with `dflashops "
                             "eval RUN --every N --on TARGET` once the run starts")  # fmt: skip
        if queue and force:
            raise UsageError("--queue waits for a free target, --force takes a busy one: give one")
        evaluator = inventory.target(eval_on) if eval_on is not None else None
        skip = set(_options.parse_hosts(skip_unreadable)) if skip_unreadable else set()
        how = {"skip": skip, "force": force, "nproc": nproc, "wait": wait, "role": role,
               "verbose": bool(opts.verbose), "queue": queue}  # fmt: skip
        if sweeps:
            if follow or evaluator is not None:
                raise UsageError("--sweep: --follow and --eval-on take one run; leave them out")
            swept = members(run, axes(sweeps))
            with opts.sessions() as (reader, writer):
                code = launch_sweep(reader, writer, run, swept, targets, config, sets or [],
                                    values, how, emit=opts.emit if opts.json else None)  # fmt: skip
            raise typer.Exit(code)
        with opts.sessions() as (reader, writer):
            done = start_run(reader, writer, run, targets, text, values,
                             target_config=target_config, **how)  # fmt: skip
            if done.view is None:
                opts.dry_run_done(run=run, targets=[n.target.name for n in done.placement.nodes],
                                  nodes=done.placement.record())  # fmt: skip
                return
            if evaluator is not None:
                extra = Extra(None, None, eval_max_new_tokens, eval_max_prompts, [])
                with_launch(reader, writer, run, evaluator, eval_every, extra)
            follow = follow and done.view.state != "queued"
            code = then_follow(reader, done.view, follow, opts.emit if opts.json else None)
            if code is not None:
                raise typer.Exit(code)


def launch_sweep(
    reader: Session,
    writer: Session,
    sweep: str,
    swept: list[Member],
    targets: list[Target],
    config: str | None,
    sets: list[str],
    values: dict[str, str],
    how: dict[str, Any],
    *,
    emit: Callable[[Any], None] | None,
) -> int:
    """Every run of the sweep, one after the other, each placed as `how` says; one that
    cannot start is said with its reason and the rest go on. The exit code: 0 when all
    started, else the refusal's when none did, else 1."""
    started: list[Any] = []
    refused: dict[str, OpsError] = {}
    for member in swept:
        text = resolve_config(config, [*sets, *member.sets], member.run)
        try:
            done = start_run(reader, writer, member.run, targets, text, values,
                             state=member.state(sweep), **how)  # fmt: skip
        except OpsError as exc:
            context.note(f"error: {exc.message}")
            refused[member.run] = exc
            continue
        if done.view is not None:
            started.append(done.view)
            if emit is None:
                report(done.view)
    if emit is not None:
        emit({"sweep": sweep, "started": [v.summary() for v in started],
              "not_started": {r: e.message for r, e in refused.items()}})  # fmt: skip
    queued = [v.name for v in started if v.state == "queued"]
    if refused:
        waiting = f", {len(queued)} queued" if queued else ""
        context.note(f"{sweep}: {len(started) - len(queued)} of {len(swept)} run(s) started"
                     f"{waiting}; not started: {', '.join(refused)}")  # fmt: skip
    if not refused:
        return 0
    return int(next(iter(refused.values())).code) if not started else 1
