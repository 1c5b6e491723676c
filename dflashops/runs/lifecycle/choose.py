"""Choosing where a run goes (`launch RUN --host any[:ROLE]`): the inventory's targets of the
role, each read once; a target is free when it answers, no run of ours holds it (claiming,
starting or running) and nvidia-smi shows no process on its GPUs. The free ones are tried in
the inventory's order; one whose memory plan does not fit, or that another launch takes at the
same moment (the claim's settle, runs/lifecycle/claim.py), is passed over for the next."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflashops import context
from dflashops.errors import OpsError, UsageError
from dflashops.inventory import ROLES, Inventory, Target
from dflashops.runs.reading.probe import Probe, probe
from dflashops.runs.reading.view import RunView, group
from dflashops.ssh.session import Session

ANY = "any"
STOPPED = "is stopped"  # pct's refusal of a stopped container (targets/pct.py)


class PassedOver(UsageError):
    """A target the launch could not take: `why` says it in a few words; `busy`: another run
    holds it (a queued launch may wait for it), not that it cannot take the run at all."""

    def __init__(self, message: str, why: str, *, busy: bool = False) -> None:
        super().__init__(message)
        self.why = why
        self.busy = busy


def wanted_role(host: str) -> str | None:
    """The role asked for by `--host any[:ROLE]` (`any` alone: train), None for target names."""
    if host != ANY and not host.startswith(f"{ANY}:"):
        return None
    role = host.partition(":")[2] or "train"
    if role not in ROLES:
        raise UsageError(f"--host {host}: {role!r} is not a role ({', '.join(ROLES)})")
    return role


def of_role(inventory: Inventory, role: str) -> list[Target]:
    """The inventory's targets of `role`, in its order."""
    found = [t for t in inventory.targets.values() if role in t.role]
    if not found:
        raise UsageError(f"--host any:{role}: no target of the inventory has role {role}")
    return found


def holders(probe: Probe) -> list[RunView]:
    """The runs of ours that hold a target: claiming, starting or running there, or queued for
    it (`launch --queue`: a queued launch goes first), the running ones first."""
    held = [v for v in group(probe.runs) if v.running or v.state == "queued"]
    return sorted(held, key=lambda v: not v.running)


def busy_reason(probe: Probe) -> str | None:
    """Why a target's GPUs (its CPU, without GPUs) are not free, None when they are."""
    held = holders(probe)
    apps = (probe.gpus or {}).get("apps") or []
    queued = [v.name for v in held if v.state == "queued"]
    waiting = f"{len(queued)} launch(es) queued for it ({', '.join(queued)})" if queued else ""
    if held and held[0].running:
        v = held[0]
        step = f", step {v.step}" if v.step is not None else ""
        on_gpus = bool((probe.gpus or {}).get("gpus"))
        uses = "holds its GPUs" if on_gpus else "runs on its CPU (no GPUs there)"
        return f"run {v.name} ({v.state}{step}) {uses}" + (f"; {waiting}" if waiting else "")
    if apps:
        shown = ", ".join(
            f"pid {a.get('pid')} {a.get('name')} on GPU {a.get('gpu')} ({a.get('used_mib')} MiB)"
            for a in apps[:4]
        )
        return f"nvidia-smi shows its GPUs in use: {shown}" + (f"; {waiting}" if waiting else "")
    return waiting or None


def refuse_held(reader: Session, run: str, targets: list[Target], *, force: bool) -> None:
    """A resume or move of `run` onto targets another run of ours holds (running, starting,
    or queued for them: a queued launch goes first) is refused, unless `force` (then warned
    of); a process nvidia-smi shows there is warned of (it may be the user's own)."""
    for target in targets:
        found = probe(reader.machine(target), names=None, gpus=True, records="none")
        others = [v for v in holders(found) if v.name != run]
        if others:
            v = others[0]
            what = "is queued for it" if v.state == "queued" else f"is {v.state} there"
            if force:
                context.note(f"warning: {target.name}: run {v.name} {what} (--force: resuming "
                             "anyway)")  # fmt: skip
                continue
            raise UsageError(f"{target.name} is busy: run {v.name} {what}; resume {run} when it "
                             f"is free, or elsewhere (--host OTHER), or pass --force")  # fmt: skip
        apps = (found.gpus or {}).get("apps") or []
        if apps:
            shown = ", ".join(f"pid {a.get('pid')} {a.get('name')}" for a in apps[:4])
            context.note(f"warning: {target.name}: nvidia-smi shows its GPUs in use: {shown}")


def unread_reason(error: OpsError) -> str:
    return "stopped" if STOPPED in error.message else f"unreachable ({error.message})"


@dataclass
class Choice:
    """The targets of the role as one read found them: those to try, in order, and those
    passed over with the reason."""

    role: str
    free: list[Target] = field(default_factory=list)
    passed: dict[str, str] = field(default_factory=dict)
    busy: dict[str, str] = field(default_factory=dict)  # of those passed: held, and by what

    def pass_over(self, target: str, why: str, *, held_by: str | None = None) -> None:
        self.passed[target] = why
        self.busy.pop(target, None)
        if held_by is not None:
            self.busy[target] = held_by

    def say(self, run: str, chosen: Target | None, *, verbose: bool) -> None:
        if chosen is not None:
            context.note(f"{run}: --host any:{self.role}: chose {chosen.name}")
        if chosen is None or verbose:
            for name, why in self.passed.items():
                context.note(f"{run}: passed over {name}: {why}")

    def nothing_free(self, run: str) -> UsageError:
        shown = "; ".join(f"{n}: {w}" for n, w in self.passed.items())
        return UsageError(
            f"{run}: no target of role {self.role} is free ({shown}); stop a run, start a "
            "container, or name one with --host TARGET --force"
        )


def sort_out(role: str, targets: list[Target], answers: dict[str, Probe | OpsError]) -> Choice:
    """Each target of the role: free, or passed over with its reason."""
    choice = Choice(role)
    for target in targets:
        answer = answers[target.name]
        if isinstance(answer, OpsError):
            choice.pass_over(target.name, unread_reason(answer))
            continue
        why = busy_reason(answer)
        if why is None:
            choice.free.append(target)
        else:
            choice.pass_over(target.name, f"busy: {why}", held_by=why)
    return choice
