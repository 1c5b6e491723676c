"""`stop RUN`: ask the trainer to save a checkpoint and stop (SIGTERM to rank 0, which tells
every rank at the end of the step), wait until every node has exited, report the checkpoint.
`stop RUN --kill`: SIGKILL to every node's torchrun and ranks, for a trainer that does not stop.
Processes are recognised by pid and start time, never by a name."""

from __future__ import annotations

import time

import typer

from dflashops import context, runs
from dflashops.errors import OpsError
from dflashops.render import Stopwatch, duration
from dflashops.runs import RunView
from dflashops.ssh.session import Session
from dflashops.targets.base import Machine


def register(app: typer.Typer) -> None:
    @app.command("stop")
    @context.command
    def stop(
        ctx: typer.Context,
        run: str = typer.Argument(..., metavar="RUN", help="A running run."),
        timeout: float = typer.Option(
            900, "--timeout", metavar="SECONDS", help="How long to wait for the checkpoint."
        ),
        kill: bool = typer.Option(
            False, "--kill", help="Kill it now (SIGKILL, every node): no checkpoint is saved."
        ),
        host: str = context.HOST_OPTION,
        json_out: bool = typer.Option(False, "--json", help="Print one JSON document."),
    ) -> None:
        """Ask a run's trainer to save a checkpoint and stop; wait until it has."""
        opts = context.get(ctx)
        as_json = opts.want_json(json_out)
        with runs.sessions(opts) as (reader, writer):
            view = runs.find(reader, run, host=host, checkpoints=True, records="none")
            if not view.running and not any(v.running for v in view.nodes):
                if as_json:
                    opts.emit({**view.summary(), "stopped": False})
                else:
                    context.say(f"{run}: not running ({view.state}); nothing to stop")
                return
            if kill:
                kill_nodes(writer, view)
            else:
                pid = signal_trainer(writer.machine(view.target), reader, view)
            if opts.dry_run:
                runs.dry_run_done(opts, **view.summary(), stopped=False)
                return
            if kill:
                context.note(f"{run}: killed on {', '.join(view.node_targets)}")
            else:
                context.note(f"{run}: asked the trainer (pid {pid}) to save a checkpoint and stop")
            view = wait_stopped(reader, view, 60 if kill else timeout, killed=kill)
        newest = max(view.complete_steps(), default=None)
        if as_json:
            opts.emit({**view.summary(), "stopped": True, "checkpoint": newest})
            return
        saved = f"step_{newest}" if newest is not None else "no complete checkpoint"
        context.say(
            f"{run}: {view.state} at step {view.step}; newest checkpoint {saved}; "
            f"continue with: dflashops resume {run}"
        )


def kill_nodes(writer: Session, view: RunView) -> None:
    targets = [writer.inventory.target(t) for t in view.node_targets]
    dirs = {v.target: v.dir for v in view.nodes or [view]}
    answers = writer.each(
        lambda t: runs.control(writer.machine(t), "kill", dirs.get(t.name, view.dir)), targets
    )
    for target, answer in zip(targets, answers, strict=True):
        if isinstance(answer, OpsError):
            context.note(f"{target.name}: not killed: {answer.message}")


def signal_trainer(machine: Machine, reader: Session, view: RunView, wait_s: float = 120) -> int:
    """SIGTERM to rank 0's pid (node 0's state.json); waits for the pid while it starts."""
    clock = Stopwatch()
    while True:
        sent = runs.control(machine, "signal", view.dir, signal="TERM")
        if machine.dry_run:
            return 0
        if sent.get("pid"):
            return int(sent["pid"])
        fresh = runs.refresh(reader, view, records="none")
        if not fresh.running:
            raise OpsError(f"{view.name}: ended ({fresh.state}) before it could be stopped")
        if clock.seconds > wait_s:
            raise OpsError(f"{view.name}: no trainer process to signal after {wait_s:.0f}s")
        time.sleep(1.0)


def wait_stopped(reader: Session, view: RunView, timeout: float, *, killed: bool) -> RunView:
    """Until no node runs anything of the run (its launcher too: it records the exit code)."""
    clock = Stopwatch()
    next_note = 10.0
    run = view.name
    while True:
        view = runs.refresh(reader, view, records="none", checkpoints=True)
        if not any(runs.node_alive(v.raw) for v in view.nodes or [view]):
            if view.state == "failed" and not killed:
                raise OpsError(f"{run}: the trainer failed while stopping ({view.note or ''})")
            return view
        if clock.seconds > timeout:
            raise OpsError(
                f"{run}: still running after {duration(clock.seconds)}; it may still be saving "
                f"(`dflashops logs {run}` shows what it does)"
            )
        if clock.seconds >= next_note:
            context.note(f"{run}: saving and stopping ({duration(clock.seconds)})")
            next_note += 10
        time.sleep(1.0)
