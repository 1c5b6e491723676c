"""The continuous eval, a kind of job: `eval RUN --every N --on TARGET` (and `launch ...
--eval-on TARGET --eval-every N`) starts it (runs/evaluation/continuous.py) in <ws>/evals/RUN/follow/ID/ on
the eval target, named follow-RUN-ID; its launcher runs remote/follow_eval.py, which follows
the run through the checkpoint server on the training target (remote/ckpt_server.py): each
complete checkpoint whose step is a multiple of N, and the run's last, copied (verified) and
evaluated once, its result <ws>/evals/RUN/step_N.json (what `evals`, `status RUN`, `compare
--tau` and the plot read). `status`, `logs`, `stop` and `resume` take its name; `stop` ends
the step being evaluated, `resume` goes on with what is not evaluated yet (the checkpoint
server started again if it has gone meanwhile: runs/lifecycle/resume.py, continuous.py's revive_server).
"""

from __future__ import annotations

import posixpath
import re
from typing import Any

from dflashops.remote import source as helper_source
from dflashops.runs.evaluation.kind import EvalJob
from dflashops.runs.lifecycle.job_kind import JobKind
from dflashops.runs.lifecycle.placement import Node, Placement
from dflashops.runs.reading.view import Progress, RunView

PROGRAM = "follow_eval.py"
JOB_NAME = re.compile(r"follow-(.+)-(\d{8}-\d{6}-[0-9a-f]{4})")  # follow-RUN-ID


class FollowJob(EvalJob):
    """Named and started as an eval job is; what it runs and how it is read differ."""

    name = "follow"
    noun = "continuous eval"
    program = "follower"
    home = "follows"  # a key of the probe's homes; its jobs live by `pattern`
    pattern = "evals/*/follow"
    template = "follow-{}-{}"  # follow-RUN-ID
    listed = False
    global_names = False  # its id is new: making its directory claims it
    stop_request = "stop (the steps it evaluated are kept)"
    job_name = JOB_NAME
    article = "a"

    def argv(self, placement: Placement, node: Node, rundir: str, *, resume: bool) -> list[str]:
        return ["python3", posixpath.join(rundir, PROGRAM), rundir]  # it resumes by the results

    def helpers(self) -> dict[str, str]:
        return {PROGRAM: helper_source(PROGRAM)}

    def progress(self, view: RunView) -> Progress:
        done = len(view.status.get("done") or [])
        return Progress(done, done, "steps evaluated")

    def details(self, view: RunView) -> list[tuple[str, str]]:
        s = view.status
        done = ", ".join(map(str, s.get("done") or [])) or "-"
        rows = [("of run", f"{s.get('run')} (on {s.get('from')}), every {s.get('every')} steps"),
                ("evaluated", done)]  # fmt: skip
        for key in ("skipped", "failed"):
            if s.get(key):
                rows.append((key, ", ".join(map(str, s[key]))))
        lags = s.get("lags") or {}
        if lags:
            each = ", ".join(f"step {k} {v:.1f} s" for k, v in lags.items())
            rows.append(("lag", f"{each} (checkpoint complete -> its result stored)"))
        return rows + [("results", f"dflashops evals {s.get('run')}")]

    def stopped(self, view: RunView) -> tuple[str, dict[str, Any]]:
        done = view.status.get("done") or []
        return f" with {len(done)} step(s) evaluated", {"done": done}

    def check_resumable(self, view: RunView) -> None:
        JobKind.check_resumable(self, view)  # not the eval job's: its steps are not known ahead

    def resume_note(self, view: RunView) -> str:
        return f"{view.name}: resuming (the steps evaluated are not evaluated again)"


FOLLOW = FollowJob()
