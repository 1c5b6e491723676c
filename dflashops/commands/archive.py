"""`archive RUN [--keep-last N] [--keep-every K]`: move runs/RUN to archive/RUN on its target,
pruning checkpoints: keep the newest N complete ones and every multiple of K (the newest
complete one always stays); incomplete ones are removed. No option: keep every complete one.
`--dry-run` shows the plan and the command, and changes nothing."""

from __future__ import annotations

from dataclasses import dataclass

import typer

from dflashops import context, runs
from dflashops.errors import UsageError
from dflashops.render import console, human_bytes, styled, table
from dflashops.runs import Checkpoint


@dataclass
class Plan:
    keep: list[Checkpoint]
    remove: list[Checkpoint]

    @property
    def freed(self) -> int:
        return sum(c.bytes for c in self.remove)


def register(app: typer.Typer) -> None:
    @app.command("archive")
    @context.command
    def archive(
        ctx: typer.Context,
        run: str = typer.Argument(..., metavar="RUN", help="A run that is not running."),
        keep_last: int = typer.Option(
            None, "--keep-last", metavar="N", help="Keep the newest N complete checkpoints."
        ),
        keep_every: int = typer.Option(
            None,
            "--keep-every",
            metavar="K",
            help="Keep checkpoints whose step is a multiple of K.",
        ),
        host: str = context.HOST_OPTION,
        json_out: bool = typer.Option(False, "--json", help="Print one JSON document."),
    ) -> None:
        """Move a finished run to the target's archive/ (every node's), pruning checkpoints."""
        opts = context.get(ctx)
        as_json = opts.want_json(json_out)
        if keep_last is not None and keep_last < 0:
            raise UsageError("--keep-last: expected 0 or more")
        if keep_every is not None and keep_every < 1:
            raise UsageError("--keep-every: expected 1 or more")
        with runs.sessions(opts) as (reader, writer):
            view = runs.find(reader, run, host=host, records="none", checkpoints=True)
            if view.where == "archive":
                raise UsageError(f"{run} is already archived ({view.target}:{view.dir})")
            if view.running or any(v.running for v in view.nodes):
                raise UsageError(
                    f"{run} is {view.state} on {view.target}; stop it first (dflashops stop {run})"
                )
            plan = make_plan(view.checkpoints, keep_last, keep_every)
            dest = runs.run_dir(writer.machine(view.target).target, run, "archive")
            if not as_json:
                show_plan(view, plan, dest)
            done = runs.control(
                writer.machine(view.target), "archive", view.dir,
                delete=[c.name for c in plan.remove], to=dest,
            )  # fmt: skip
            for node in view.nodes[1:]:  # the other nodes of a run over several targets
                other = writer.machine(node.target)
                runs.control(other, "archive", node.dir,
                             to=runs.run_dir(other.target, run, "archive"))  # fmt: skip
        doc = {"run": run, "target": view.target, "from": view.dir, "to": dest,
               "kept": [c.name for c in plan.keep]}  # fmt: skip
        if opts.dry_run:
            context.note("dry run: nothing was changed")
            removed = [c.name for c in plan.remove]
            runs.dry_run_done(opts, **doc, removed=removed, freed_bytes=plan.freed)
            return
        if as_json:
            opts.emit({**doc, "to": done.get("dir", dest), "removed": done.get("removed", []),
                       "freed_bytes": done.get("freed", 0)})  # fmt: skip
            return
        context.say(
            f"{run}: archived on {view.target} to {dest}; removed {len(done.get('removed', []))} "
            f"checkpoint(s), freed {human_bytes(done.get('freed', 0))}"
        )


def make_plan(points: list[Checkpoint], keep_last: int | None, keep_every: int | None) -> Plan:
    complete = sorted(c.step for c in points if c.complete)
    newest = complete[-1] if complete else None
    if keep_last is None and keep_every is None:
        kept = set(complete)
    else:
        kept = set(complete[-keep_last:]) if keep_last else set()
        if keep_every:
            kept |= {s for s in complete if s % keep_every == 0}
        if newest is not None:
            kept.add(newest)
    keep = [c for c in points if c.complete and c.step in kept]
    remove = [c for c in points if not (c.complete and c.step in kept)]
    return Plan(keep, remove)


def show_plan(view: runs.RunView, plan: Plan, dest: str) -> None:
    out = console()
    out.print(f"{view.name}: {view.target}:{view.dir} -> {dest}")
    if plan.keep or plan.remove:
        grid = table("CHECKPOINT", "SIZE", "ACTION")
        for c in sorted(plan.keep + plan.remove, key=lambda c: (c.step, c.name)):
            if c in plan.keep:
                action = styled("keep", "green")
            else:
                action = styled("remove", "red") + ("" if c.complete else " (incomplete)")
            grid.add_row(c.name, human_bytes(c.bytes), action)
        out.print(grid)
    out.print(
        f"keeps {len(plan.keep)} checkpoint(s), removes {len(plan.remove)}, "
        f"frees {human_bytes(plan.freed)}"
    )
