"""The datagen job, a kind of job: `datagen NAME --host TARGET[,TARGET...]` starts it
(runs/datagen/job.py) in <ws>/data/NAME/ on each target (CONTRACTS §7: the directory is the
dataset). Its launcher runs remote/datagenjob.py, which becomes the generator (`python -m
workload.datagen`, this node's share of the input: --nnodes/--node-rank). `status`, `logs`,
`stop` and `resume` take its NAME. Its progress is the conversations its ranks finished
(done + failed + skipped, from their heartbeats) of the input; `stop` asks every node to stop
after its current chunk (the finished chunks are kept), `resume` generates the rest.
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

from dflashops.errors import UsageError
from dflashops.remote import source as helper_source
from dflashops.runs.lifecycle.job_kind import JobKind
from dflashops.runs.lifecycle.placement import Node, Placement
from dflashops.runs.reading.view import Progress, RunView

JOB = "datagenjob.py"
SETTINGS = "datagen.json"  # the job's settings and each node's argv, written at its start


class Datagen(JobKind):
    name = "datagen"
    noun = "datagen job"
    program = "generator"
    home = "data"
    files = (SETTINGS,)
    stop_request = "stop after its current chunk (the chunks it finished are kept)"
    stop_every_node = True  # its nodes share nothing: each is asked

    def argv(self, placement: Placement, node: Node, rundir: str, *, resume: bool) -> list[str]:
        return ["python3", posixpath.join(rundir, JOB), rundir]  # it resumes by its chunks

    def helpers(self) -> dict[str, str]:
        return {JOB: helper_source(JOB)}

    def progress(self, view: RunView) -> Progress:
        beats = view.ranks
        total = view.status.get("total")
        if not beats:
            return Progress(0 if total else None, total, "conversations")
        done = sum(int(b.get(k) or 0) for b in beats for k in ("done", "failed", "skipped"))
        live = [b for b in beats if b.get("status") == "running" and b.get("alive")]
        rate = sum(float(b.get("conversations_per_s") or 0) for b in live) if live else None
        etas = [b["eta_s"] for b in live if isinstance(b.get("eta_s"), (int, float))]
        eta = max(etas) if etas and view.running else None
        return Progress(done, total, "conversations", eta, rate)

    def settings(self, view: RunView) -> dict[str, Any]:
        text = (view.raw.get("files") or {}).get(SETTINGS)
        try:
            doc = json.loads(text) if text else {}
        except ValueError:
            doc = {}
        return doc.get("settings") or {} if isinstance(doc, dict) else {}

    def details(self, view: RunView) -> list[tuple[str, str]]:
        s = self.settings(view)
        progress = self.progress(view)
        rate = f", {progress.rate:.2f} conversations/s" if progress.rate else ""
        rows = [("progress", progress.text() + rate)]
        for key, label in (("prompts", "prompts"), ("target", "target"), ("engine", "engine")):
            if s.get(key) is not None:
                rows.append((label, str(s[key])))
        if s:
            rows.append(("sampling", f"temperature {s.get('temperature')}, max new tokens "
                                     f"{s.get('max_new_tokens')}, chat template kwargs "
                                     f"{json.dumps(s.get('chat_template_kwargs') or {})}"))  # fmt: skip
        rows.append(("dataset", f"{view.dir} (data.path for launch)"))
        return rows

    def summary(self, view: RunView) -> dict[str, Any]:
        return {"kind": self.name, "progress": self.progress(view).doc(),
                "settings": self.settings(view)}  # fmt: skip

    def stopped(self, view: RunView) -> tuple[str, dict[str, Any]]:
        progress = self.progress(view)
        return f" with {progress.done} of {progress.total} conversations finished", {
            "done": progress.done, "total": progress.total}  # fmt: skip

    def check_resumable(self, view: RunView) -> None:
        super().check_resumable(view)
        progress = self.progress(view)
        ended = [v.state for v in view.nodes or [view]]
        if progress.total and progress.done == progress.total and set(ended) == {"finished"}:
            raise UsageError(f"{view.name}: every conversation is generated; nothing to resume")

    def resume_note(self, view: RunView) -> str:
        progress = self.progress(view)
        left = (progress.total or 0) - (progress.done or 0)
        then = f"; then `dflashops datagen {view.name} --collect`" if view.multi else ""
        return f"{view.name}: resuming with {left} conversation(s) to generate{then}"


DATAGEN = Datagen()
