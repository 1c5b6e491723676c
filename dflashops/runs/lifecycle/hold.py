"""Who holds a run while a launch or resume makes it ready (state.json's "hold"), and whether
that holder is gone: a launch killed, its terminal closed, or its connection dropped between its
claim and the launcher's start leaves the run at `claiming`/`launching` with nothing running.

The holder is an operator process: its machine (boot id and pid namespace), pid and start
time, and a lease ("until", on the target's clock, set there). It is gone at once when it ran
on this machine and its process is not there any more, else when its lease has passed."""

from __future__ import annotations

import os
import secrets as random_tokens
import socket
from typing import Any

from dflashops.remote.shared import machine_id, proc_start

LEASE_S = 300.0  # a launch's claim, snapshot and files take seconds; a lease covers minutes
LEASE_ENV = "DFLASHOPS_LEASE_S"  # another lease (seconds), e.g. a test's; renewed at a third of it


def lease_s() -> float:
    try:
        return float(os.environ.get(LEASE_ENV) or LEASE_S)
    except ValueError:
        return LEASE_S


HELD = ("claiming", "launching")


def mine(verb: str) -> dict[str, Any]:
    """The hold of this operator process, for a `verb` ("launch", "resume")."""
    pid = os.getpid()
    return {"verb": verb, "host": socket.gethostname(), "machine": machine_id(), "pid": pid,
            "start": proc_start(pid), "token": random_tokens.token_hex(8),
            "lease_s": lease_s()}  # fmt: skip


def is_mine(hold: dict[str, Any]) -> bool:
    """The hold of this very process (which knows how far it got: past its launcher's start,
    a launch with nothing running has failed)."""
    return hold.get("pid") == os.getpid() and hold.get("machine") == machine_id()


def gone(hold: dict[str, Any], now: float) -> str | None:
    """Why the holder is gone (None while it may still be at work); `now`: the target's clock."""
    if is_mine(hold):
        return None
    until = hold.get("until")
    where = f"{hold.get('verb', 'launch')} by pid {hold.get('pid')} on {hold.get('host')}"
    here = machine_id()
    if here and hold.get("machine") == here:
        start = proc_start(hold["pid"]) if isinstance(hold.get("pid"), int) else None
        if start is None or start != hold.get("start"):
            return f"its {where} was interrupted (that process is gone)"
    if isinstance(until, (int, float)) and now > until:
        return f"its {where} was interrupted (no word from it for {hold.get('lease_s') or LEASE_S:.0f} s)"
    return None


def abandoned(raw: dict[str, Any], now: float) -> str | None:
    """Why a run directory is a launch or resume cut short before its launcher started (its
    state held, nothing of it running, no launcher record, its holder gone); else None."""
    state = raw.get("state") or {}
    if state.get("status") not in HELD or raw.get("node"):
        return None
    hold = state.get("hold")
    if isinstance(hold, dict):
        return gone(hold, now)
    launched = state.get("launched")  # a claim from before holds: only its age tells
    if state.get("status") != "claiming" or not isinstance(launched, (int, float)):
        return None
    if now - launched > LEASE_S:
        return f"its launch was interrupted (claimed {now - launched:.0f} s ago)"
    return None
