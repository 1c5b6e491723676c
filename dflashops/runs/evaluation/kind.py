"""The eval job, a kind of job: `eval RUN --steps ... --on TARGET` starts it (runs/evaluation/job.py)
in <ws>/evals/RUN/jobs/ID/, named eval-RUN-ID; its launcher runs remote/evaljob.py, which
evaluates the steps of its job.json one after the other (`python -m workload.eval`, each
result in <ws>/evals/RUN/step_N.json). `evals` lists its jobs; `status`, `logs`, `stop` and
`resume` take its name. Its progress is the steps it has evaluated (state.json's "done");
`stop` ends the step being evaluated (the finished ones are kept), `resume` evaluates the rest.
"""

from __future__ import annotations

import posixpath
import re
import secrets as random_tokens
import time
from typing import Any

from dflashops.errors import UsageError
from dflashops.remote import layout
from dflashops.remote import source as helper_source
from dflashops.runs.lifecycle.job_kind import JobKind
from dflashops.runs.lifecycle.placement import Node, Placement
from dflashops.runs.reading.view import Progress, RunView

JOB = "evaljob.py"
JOB_NAME = re.compile(r"eval-(.+)-(\d{8}-\d{6}-[0-9a-f]{4})")  # eval-RUN-ID


class EvalJob(JobKind):
    name = "eval"
    noun = "eval job"
    program = "evaluator"
    home = layout.EVALS
    pattern = "evals/*/jobs"
    template = "eval-{}-{}"  # eval-RUN-ID
    listed = False  # `evals` lists them
    global_names = False  # its id is new: making its directory claims it
    stop_request = "stop (the steps it finished are kept)"
    job_name = JOB_NAME
    article = "an"

    def new_job(self, run: str) -> tuple[str, str]:
        """(name, id) of a new job evaluating run `run`: the id is the time and 4 random hex."""
        job_id = time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + random_tokens.token_hex(2)
        return self.template.format(run, job_id), job_id

    def parts(self, name: str) -> list[str]:
        found = self.job_name.fullmatch(name)
        if found is None:
            shape = self.template.format("RUN", "ID")
            raise UsageError(f"{name!r} is not the name of {self.article} {self.noun} ({shape})")
        return list(found.groups())

    def argv(self, placement: Placement, node: Node, rundir: str, *, resume: bool) -> list[str]:
        return ["python3", posixpath.join(rundir, JOB), rundir]  # it resumes by its state.json

    def helpers(self) -> dict[str, str]:
        return {JOB: helper_source(JOB)}

    def progress(self, view: RunView) -> Progress:
        steps = view.status.get("steps") or []
        return Progress(len(view.status.get("done") or []), len(steps), "steps")

    def details(self, view: RunView) -> list[tuple[str, str]]:
        done = set(view.status.get("done") or [])
        steps = ", ".join(f"{s}" + (" (done)" if s in done else "")
                          for s in view.status.get("steps") or [])  # fmt: skip
        rows = [("of run", str(view.status.get("run"))), ("steps", steps or "-"),
                ("engine", str(view.status.get("engine") or "sim"))]  # fmt: skip
        return rows + [("results", "dflashops evals " + str(view.status.get("run")))]

    def stopped(self, view: RunView) -> tuple[str, dict[str, Any]]:
        progress = self.progress(view)
        return f" with {progress.done} of {progress.total} steps evaluated", {
            "done": view.status.get("done") or []
        }

    def check_resumable(self, view: RunView) -> None:
        super().check_resumable(view)
        progress = self.progress(view)
        if progress.total and progress.done == progress.total:
            raise UsageError(f"{view.name}: every step is evaluated; nothing to resume")

    def resume_note(self, view: RunView) -> str:
        progress = self.progress(view)
        return f"{view.name}: resuming with {progress.total - progress.done} step(s) to evaluate"


EVAL = EvalJob()
