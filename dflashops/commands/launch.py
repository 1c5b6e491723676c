"""`launch RUN --host TARGET[,TARGET...] [--config FILE|TEMPLATE] [--set KEY=VALUE]...
[--nproc N] [--secret NAME]... [--force]`

One read of every target first (name free everywhere, chosen targets not busy, their GPUs),
then: the name claimed on each node, the workload snapshot, the run directory (run.yaml,
launch.json, launcher.py), the memory plan checked on node 0, and the launcher started in a
detached session of our own tmux server on each node; then it waits for the trainer's first
sign of life. A launch that fails takes back what it made.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import typer
import yaml

from dflashops import bundle, context, lifecycle, runs
from dflashops.errors import OpsError, UsageError
from dflashops.inventory import Target
from dflashops.lifecycle import Placement
from dflashops.render import human_bytes
from dflashops.ssh.session import Session
from dflashops.yamlfile import YamlFileError, load_located

FORCE_OPTION = typer.Option(
    False,
    "--force",
    help="Launch even where the GPUs are held (another run, a process nvidia-smi shows) or "
    "the memory plan does not fit.",
)


def register(app: typer.Typer) -> None:
    @app.command("launch")
    @context.command
    def launch(
        ctx: typer.Context,
        run: str = typer.Argument(
            ..., metavar="RUN", help="A new run name, unique across the inventory."
        ),
        host: str = typer.Option(
            ...,
            "--host",
            metavar="TARGET[,TARGET...]",
            help="The target(s) to train on; several make one run (one torchrun each, "
            "rank 0 on the target whose address sorts first).",
        ),
        config: str = typer.Option(
            None,
            "--config",
            metavar="FILE|TEMPLATE",
            help="A run config: a YAML file, or a template of templates/runs/.",
        ),
        sets: list[str] = typer.Option(
            None,
            "--set",
            metavar="KEY=VALUE",
            help="Override a config key (dotted, YAML-typed), e.g. --set optim.max_steps=500.",
        ),
        nproc: int = typer.Option(
            None,
            "--nproc",
            min=1,
            metavar="N",
            help="Processes per target (default: its gpus in the inventory, else the GPUs "
            "nvidia-smi shows there, else 1).",
        ),
        secrets: list[str] = lifecycle.SECRETS_OPTION,
        force: bool = FORCE_OPTION,
        skip_unreadable: str = typer.Option(
            None,
            "--skip-unreadable",
            metavar="TARGET[,TARGET...]",
            help="Targets not to warn about when they cannot be read (the name is checked "
            "where it can be).",
            hidden=True,
        ),
        follow: bool = lifecycle.FOLLOW_OPTION,
        wait: float = lifecycle.WAIT_OPTION,
        json_out: bool = lifecycle.JSON_OPTION,
    ) -> None:
        """Start a training run in a detached tmux session on one target or several."""
        opts = context.get(ctx)
        opts.want_json(json_out)
        runs.check_name(run)
        text = resolve_config(config, sets or [], run)
        values = lifecycle.secret_values(secrets or [])
        inventory = opts.inventory()
        targets = [inventory.target(name) for name in lifecycle.parse_hosts(host)]
        skip = set(lifecycle.parse_hosts(skip_unreadable)) if skip_unreadable else set()
        code = lifecycle.local_code()
        with runs.sessions(opts) as (reader, writer):
            seen = preflight(reader, run, targets, code, skip=skip, force=force, nproc=nproc)
            placement = seen.placement
            text = f"{text.rstrip()}\n# workload snapshot {code.digest}\n"
            context.note(f"{run}: {placement.describe()}")
            if opts.dry_run:
                show_plan(reader, placement, seen, text, code, force=True)
            else:
                lifecycle.claim(reader, writer, placement)
            made = lifecycle.Started(placement)
            try:
                lifecycle.prepare(writer, placement, code, seen.have_code, text, values, made)
                if not opts.dry_run:
                    check_plan(writer, placement, seen, code, force=force)
                lifecycle.start_all(writer, placement)
            except BaseException:
                if not opts.dry_run:
                    lifecycle.take_back(writer, placement, placement.nodes, made.secrets)
                raise
            if opts.dry_run:
                context.note("dry run: nothing was changed")
                runs.dry_run_done(opts, run=run, targets=[t.name for t in targets],
                                  nodes=placement.record())  # fmt: skip
                return
            try:
                view = lifecycle.wait_for_life(reader, placement, timeout=wait)
            except OpsError:
                context.note(f"{run}: the launch failed; taking back its run directory")
                lifecycle.take_back(writer, placement, placement.nodes, made.secrets)
                raise
            lifecycle.then_follow(opts, reader, view, follow)


# ---------------------------------------------------------------- before anything is made


class Preflight:
    """What one read of the targets said: where the run goes and what each target has."""

    def __init__(self, placement: Placement, probes: dict[str, runs.Probe]) -> None:
        self.placement = placement
        self.probes = probes

    def have_code(self, target: Target, code: lifecycle.Code) -> bool:
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


def preflight(
    reader: Session,
    run: str,
    targets: list[Target],
    code: lifecycle.Code,
    *,
    skip: set[str],
    force: bool,
    nproc: int | None,
) -> Preflight:
    """Every target read once, in parallel: the name must be free everywhere; the chosen
    targets are read whole (their runs, GPUs, the code snapshot, a free rendezvous port)."""
    chosen = {t.name for t in targets}
    ordered = order_nodes(targets)
    first = ordered[0]
    everyone = list(reader.inventory.targets.values())

    def read(target: Target) -> runs.Probe:
        request: dict[str, Any] = {"names": [run], "archive": True, "records": "none"}
        if target.name in chosen:
            request.update(names=None, gpus=True, paths=[code.path(target)])
            if len(targets) > 1 and target.name == first.name:
                request["free_port"] = target.node_address
        return runs.probe(reader.machine(target), **request)

    answers = dict(zip([t.name for t in everyone], reader.each(read, everyone), strict=True))
    for name in chosen:
        if isinstance(answers[name], OpsError):
            raise answers[name]
    unread = {n: e for n, e in answers.items() if isinstance(e, OpsError) and n not in skip}
    lifecycle.warn_unread(run, unread)
    probes = {n: a for n, a in answers.items() if isinstance(a, runs.Probe)}
    places = [v for p in probes.values() for v in runs.group(p.runs) if v.name == run]
    if places:
        raise lifecycle.taken_error(run, places)
    for target in targets:
        check_free(target, probes[target.name], force=force)
    reported = {t.name: gpu_count(probes[t.name]) for t in targets}
    placement = lifecycle.place(run, ordered, nproc=nproc, reported=reported)
    placement.port = probes[first.name].free_port
    if [t.name for t in ordered] != [t.name for t in targets]:
        context.note(
            f"{run}: rank 0 (the log and checkpoints) runs on {first.name}: torchrun's "
            "rendezvous orders the nodes by address"
        )
    return Preflight(placement, probes)


def order_nodes(targets: list[Target]) -> list[Target]:
    """Node order = torchrun's group rank order: its c10d rendezvous sorts nodes by their
    address (as text), so the node with the first address holds rank 0."""
    if len(targets) == 1:
        return list(targets)
    return sorted(targets, key=lambda t: str(t.node_address or ""))


def gpu_count(probe: runs.Probe) -> int | None:
    found = probe.gpus or {}
    return len(found.get("gpus") or []) or None


def check_free(target: Target, probe: runs.Probe, *, force: bool) -> None:
    """A target whose GPUs another run (or any process nvidia-smi shows) holds is refused."""
    holders = [v for v in runs.group(probe.runs) if v.running and v.where == "runs"]
    found = probe.gpus or {}
    apps = found.get("apps") or []
    if holders:
        v = holders[0]
        step = f", step {v.step}" if v.step is not None else ""
        why = f"run {v.name} ({v.state}{step}) holds its GPUs; stop it first"
    elif apps:
        shown = ", ".join(
            f"pid {a.get('pid')} {a.get('name')} on GPU {a.get('gpu')} ({a.get('used_mib')} MiB)"
            for a in apps[:4]
        )
        why = f"nvidia-smi shows its GPUs in use: {shown}"
    else:
        return
    if force:
        context.note(f"warning: {target.name}: {why} (--force: launching anyway)")
        return
    raise UsageError(f"{target.name} is busy: {why}, or pass --force")


# ---------------------------------------------------------------- the memory plan


def plan_argv(placement: Placement, node: lifecycle.Node, gpu_mib: int | None) -> list[str]:
    argv = [node.target.python, "-m", "workload.plan", "--config", "run.yaml"]
    argv += ["--nproc", str(node.nproc), "--nnodes", str(len(placement.nodes))]
    argv += ["--device", "cuda" if gpu_mib else "cpu", "--json"]
    if gpu_mib:
        argv += ["--gpu-memory-gib", f"{gpu_mib / 1024:.6f}"]
    return argv


def run_plan(
    machine: Any, placement: Placement, seen: Preflight, code_dir: str, cwd: str
) -> dict[str, Any] | None:
    """The memory plan per rank (workload.plan in the target, configs on the meta device, no
    weights read), or None when that workload has no plan (an older snapshot)."""
    node = placement.nodes[0]
    argv = plan_argv(placement, node, seen.gpu_memory_mib())
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
    fits = {True: "fits", False: "DOES NOT FIT", None: "no GPU reading"}[plan.get("fits")]
    head = f"memory plan per rank ({plan.get('world')} ranks, sharding {plan.get('sharding')}): "
    head += f"{human_bytes(total)}" + (f" of {human_bytes(room)}" if room else "") + f": {fits}"
    return [head, "  " + ", ".join(parts)] + [f"  {n}" for n in plan.get("notes") or []]


def check_plan(
    writer: Session, placement: Placement, seen: Preflight, code: lifecycle.Code, *, force: bool
) -> None:
    node = placement.nodes[0]
    machine = writer.machine(node.target)
    plan = run_plan(machine, placement, seen, code.path(node.target), placement.dir(node))
    if plan is None:
        return
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
            raise UsageError(message)
        context.note(f"warning: {message} (--force: launching anyway)")


def show_plan(
    reader: Session,
    placement: Placement,
    seen: Preflight,
    text: str,
    code: lifecycle.Code,
    *,
    force: bool,
) -> None:
    """Under --dry-run: the memory plan from the snapshot already in node 0 (nothing is sent)."""
    node = placement.nodes[0]
    if not seen.have_code(node.target, code):
        context.note(
            f"{placement.run}: memory plan: not shown (the workload snapshot is not on "
            f"{node.target.name} yet; a real launch sends it and prints the plan first)"
        )
        return
    machine = reader.machine(node.target)
    argv = plan_argv(placement, node, seen.gpu_memory_mib())
    argv[argv.index("run.yaml")] = "/dev/stdin"
    result = machine.run(argv, env={"PYTHONPATH": code.path(node.target)}, stdin=text.encode())
    if result.ok:
        for line in plan_lines(json.loads(result.stdout)):
            context.note(f"{placement.run}: {line}" if not line.startswith(" ") else line)
    else:
        context.note(f"{placement.run}: memory plan: {result.error_text}")


# ---------------------------------------------------------------- the config


def resolve_config(spec: str | None, sets: list[str], run: str) -> str:
    """run.yaml's text: a file or a template, with --set overrides applied on the YAML."""
    templates = sorted(p.stem for p in (bundle.templates_dir() / "runs").glob("*.yaml"))
    if not spec:
        raise UsageError(f"give --config FILE or a template name ({', '.join(templates)})")
    path = Path(spec).expanduser()
    if not path.is_file():
        name = spec.removesuffix(".yaml")
        candidate = bundle.templates_dir() / "runs" / f"{name}.yaml"
        if "/" in spec or not candidate.is_file():
            raise UsageError(
                f"--config {spec}: no such file, nor a template (templates: {', '.join(templates)})"
            )
        path = candidate
    try:
        data = load_located(path).data
    except (YamlFileError, OSError) as exc:
        raise UsageError(str(exc)) from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: a run config is a mapping of sections (target:, drafter:, ...)")
    header = f"# run.yaml of run {run}, written by `dflashops launch` from {path}"
    if not sets:
        return f"{header}\n{path.read_text()}"
    for item in sets:
        lifecycle.apply_set(data, item)
    shown = " ".join(f"--set {shlex.quote(s)}" for s in sets)
    body = yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    return f"{header}\n# with {shown}\n{body}"
