"""The client of remote/runctl.py: the few changes made to a run directory in its target
(claim, commit, publish, secrets, relaunch, signal, kill, archive, remove)."""

from __future__ import annotations

import json
from typing import Any

from dflashops.errors import OpsError
from dflashops.remote import argv as helper_argv
from dflashops.targets.base import Machine


def control(machine: Machine, action: str, run_path: str, **request: Any) -> dict[str, Any]:
    """One change to a run directory through remote/runctl.py (printed only under --dry-run)."""
    argv = helper_argv("runctl.py", action, run_path)
    result = machine.run(argv, stdin=json.dumps(request).encode())
    if machine.dry_run:
        return {}
    if not result.ok:
        raise OpsError(f"{machine.name}: {action} {run_path} failed: {result.error_text}")
    return json.loads(result.stdout)
