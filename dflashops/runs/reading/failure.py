"""Why a job failed, as its console says: the trainer's last lines without torchrun's own
report, and the first rank that failed (torchrun's "Root Cause")."""

from __future__ import annotations

import re
import signal

from dflashops.errors import OpsError, UsageError
from dflashops.inventory import Target
from dflashops.runs.reading.view import RunView, end_time

AGENT_NOISE = ("*****", "Setting OMP_NUM_THREADS", "[dflashops]")


ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def console_text(view: RunView) -> str:
    return (view.raw.get("console") or {}).get("tail") or ""


def trainer_lines(view: RunView) -> list[str]:
    """The console's last lines as the trainer wrote them: without torchrun's own report of
    a failure (its traceback and summary follow the trainer's output) and our own lines."""
    text = console_text(view)
    agent = text.rfind("Traceback (most recent call last):")
    if agent >= 0 and "ChildFailedError" in text[agent:]:
        text = text[:agent]
    lines = [line.rstrip() for line in text.splitlines()]
    return [ln for ln in lines if ln.strip() and not any(ln.lstrip().startswith(n) or n in ln
                                                         for n in AGENT_NOISE)]  # fmt: skip


def root_cause(view: RunView) -> tuple[int, int] | None:
    """(rank, exit code) of the first rank that failed, from torchrun's report in the
    console; None when there is none. A rank killed by signal N shows as -N."""
    found = ROOT_CAUSE.findall(console_text(view))
    if not found:
        return None
    rank, code = found[-1]
    return int(rank), int(code)


def cause_note(rank: int, code: int) -> str:
    if code < 0:
        try:
            return f"rank {rank} killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"rank {rank} killed by signal {-code}"
    return f"rank {rank} exit code {code}"


def trainer_failure(view: RunView, target: Target) -> OpsError:
    """The program's early exit (the trainer's, another kind's) as our error: its config refusal
    (exit 2) becomes our exit 2."""
    program = view.kind.program if view.kind is not None else "trainer"
    failed = [v for v in view.nodes if v.state == "failed"]
    if failed:
        view = min(failed, key=end_time)
    cause = root_cause(view)
    code = cause[1] if cause else view.exit_code
    lines = trainer_lines(view)
    if code == 2:
        refusals = [line for line in lines if line.startswith("error: ")]
        message = (refusals or lines or ["(no message)"])[-1].removeprefix("error: ")
        return UsageError(f"{view.name}: the {program} refused to start: {message}")
    if code == 127:
        return OpsError(
            f"{view.name}: {target.python} not found on {target.name}; "
            f"run `dflashops setup {target.name}` first"
        )
    why = view.note or f"exit code {code}"
    last = lines[-1] if lines else "no output"
    return OpsError(f"{view.name}: the {program} failed ({why}): {last}")
