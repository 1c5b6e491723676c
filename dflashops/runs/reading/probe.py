"""The client of remote/runs_probe.py: one call per target reads everything about its jobs
(state, log records, console, checkpoints, GPUs, paths) as one JSON document. A read by name
looks in the homes of every kind of job (runs/lifecycle/kinds.py); a read of all jobs (no names) in those
of the kinds that `status` lists."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dflashops import context
from dflashops.errors import OpsError
from dflashops.remote import argv as helper_argv
from dflashops.runs.lifecycle import kinds
from dflashops.runs.reading.failure import cause_note, root_cause
from dflashops.runs.reading.view import RunView, derive_state
from dflashops.targets.base import Machine


@dataclass
class Probe:
    """One target's answer."""

    names: dict[str, list[str]]
    runs: list[RunView]
    dirs: dict[str, dict[str, Any]]
    paths: dict[str, str]
    gpus: dict[str, Any] | None = None  # what nvidia-smi says (None: no nvidia-smi there)
    free_port: int | None = None

    def has(self, run: str) -> str | None:
        """Where ('runs', 'archive', another kind's home) a job of that name lives here."""
        return next((w for w, found in self.names.items() if run in found), None)


def probe(machine: Machine, **request: Any) -> Probe:
    """Run the probe once in `machine` (see remote/runs_probe.py for the request's keys)."""
    target = machine.target
    every = request.get("names") is not None
    request = {"ws": target.workspace, "homes": kinds.homes(every=every), **request}
    argv = helper_argv("runs_probe.py")
    cwd = "/" if target.kind == "local" else None  # a read makes no workspace there
    result = machine.run(argv, stdin=json.dumps(request).encode(), cwd=cwd)
    if machine.dry_run:
        return Probe({where: [] for where in request["homes"]}, [], {}, {})
    if result.returncode == 127:
        raise OpsError(f"{target.name}: python3 not found; install it in the target")
    if not result.ok:
        raise OpsError(f"{target.name}: could not read its runs: {result.error_text}")
    try:
        doc = json.loads(result.stdout)
    except ValueError:
        raise OpsError(f"{target.name}: the run probe printed something that is not JSON") from None
    views = []
    for raw in doc["runs"]:
        if "error" in raw:
            context.note(f"{target.name}: {raw['where']}/{raw['name']}: {raw['error']}")
            continue
        state, note = derive_state(raw, doc["now"])
        view = RunView(raw["name"], target.name, raw["where"], raw["dir"], state, doc["now"],
                       raw, note, kind=kinds.by_where(raw["where"]))  # fmt: skip
        if state == "failed" and root_cause(view):
            view.note = cause_note(*root_cause(view))
        views.append(view)
    return Probe(doc["names"], views, doc["dirs"], doc["paths"], doc.get("gpus"),
                 doc.get("free_port"))  # fmt: skip
