"""The code a job executes: the workload (and templates) as shipped, named by its digest, sent
once to <ws>/dflashops/code/<digest>/ in a target and never changed afterwards."""

from __future__ import annotations

import hashlib
import posixpath
import secrets as random_tokens
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dflashops import bundle, context, transfer
from dflashops.errors import OpsError
from dflashops.inventory import Target
from dflashops.runs.lifecycle.control import control
from dflashops.targets.base import Machine

CODE_HOME = "code"  # <ws>/dflashops/code/<digest>/: immutable workload snapshots


@dataclass
class Code:
    """The workload (and templates) as shipped: its entries and their digest."""

    digest: str
    entries: list[transfer.Entry]

    def path(self, target: Target) -> str:
        return posixpath.join(target.workspace, bundle.REMOTE_HOME, CODE_HOME, self.digest)


def local_code() -> Code:
    entries: list[transfer.Entry] = []
    for name, local in (("workload", bundle.workload_dir()), ("templates", bundle.templates_dir())):
        if not local.is_dir():
            continue
        entries.append(transfer.Entry(name, local, "d", mode=0o755))
        for entry in transfer.scan(local):
            if bundle.shipped(entry.rel):
                entry.rel = f"{name}/{entry.rel}"
                entries.append(entry)
    digest = hashlib.sha256()
    for entry in entries:
        digest.update(f"{entry.rel}\0{entry.kind}\0{entry.mode & 0o111}\0".encode())
        if entry.kind == "f":
            digest.update(hashlib.sha256(entry.path.read_bytes()).digest())
        elif entry.kind == "l":
            digest.update(entry.link.encode())
    return Code(digest.hexdigest()[:16], entries)


def ensure_code(machine: Machine, code: Code, have: bool) -> str:
    """The snapshot directory of `code` in the target, sent there first unless `have`.
    Written once under a temporary name and renamed into place: never changed afterwards, so
    a later launch never rewrites the code under a run that is still training."""
    final = code.path(machine.target)
    if have:
        return final
    tmp = f"{final}.tmp-{random_tokens.token_hex(4)}"
    context.note(f"{machine.name}: sending the workload (snapshot {code.digest})")
    try:
        transfer.put(machine, Path(tempfile.gettempdir()), tmp, entries=code.entries)
    except OpsError:
        control(machine, "discard", tmp)
        raise
    control(machine, "publish", final, **{"from": tmp})
    return final
