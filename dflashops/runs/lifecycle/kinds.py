"""Every kind of job, and the kind of a job read from a target (by the home it lives in)."""

from __future__ import annotations

from typing import Any

from dflashops.runs.datagen.kind import DATAGEN
from dflashops.runs.evaluation.continuous_kind import FOLLOW
from dflashops.runs.evaluation.kind import EVAL
from dflashops.runs.lifecycle.job_kind import JobKind
from dflashops.runs.training.kind import TRAINING

KINDS: tuple[JobKind, ...] = (TRAINING, EVAL, FOLLOW, DATAGEN)
LISTED = tuple(k for k in KINDS if k.listed)


def by_where(where: str) -> JobKind:
    """The kind whose jobs live in `where` (its home, or its archive)."""
    for kind in KINDS:
        if where in (kind.home, kind.archive):
            return kind
    raise KeyError(where)


def homes(*, every: bool) -> dict[str, dict[str, Any]]:
    """The probe's "homes": where the kinds' jobs live ({where: {"pattern", "name", "files",
    "archive"}}), of every kind (a lookup by name) or of those `status` lists."""
    out: dict[str, dict[str, Any]] = {}
    for kind in KINDS if every else LISTED:
        files = list(kind.files)
        out[kind.home] = {"pattern": kind.parents, "name": kind.template, "files": files}
        if kind.archive:
            out[kind.archive] = {"pattern": kind.archive, "files": files, "archive": True}
    return out


def listed_names(names: dict[str, list[str]]) -> list[str]:
    """The names a probe found in the homes of kinds that `status` lists (and their archives)."""
    wanted = {w for k in LISTED for w in (k.home, k.archive) if w}
    return [n for where, found in names.items() if where in wanted for n in found]
