"""The training run, the first kind of job: `launch` starts it (runs/training/launch.py), a torchrun of
`python -m workload.train` on each of its nodes in <ws>/runs/RUN/ (moved to <ws>/archive/RUN/
by `archive`). Its progress is its step in train_log.jsonl; `stop` asks it to save a
checkpoint, and `resume` starts it again from its newest complete one (the trainer's --resume).
"""

from __future__ import annotations

from typing import Any

from dflashops.errors import NotFoundError
from dflashops.remote import layout
from dflashops.runs.lifecycle.job_kind import JobKind
from dflashops.runs.lifecycle.placement import Node, Placement, torchrun
from dflashops.runs.reading.view import RunView


class Training(JobKind):
    name = "run"
    noun = "run"
    program = "trainer"
    home = layout.RUNS
    archive = layout.ARCHIVE
    stop_request = "save a checkpoint and stop"

    def argv(self, placement: Placement, node: Node, rundir: str, *, resume: bool) -> list[str]:
        train = ["-m", "workload.train", "--config", layout.RUN_CONFIG, "--run-dir", rundir]
        return torchrun(placement, node) + train + (["--resume"] if resume else [])

    def details(self, view: RunView) -> list[tuple[str, str]]:
        rows = []
        if view.status.get("wandb_url"):
            rows.append(("wandb", view.status["wandb_url"]))
        ckpts = view.checkpoints
        if ckpts:
            names = [c.name + ("" if c.complete else " (incomplete)") for c in ckpts]
            rows.append(("checkpoints", ", ".join(names)))
        else:
            rows.append(("checkpoints", "none yet"))
        return rows

    def summary(self, view: RunView) -> dict[str, Any]:
        return {}  # a run's summary is the view's own (step, total_steps, eta_s, metrics)

    def stopped(self, view: RunView) -> tuple[str, dict[str, Any]]:
        newest = max(view.complete_steps(), default=None)
        saved = f"step_{newest}" if newest is not None else "no complete checkpoint"
        return f" at step {view.step}; newest checkpoint {saved}", {"checkpoint": newest}

    def check_resumable(self, view: RunView) -> None:
        super().check_resumable(view)
        if not view.complete_steps():
            raise NotFoundError(f"{view.name} has no complete checkpoint to resume from")

    def resume_note(self, view: RunView) -> str:
        return f"{view.name}: resuming from step_{max(view.complete_steps())}"


TRAINING = Training()
