"""`stop RUN`: ask the trainer to save a checkpoint and stop (SIGTERM), wait, report the
checkpoint. The trainer finishes its step, checkpoints and exits 0 with state "stopped"."""

from __future__ import annotations

import time

import typer

from dflashops import context, runs
from dflashops.errors import OpsError
from dflashops.render import Stopwatch, duration
from dflashops.runs import RunView
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
        json_out: bool = typer.Option(False, "--json", help="Print one JSON document."),
    ) -> None:
        """Ask a run's trainer to save a checkpoint and stop; wait until it has."""
        opts = context.get(ctx)
        as_json = opts.want_json(json_out)
        with runs.sessions(opts) as (reader, writer):
            view = runs.find(reader, run, checkpoints=True, records="none")
            if not view.running:
                if as_json:
                    opts.emit({**view.summary(), "stopped": False})
                else:
                    context.say(f"{run}: not running ({view.state}); nothing to stop")
                return
            reading = reader.machine(view.target)
            pid = signal_trainer(writer.machine(view.target), reading, view)
            if opts.dry_run:
                runs.dry_run_done(opts, **view.summary(), stopped=False)
                return
            context.note(f"{run}: asked the trainer (pid {pid}) to save a checkpoint and stop")
            view = wait_stopped(reading, run, timeout)
        newest = max(view.complete_steps(), default=None)
        if as_json:
            opts.emit({**view.summary(), "stopped": True, "checkpoint": newest})
            return
        saved = f"step_{newest}" if newest is not None else "no complete checkpoint"
        context.say(
            f"{run}: {view.state} at step {view.step}; newest checkpoint {saved}; "
            f"continue with: dflashops resume {run}"
        )


def signal_trainer(machine: Machine, reading: Machine, view: RunView, wait_s: float = 120) -> int:
    """SIGTERM to the trainer's pid (from state.json); waits for the pid while it starts."""
    clock = Stopwatch()
    while True:
        sent = runs.control(machine, "signal", view.dir, signal="TERM")
        if machine.dry_run:
            return 0
        if sent.get("pid"):
            return int(sent["pid"])
        fresh = runs.reread(reading, view.name, records="none")
        if not fresh.running:
            raise OpsError(f"{view.name}: ended ({fresh.state}) before it could be stopped")
        if clock.seconds > wait_s:
            raise OpsError(f"{view.name}: no trainer process to signal after {wait_s:.0f}s")
        time.sleep(1.0)


def wait_stopped(machine: Machine, run: str, timeout: float) -> RunView:
    clock = Stopwatch()
    next_note = 10.0
    while True:
        view = runs.reread(machine, run, records="none", checkpoints=True)
        if not view.running:
            if view.state == "failed":
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
