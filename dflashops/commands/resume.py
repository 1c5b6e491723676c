"""`resume RUN`: start a stopped or failed run again from its newest complete checkpoint, on all
its nodes with the same number of processes each (the same world size), through the same
launcher as `launch` (the trainer's --resume). The run keeps the code it ran unless
`--update-code` takes the workload as it is now; secrets are asked for again (--secret)."""

from __future__ import annotations

import json
import time

import typer

from dflashops import context, lifecycle, runs
from dflashops.errors import NotFoundError, UsageError
from dflashops.lifecycle import Node, Placement
from dflashops.runs import RunView
from dflashops.ssh.session import Session


def register(app: typer.Typer) -> None:
    @app.command("resume")
    @context.command
    def resume(
        ctx: typer.Context,
        run: str = typer.Argument(..., metavar="RUN", help="A stopped or failed run."),
        host: str = context.HOST_OPTION,
        update_code: bool = typer.Option(
            False,
            "--update-code",
            help="Run the workload as it is now, not the snapshot the run started with.",
        ),
        secrets: list[str] = lifecycle.SECRETS_OPTION,
        follow: bool = lifecycle.FOLLOW_OPTION,
        wait: float = lifecycle.WAIT_OPTION,
        json_out: bool = lifecycle.JSON_OPTION,
    ) -> None:
        """Start a run again from its newest complete checkpoint."""
        opts = context.get(ctx)
        opts.want_json(json_out)
        values = lifecycle.secret_values(secrets or [])
        with runs.sessions(opts) as (reader, writer):
            view = runs.find(reader, run, host=host, checkpoints=True, records="none",
                             files=["launch.json"])  # fmt: skip
            check_resumable(view)
            placement = placement_of(reader, view)
            code = lifecycle.local_code()
            code_dirs = {} if update_code else recorded_code(view)
            have = {n.target.name: n.target.name in code_dirs for n in placement.nodes}
            made = lifecycle.Started(placement)
            for node in placement.nodes:
                reset = {"status": "launching", "exit_code": None, "finished": None,
                         "resumed": time.time()}  # fmt: skip
                runs.control(writer.machine(node.target), "relaunch", placement.dir(node),
                             **reset)  # fmt: skip
            lifecycle.prepare(
                writer, placement, code, lambda t, c: have.get(t.name, False), "", values, made,
                resume=True, code_dirs=code_dirs,
            )  # fmt: skip
            lifecycle.start_all(writer, placement)
            if opts.dry_run:
                context.note("dry run: nothing was changed")
                runs.dry_run_done(opts, run=run, target=view.target, dir=view.dir,
                                  from_step=max(view.complete_steps()))  # fmt: skip
                return
            context.note(f"{run}: resuming from step_{max(view.complete_steps())}")
            view = lifecycle.wait_for_life(reader, placement, timeout=wait)
            lifecycle.then_follow(opts, reader, view, follow)


def check_resumable(view: RunView) -> None:
    run = view.name
    if view.where == "archive":
        raise UsageError(f"{run} is archived ({view.target}:{view.dir}); it cannot resume")
    if view.running or any(v.running for v in view.nodes):
        raise UsageError(f"{run} is {view.state} on {view.target}; nothing to resume")
    if view.multi and len(view.nodes) < len(view.node_targets):
        raise UsageError(f"{run}: {view.note}; every node must be readable to resume")
    if not view.complete_steps():
        raise NotFoundError(f"{run} has no complete checkpoint to resume from")


def placement_of(reader: Session, view: RunView) -> Placement:
    """The run's nodes as it recorded them (same targets, same processes each), with a new
    rendezvous port on node 0."""
    recorded = view.status.get("nodes") or [{"target": view.target, "nproc": None}]
    nodes = []
    for index, item in enumerate(recorded):
        target = reader.inventory.target(item["target"])
        nproc = item.get("nproc") or view.status.get("world_size") or 1
        nodes.append(Node(index, target, int(nproc)))
    placement = Placement(view.name, view.run_id or lifecycle.new_run_id(), nodes)
    if placement.multi:
        first = nodes[0].target
        answer = runs.probe(reader.machine(first), names=[], free_port=first.node_address)
        placement.port = answer.free_port
    return placement


def recorded_code(view: RunView) -> dict[str, str]:
    """Each node's code snapshot, as its launch.json names it (runs from before snapshots
    have none: they take the workload as it is now)."""
    out = {}
    for node in view.nodes or [view]:
        text = (node.raw.get("files") or {}).get("launch.json")
        try:
            code = json.loads(text).get("code") if text else None
        except ValueError:
            code = None
        if code:
            out[node.target] = code
    return out
