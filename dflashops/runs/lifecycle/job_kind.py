"""What a kind of job is (`JobKind`): the one thing that differs between a training run, an eval
job and any later kind. Everything else of a job's life is shared, whatever its kind: its name
claimed (claim.py), the code snapshot (snapshot.py), launch.json and the launcher in a tmux
session of our own (start.py), state.json and the exit code (remote/launcher.py), finding it by
NAME (reading/survey.py), stop and resume (stop.py, resume.py), its console (watching/log_stream.py).

A kind says where its directories live, what its launcher runs, how its progress is read and
what stop and resume mean for it. The program a kind runs keeps to one contract, the trainer's:
it writes state.json's "status" ("running" once it works, then "finished" or "stopped"), its
"pid" and "pid_start" (so `stop` can signal it), stops cleanly on SIGTERM, and starts again
where it stopped when its launch.json asks it to resume. The launcher records its exit code.

A new kind is a subclass with its class attributes set and the methods below overridden where
the defaults do not fit, registered in kinds.py.
"""

from __future__ import annotations

import posixpath
import re
from typing import Any

from dflashops.errors import UsageError
from dflashops.inventory import Target
from dflashops.runs.lifecycle.placement import Node, Placement
from dflashops.runs.reading.view import Progress, RunView


class JobKind:
    """One kind of job. Its jobs are directories <ws>/<pattern>/<entry>/ in a target (the
    pattern is `home` unless given, e.g. "evals/*/jobs"), each named by `template` from the
    pattern's "*" parts and its entry (names are one namespace: `status NAME` finds a job of
    any kind)."""

    name: str = ""  # state.json's "kind"
    noun: str = "job"  # how messages name one
    program: str = "program"  # how messages name what its launcher runs
    home: str = ""  # a view's `where`
    pattern: str = ""  # default: home
    template: str = "{}"
    archive: str | None = None  # the home of its archived jobs, if it has one
    listed: bool = True  # `status` lists its jobs (else they are found by name only)
    global_names: bool = True  # a name is claimed across the inventory (else mkdir suffices)
    files: tuple[str, ...] = ()  # files of a job's directory the probe reads (for progress)
    stop_request: str = "stop"  # what SIGTERM asks of its program
    stop_every_node: bool = False  # `stop` signals every node's program (else node 0's only)

    @property
    def parents(self) -> str:
        """The directories holding its jobs, under the workspace."""
        return self.pattern or self.home

    def dir(self, target: Target, name: str) -> str:
        """Where job `name` lives in `target`."""
        return posixpath.join(target.workspace, self.rel(self.home, name))

    def rel(self, where: str, name: str) -> str:
        """Job `name`'s directory under the workspace, in `where` (its home, or its archive)."""
        if where != self.home or self.template == "{}":
            return f"{where}/{name}"
        parts = self.parts(name)
        stars = iter(parts[:-1])
        path = [next(stars) if p == "*" else p for p in self.parents.split("/")]
        return "/".join([*path, parts[-1]])

    def parts(self, name: str) -> list[str]:
        """The pattern's "*" parts and the entry of job `name`: `template` read backwards (a kind
        whose parts may hold the template's own separators overrides this, as the eval job's)."""
        if self.template == "{}":
            return [name]
        pieces = [re.escape(p) for p in self.template.split("{}")]
        found = re.fullmatch("(.+?)".join(pieces), name)
        if found is None:
            raise UsageError(f"{name!r} is not the name of a {self.noun}")
        return list(found.groups())

    # ------------------------------------------------------------ what its launcher runs

    def argv(self, placement: Placement, node: Node, rundir: str, *, resume: bool) -> list[str]:
        """The command line the launcher runs on `node` (as given, never through a shell)."""
        raise NotImplementedError

    def helpers(self) -> dict[str, str]:
        """Files of ours written beside launcher.py at every start and resume (name -> text)."""
        return {}

    # ------------------------------------------------------------ reading it

    def progress(self, view: RunView) -> Progress:
        """How far it is (status's STEP and ETA columns, its JSON's "progress")."""
        return view.step_progress()

    def details(self, view: RunView) -> list[tuple[str, str]]:
        """`status NAME`'s rows particular to the kind, after the shared ones."""
        return []

    def summary(self, view: RunView) -> dict[str, Any]:
        """Keys added to the job's JSON summary."""
        return {"kind": self.name, "progress": self.progress(view).doc()}

    # ------------------------------------------------------------ stop and resume

    def stopped(self, view: RunView) -> tuple[str, dict[str, Any]]:
        """After `stop`: where it stopped, as the line's words after its state (" at step 6;
        newest checkpoint step_6") and as keys of the JSON document."""
        return "", {}

    def check_resumable(self, view: RunView) -> None:
        """Refuse (one line, the contract's exit code) a job that cannot resume."""
        if view.where == self.archive:
            raise UsageError(
                f"{view.name} is archived ({view.target}:{view.dir}); it cannot resume"
            )
        if view.state == "abandoned":
            raise UsageError(f"{view.name} never started ({view.note}); launch it again")
        if view.queued:
            when = "it starts when the target frees" if view.state == "queued" else view.note
            raise UsageError(f"{view.name} is a launch queued on {view.target} that never "
                             f"started ({when}); `dflashops stop {view.name}` cancels it")  # fmt: skip
        if view.running or any(v.running for v in view.nodes):
            raise UsageError(f"{view.name} is {view.state} on {view.target}; nothing to resume")
        if view.multi and len(view.nodes) < len(view.node_targets):
            raise UsageError(f"{view.name}: {view.note}; every node must be readable to resume")

    def resume_note(self, view: RunView) -> str:
        """The line said as it resumes."""
        return f"{view.name}: resuming"
