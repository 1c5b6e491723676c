"""A training run's launch (the first kind of job, runs/training/kind.py): one read of every target first (the name free everywhere, the chosen
targets not busy, their GPUs), then the name claimed on each node, the workload snapshot, the
run directory (run.yaml, launch.json, launcher.py), the memory plan checked on node 0, and the
launcher started on each node; then the wait for the trainer's first sign of life and, over
several nodes, one line on whether they pay (the step time against one node's, at the link the
trainer measured). A launch that fails takes back what it made."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dflashops import context
from dflashops.errors import OpsError, UnreachableError, UsageError
from dflashops.inventory import Target
from dflashops.remote import layout
from dflashops.render import human_bytes
from dflashops.runs.lifecycle.choose import (
    PassedOver,
    busy_reason,
    holders,
    sort_out,
    unread_reason,
)
from dflashops.runs.lifecycle.claim import sweep_abandoned, take_back, taken_error, warn_unread
from dflashops.runs.lifecycle.placement import Node, Placement, place
from dflashops.runs.lifecycle.queue import queue_order
from dflashops.runs.lifecycle.rehearse import local_plan
from dflashops.runs.lifecycle.snapshot import Code, local_code
from dflashops.runs.lifecycle.start import NotRead, Started, start_job, wait_for_life
from dflashops.runs.reading.probe import Probe, probe
from dflashops.runs.reading.survey import reread
from dflashops.runs.reading.view import RunView, group
from dflashops.runs.training.kind import TRAINING
from dflashops.ssh.session import Session


@dataclass
class Launched:
    """What a launch made: where it runs, and the run as it started (None under --dry-run)."""

    placement: Placement
    view: RunView | None


def launch(
    reader: Session,
    writer: Session,
    run: str,
    targets: list[Target],
    config_text: str,
    values: dict[str, str],
    *,
    skip: set[str],
    force: bool,
    nproc: int | None,
    wait: float,
    target_config: str | None = None,
    role: str | None = None,
    verbose: bool = False,
    state: dict[str, Any] | None = None,
    queue: bool = False,
) -> Launched:
    """Start run `run` on `targets` with run.yaml `config_text` and secrets `values`; with
    `role` (`--host any:ROLE`), on the first of `targets` that is free and fits; with `queue`,
    where none is, queued for one of them (runs/lifecycle/queue.py)."""
    code = local_code()
    text = f"{config_text.rstrip()}\n# workload snapshot {code.digest}\n"
    if role is None:
        seen = preflight(reader, run, targets, code, skip=skip, force=force, nproc=nproc,
                         queue=queue)  # fmt: skip
        try:
            made = begin(reader, writer, seen, text, code, values, force=force,
                         target_config=target_config, state=state)  # fmt: skip
        except PassedOver as exc:  # another launch took the free target at the same moment
            if not queue or seen.queued is not None or not exc.busy:
                raise
            seen.abandoned, seen.queued = [], exc.why
            made = begin(reader, writer, seen, text, code, values, force=force, state=state)
    else:
        seen, made = begin_anywhere(reader, writer, run, targets, text, code, values, role=role,
                                    nproc=nproc, verbose=verbose, state=state,
                                    skip=skip, queue=queue)  # fmt: skip
    return finish(reader, writer, seen, made, wait=wait)


def begin(
    reader: Session,
    writer: Session,
    seen: Preflight,
    text: str,
    code: Code,
    values: dict[str, str],
    *,
    force: bool,
    target_config: str | None = None,
    state: dict[str, Any] | None = None,
) -> Started:
    """Claimed, prepared, the plan checked and the launcher started (or, under --dry-run,
    only said); what follows the launcher's start is `finish`'s."""
    placement = seen.placement
    placement.exclusive = not force and seen.queued is None
    placement.state.update(state or {})
    if not writer.dry_run:
        sweep_abandoned(writer, seen.abandoned)
    context.note(f"{placement.run}: {placement.describe()}")
    if writer.dry_run:
        show_plan(reader, placement, seen, text, code, force=True, target_config=target_config)
    return start_job(
        reader, writer, placement, code, seen.have_code, {layout.RUN_CONFIG: text}, values,
        check=lambda: seen.planned.extend(check_plan(writer, placement, seen, code, force=force)),
        queued=seen.queued,
    )  # fmt: skip


def finish(
    reader: Session, writer: Session, seen: Preflight, made: Started, *, wait: float
) -> Launched:
    """The wait for the trainer's first sign of life (a failure takes the launch back)."""
    placement = seen.placement
    if writer.dry_run:
        context.note("dry run: nothing was changed")
        return Launched(placement, None)
    if seen.queued is not None:
        view = reread(reader.machine(placement.nodes[0].target), placement.run, records="none")
        if view.state in ("failed", "unknown"):
            raise OpsError(f"{placement.run}: queued, but its waiter did not stay ({view.note}); "
                           f"`dflashops logs {placement.run}` shows why, `dflashops stop "
                           f"{placement.run}` removes it")  # fmt: skip
        return Launched(placement, view)
    try:
        view = wait_for_life(reader, placement, timeout=wait)
    except NotRead:  # not its failure: it may run
        raise
    except OpsError:
        context.note(f"{placement.run}: the launch failed; taking back its run directory")
        take_back(writer, placement, placement.nodes, made.secrets)
        raise
    say_verdict(placement, started_plan(reader, placement) or next(iter(seen.planned), None))
    return Launched(placement, view)


def begin_anywhere(
    reader: Session,
    writer: Session,
    run: str,
    targets: list[Target],
    text: str,
    code: Code,
    values: dict[str, str],
    *,
    role: str,
    nproc: int | None,
    verbose: bool,
    state: dict[str, Any] | None = None,
    skip: frozenset[str] | set[str] = frozenset(),
    queue: bool = False,
) -> tuple[Preflight, Started]:
    """`begin` on the first of `targets` (those of `role`) that is free and fits, else, with
    `queue`, queued for a busy one (`queue_order`); each one passed over is said with its
    reason (all of them when none is left, or with -v)."""
    answers = read_targets(reader, run, targets, code)
    probes = {n: a for n, a in answers.items() if isinstance(a, Probe)}
    unread = {n: e for n, e in answers.items() if isinstance(e, OpsError)}
    quiet = {t.name for t in targets} | set(skip)  # the role's: said with their reason
    warn_unread(run, {n: e for n, e in unread.items() if n not in quiet})
    cut = name_free(run, probes)
    choice = sort_out(role, targets, answers)

    def attempt(target: Target, queued: str | None) -> tuple[Preflight, Started] | None:
        nonlocal cut
        seen = decide(run, [target], probes, cut, nproc=nproc)
        cut = []  # swept by the first try
        seen.queued = queued
        try:
            return seen, begin(reader, writer, seen, text, code, values, force=False, state=state)
        except PassedOver as exc:
            choice.pass_over(target.name, exc.why, held_by=exc.why if exc.busy else None)
        except UnreachableError as exc:
            choice.pass_over(target.name, unread_reason(exc))
        return None

    for target in choice.free:
        if (done := attempt(target, None)) is None:
            continue
        if writer.dry_run:
            context.note(f"{run}: --host any:{role}: no target is read under --dry-run; "
                         f"rehearsed on the first of the role, {target.name}")  # fmt: skip
        else:
            choice.say(run, target, verbose=verbose)
        return done
    for target in queue_order(choice, targets, probes) if queue and not writer.dry_run else []:
        if (done := attempt(target, choice.busy[target.name])) is not None:
            choice.say(run, None, verbose=verbose)
            return done
    choice.say(run, None, verbose=True)
    raise choice.nothing_free(run)


# ---------------------------------------------------------------- before anything is made


class Preflight:
    """What one read of the targets said: where the run goes and what each target has."""

    def __init__(
        self, placement: Placement, probes: dict[str, Probe], abandoned: list[RunView]
    ) -> None:
        self.placement = placement
        self.probes = probes
        self.abandoned = abandoned  # launches of this name cut short: swept before the claim
        self.planned: list[dict[str, Any]] = []  # the memory plan, once checked
        self.queued: str | None = None  # why its target is busy, when it waits there (--queue)

    def have_code(self, target: Target, code: Code) -> bool:
        return self.probes[target.name].paths.get(code.path(target)) == "dir"

    def gpus(self, target: Target) -> dict[str, Any] | None:
        return self.probes[target.name].gpus

    def gpu_memory_mib(self) -> int | None:
        """The smallest GPU of the run's nodes (what the plan must fit), None without GPUs."""
        sizes = []
        for node in self.placement.nodes:
            found = self.gpus(node.target) or {}
            sizes += [g.get("memory_total_mib") for g in found.get("gpus") or []]
        sizes = [s for s in sizes if isinstance(s, int)]
        return min(sizes) if sizes else None


def read_targets(
    reader: Session, run: str, targets: list[Target], code: Code, *, port_on: Target | None = None
) -> dict[str, Probe | OpsError]:
    """Every target read once, in parallel: the name must be free everywhere; `targets` are
    read whole (their runs, GPUs, the code snapshot; a free rendezvous port on `port_on`)."""
    chosen = {t.name for t in targets}
    everyone = list(reader.inventory.targets.values())

    def read(target: Target) -> Probe:
        request: dict[str, Any] = {"names": [run], "archive": True, "records": "none"}
        if target.name in chosen:
            request.update(names=None, gpus=True, paths=[code.path(target)], records="recent")
            if port_on is not None and target.name == port_on.name:
                request["free_port"] = target.node_address
        return probe(reader.machine(target), **request)

    return dict(zip([t.name for t in everyone], reader.each(read, everyone), strict=True))


def name_free(run: str, probes: dict[str, Probe]) -> list[RunView]:
    """Refuse a name in use anywhere read; the launches of it cut short (swept later)."""
    places = [v for p in probes.values() for v in group(p.runs) if v.name == run]
    if [v for v in places if v.state != "abandoned"]:
        raise taken_error(run, [v for v in places if v.state != "abandoned"])
    return [v for v in places if v.state == "abandoned"]


def preflight(
    reader: Session,
    run: str,
    targets: list[Target],
    code: Code,
    *,
    skip: set[str],
    force: bool,
    nproc: int | None,
    queue: bool = False,
) -> Preflight:
    """Every target read once (`read_targets`): the name free everywhere, the chosen targets
    read whole and not busy (with `queue`, one busy target is waited for)."""
    chosen = {t.name for t in targets}
    ordered = order_nodes(targets)
    port_on = ordered[0] if len(targets) > 1 else None
    answers = read_targets(reader, run, targets, code, port_on=port_on)
    for name in chosen:
        if isinstance(answers[name], OpsError):
            raise answers[name]
    unread = {n: e for n, e in answers.items() if isinstance(e, OpsError) and n not in skip}
    warn_unread(run, unread)
    probes = {n: a for n, a in answers.items() if isinstance(a, Probe)}
    cut = name_free(run, probes)
    busy = None
    for target in targets:
        if queue and not force:
            busy = busy_reason(probes[target.name])
        if busy is None:
            check_free(target, probes[target.name], force=force)
    seen = decide(run, targets, probes, cut, nproc=nproc)
    seen.queued = busy
    if [t.name for t in ordered] != [t.name for t in targets]:
        context.note(
            f"{run}: rank 0 (the log and checkpoints) runs on {ordered[0].name}: torchrun's "
            "rendezvous orders the nodes by address"
        )
    return seen


def decide(
    run: str,
    targets: list[Target],
    probes: dict[str, Probe],
    cut: list[RunView],
    *,
    nproc: int | None,
) -> Preflight:
    """The run's placement on `targets` from what the read found there."""
    ordered = order_nodes(targets)
    reported = {t.name: gpu_count(probes[t.name]) for t in targets}
    placement = place(TRAINING, run, ordered, nproc=nproc, reported=reported)
    placement.port = probes[ordered[0].name].free_port
    return Preflight(placement, probes, cut)


def order_nodes(targets: list[Target]) -> list[Target]:
    """Node order = torchrun's group rank order: its c10d rendezvous sorts nodes by their
    address (as text), so the node with the first address holds rank 0."""
    if len(targets) == 1:
        return list(targets)
    return sorted(targets, key=lambda t: str(t.node_address or ""))


def gpu_count(probe: Probe) -> int | None:
    found = probe.gpus or {}
    return len(found.get("gpus") or []) or None


def check_free(target: Target, probe: Probe, *, force: bool) -> None:
    """A target whose GPUs another run (or any process nvidia-smi shows) holds is refused."""
    why = busy_reason(probe)
    if why is None:
        return
    if holders(probe):
        why += "; stop it first"
    if force:
        context.note(f"warning: {target.name}: {why} (--force: launching anyway)")
        return
    raise UsageError(f"{target.name} is busy: {why}, or pass --force")


# ---------------------------------------------------------------- the memory plan


def plan_argv(
    placement: Placement, node: Node, seen: Preflight, *, offline: bool = False
) -> list[str]:
    """workload.plan for the run's nodes: their ranks, the smallest GPU's memory and the first
    GPU's name (the step time's peak), as nvidia-smi showed them, else as the inventory says
    when `offline` (a rehearsal reads no target), or the CPU."""
    gpu_mib = seen.gpu_memory_mib()
    names = [g.get("name") for g in (seen.gpus(node.target) or {}).get("gpus") or []]
    name = names[0] if names and isinstance(names[0], str) else None
    on_gpus = bool(gpu_mib)
    if offline and not gpu_mib:
        gpu_mib, name = declared_gpus(placement)
        on_gpus = all(n.target.gpus for n in placement.nodes)
    argv = [node.target.python, "-m", "workload.plan", "--config", layout.RUN_CONFIG]
    argv += ["--nproc", str(node.nproc), "--nnodes", str(len(placement.nodes))]
    argv += ["--device", "cuda" if on_gpus else "cpu", "--json"]
    if gpu_mib:
        argv += ["--gpu-memory-gib", f"{gpu_mib / 1024:.6f}"]
    if name:
        argv += ["--gpu-name", name]
    if not on_gpus:
        argv += ["--gpu", "cpu"]  # as the trainer plans a CPU run
    return argv


def declared_gpus(placement: Placement) -> tuple[int | None, str | None]:
    """(the smallest GPU memory in MiB, the first GPU model) that the inventory says the run's
    nodes have; (None, None) unless every node says its GPUs' memory."""
    said = [n.target for n in placement.nodes]
    if not all(t.gpus and t.gpu_memory_gib for t in said):
        return None, None
    return int(min(t.gpu_memory_gib for t in said) * 1024), said[0].gpu_model


def run_plan(
    machine: Any, placement: Placement, seen: Preflight, code_dir: str, cwd: str
) -> dict[str, Any] | None:
    """The memory plan per rank (workload.plan in the target, configs on the meta device, no
    weights read), or None when that workload has no plan (an older snapshot)."""
    node = placement.nodes[0]
    argv = plan_argv(placement, node, seen, offline=machine.dry_run)
    result = machine.run(argv, env={"PYTHONPATH": code_dir}, cwd=cwd)
    if machine.dry_run:
        return None
    if result.returncode == 2:
        raise UsageError(f"{placement.run}: {result.error_text.removeprefix('error: ')}")
    if result.returncode == 127:
        raise OpsError(
            f"{placement.run}: {node.target.python} not found on {node.target.name}; "
            f"run `dflashops setup {node.target.name}` first"
        )
    if not result.ok:
        if b"No module named workload.plan" in result.stderr:
            return None
        raise OpsError(f"{node.target.name}: the memory plan failed: {result.error_text}")
    try:
        return json.loads(result.stdout)
    except ValueError:
        raise OpsError(f"{node.target.name}: the memory plan printed no JSON") from None


def plan_lines(plan: dict[str, Any]) -> list[str]:
    per = plan.get("per_rank") or {}
    order = ("target_weights", "drafter_params", "gradients", "optimizer", "activations",
             "overhead")  # fmt: skip
    parts = [
        f"{k.replace('_', ' ')} {human_bytes(per[k])}" for k in order if per.get(k) is not None
    ]
    total = per.get("total")
    room = plan.get("gpu_memory")
    cpu = "on CPU: no GPU memory to fit" if plan.get("device") == "cpu" else (
        "fits: not known (the inventory does not say the GPUs' memory: set gpu_model and "
        "gpu_memory_gib on the target; `dflashops hosts` shows them)")  # fmt: skip
    fits = {True: "fits", False: "DOES NOT FIT", None: cpu}[plan.get("fits")]
    head = f"memory plan per rank ({plan.get('world')} ranks, sharding {plan.get('sharding')}): "
    head += f"{human_bytes(total)}" + (f" of {human_bytes(room)}" if room else "") + f": {fits}"
    lines = [head, "  " + ", ".join(parts)]
    step = step_line(plan)
    return lines + ([step] if step else []) + [f"  {n}" for n in plan.get("notes") or []]


def step_line(plan: dict[str, Any]) -> str | None:
    """The planned step time on the GPUs planned for (none on the CPU: not a figure to use)."""
    t = plan.get("step_time") or {}
    if not plan.get("gpu_memory") or not isinstance(t.get("step_s"), (int, float)):
        return None
    where = f"{plan.get('world')} x {t.get('gpu')} at {t.get('mfu', 0):.0%} of its bf16 peak"
    return (f"  step time {t['step_s']:.3g} s (compute {t.get('compute_s', 0):.3g} s, "
            f"communication {t.get('comm_s', 0):.3g} s; {where}: an estimate)")  # fmt: skip


def scale_verdict(plan: dict[str, Any]) -> str | None:
    """One line from the plan's step time over several nodes (workload/step_plan.verdict
    words the same): the step against one node's for the same rows, at which link, and the
    grad_accum that makes the other nodes pay. None on one node (or from an older plan)."""
    t = plan.get("step_time") or {}
    keys = ("step_s", "one_node_s", "link_gbps", "pays")
    if any(not isinstance(t.get(k), (int, float)) for k in keys):
        return None
    nodes, accum = plan.get("nnodes") or 2, t.get("grad_accum") or 1
    link = "measured between the nodes" if t.get("link_measured") else (
        "assumed; the trainer measures the link at start")  # fmt: skip
    head = (f"{nodes} nodes: {t['step_s']:.3g} s/step against {t['one_node_s']:.3g} s on one "
            f"node (grad_accum {accum * nodes}, the same rows) at {t['link_gbps']:.1f} Gb/s "
            f"({link})")  # fmt: skip
    if t["pays"]:
        return f"{head}: faster"
    pay = t.get("accum_to_pay")
    fix = (f"grad_accum {pay} makes it pay (--set optim.grad_accum={pay})" if pay
           else "no grad_accum up to 256 makes it pay: train on one node")  # fmt: skip
    return f"{head}: slower; {fix}"


def say_verdict(placement: Placement, plan: dict[str, Any] | None) -> None:
    line = None if plan is None else scale_verdict(plan)
    if line is not None:
        warn = "" if plan["step_time"]["pays"] else "warning: "
        context.note(f"{warn}{placement.run}: {line}")


def started_plan(reader: Session, placement: Placement) -> dict[str, Any] | None:
    """plan.json as the trainer wrote it at start (with the link it measured between the
    nodes), from node 0; None on one node, or when it is not there or not read."""
    if len(placement.nodes) < 2:
        return None
    try:
        view = reread(reader.machine(placement.nodes[0].target), placement.run,
                      records="none", files=[layout.PLAN_FILE])  # fmt: skip
        return json.loads((view.raw.get("files") or {}).get(layout.PLAN_FILE) or "null")
    except (OpsError, ValueError):
        return None


def check_plan(
    writer: Session, placement: Placement, seen: Preflight, code: Code, *, force: bool
) -> list[dict[str, Any]]:
    """The memory plan said and checked (UsageError if it does not fit, unless `force`);
    the plan, or nothing without one."""
    node = placement.nodes[0]
    machine = writer.machine(node.target)
    plan = run_plan(machine, placement, seen, code.path(node.target), placement.dir(node))
    if plan is None:
        return []
    for line in plan_lines(plan):
        context.note(f"{placement.run}: {line}" if not line.startswith(" ") else line)
    if plan.get("fits") is False:
        per = plan.get("per_rank") or {}
        notes = " ".join(plan.get("notes") or [])
        advice = ["set dist.sharding: zero1"] if plan.get("sharding") == "none" else []
        if "activation_checkpointing: true would" in notes:
            advice.append("set drafter.activation_checkpointing: true")
        advice += ["shorten data.max_length or data.num_anchors", "use more GPUs"]
        message = (
            f"{placement.run}: the memory plan needs {human_bytes(per.get('total'))} per rank, "
            f"the GPUs of {', '.join(n.target.name for n in placement.nodes)} have "
            f"{human_bytes(plan.get('gpu_memory'))}; {', '.join(advice)}, or pass --force"
        )
        if not force:
            need = f"plan needs {human_bytes(per.get('total'))} per rank"
            raise PassedOver(message, f"{need} of {human_bytes(plan.get('gpu_memory'))}")
        context.note(f"warning: {message} (--force: launching anyway)")
    check_parity(placement.run, plan.get("parity") or [], force=force)
    return [plan]


def check_parity(run: str, mismatches: list[str], *, force: bool) -> None:
    """Train-to-serve parity as the plan found it (workload.parity): each mismatch one line,
    a refusal unless `force`."""
    if not mismatches:
        return
    lines = [f"{run}: parity: {line}" for line in mismatches]
    if not force:
        raise UsageError("\n".join([*lines, f"{run}: fix the config, or pass --force"]))
    for line in lines:
        context.note(f"warning: {line} (--force: launching anyway)")


def show_plan(
    reader: Session,
    placement: Placement,
    seen: Preflight,
    text: str,
    code: Code,
    *,
    force: bool,
    target_config: str | None = None,
) -> None:
    """Under --dry-run: the memory plan from the snapshot already in node 0 (nothing is sent)."""
    node = placement.nodes[0]
    machine = reader.machine(node.target)
    if machine.dry_run and target_config:  # an offline reader: the plan computed here
        argv = plan_argv(placement, node, seen, offline=True)
        plan = local_plan(placement.run, text, argv, target_config)
        if plan is not None:
            for line in plan_lines(plan):
                context.note(f"{placement.run}: {line}" if not line.startswith(" ") else line)
            say_verdict(placement, plan)
        return
    if machine.dry_run:  # an offline reader: the plan needs node 0's target config.json
        context.note(
            f"{placement.run}: memory plan: not computed under --dry-run (it reads the target "
            f"model's config.json on {node.target.name}; give a copy: --target-config PATH)"
        )
        return
    if not seen.have_code(node.target, code):
        context.note(
            f"{placement.run}: memory plan: not shown (the workload snapshot is not on "
            f"{node.target.name} yet; a real launch sends it and prints the plan first)"
        )
        return
    argv = plan_argv(placement, node, seen)
    argv[argv.index(layout.RUN_CONFIG)] = "/dev/stdin"
    result = machine.run(argv, env={"PYTHONPATH": code.path(node.target)}, stdin=text.encode())
    if result.ok:
        plan = json.loads(result.stdout)
        for line in plan_lines(plan):
            context.note(f"{placement.run}: {line}" if not line.startswith(" ") else line)
        say_verdict(placement, plan)
    else:
        context.note(f"{placement.run}: memory plan: {result.error_text}")
