"""`hosts`: every host and target (reachable, running, GPUs, free disk), each GPU's memory,
utilisation and the run holding it; `hosts trust HOST`."""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import typer

from dflashops import context
from dflashops.commands import _options
from dflashops.errors import (
    ExitCode,
    HostKeyError,
    NoAnswerError,
    NotFoundError,
    OpsError,
    UsageError,
)
from dflashops.inventory import Endpoint, Inventory, Target, parse_jump
from dflashops.runs.reading import probe as runs_probe
from dflashops.runs.reading.probe import Probe
from dflashops.ssh.config import resolve
from dflashops.tables import Col, Grid
from dflashops.yamlfile import did_you_mean

# Run inside each target: free disk under the workspace (or its nearest existing parent),
# GPU count, whether the target's python runs. Paths arrive as arguments, never inlined.
PROBE = r"""
d="$1"; while [ ! -d "$d" ]; do d=$(dirname "$d"); done
df -Pk "$d" | awk 'NR==2 {print "disk_free_kb=" $4}'
if command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')"
fi
if "$2" -c '' </dev/null >/dev/null 2>&1; then echo "python=yes"; else echo "python=no"; fi
"""
NO_ANSWER = "no answer"


@dataclass
class HostRow:
    name: str
    address: str
    reachable: bool
    containers: int | None = None
    error: str | None = None


@dataclass
class TargetRow:
    name: str
    kind: str
    where: str
    role: str
    state: str
    gpus: int | None = None
    disk_free_bytes: int | None = None
    python: bool | None = None
    error: str | None = None
    devices: list[dict] | None = None  # per GPU (nvidia-smi): memory, utilisation, who holds it


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Hosts and targets of the inventory.", no_args_is_help=False)

    @group.callback(invoke_without_command=True)
    @context.command
    def hosts(
        ctx: typer.Context,
        json_out: bool = _options.JSON_OPTION,
    ) -> None:
        """Every host and target: reachable, container running, GPUs, free disk; each GPU's
        memory used, utilisation and the run holding it."""
        if ctx.invoked_subcommand is not None:
            return
        opts = context.begin(ctx, json_out)
        context.note(f"inventory: {opts.inventory().path}")
        host_rows, target_rows = survey(opts.session(), opts.inventory())
        if opts.json:
            opts.emit(
                {
                    "inventory": str(opts.inventory().path),
                    "hosts": [asdict(r) for r in host_rows],
                    "targets": [asdict(r) for r in target_rows],
                }
            )
        elif not opts.dry_run:
            render(host_rows, target_rows)
        for line in gpu_entries(opts.inventory(), target_rows):
            context.note(line)
        if any(not r.reachable for r in host_rows) or any(
            r.state in ("unreachable", NO_ANSWER) for r in target_rows
        ):
            raise typer.Exit(int(ExitCode.UNREACHABLE))

    @group.command("trust")
    @context.command
    def trust(
        ctx: typer.Context,
        host: str = typer.Argument(
            ..., help="A host or kind: ssh target of the inventory, or an ~/.ssh/config alias."
        ),
        yes: bool = typer.Option(False, "--yes", "-y", help="Pin without asking."),
    ) -> None:
        """Show a host's SSH key fingerprint and pin it (asks first)."""
        opts = context.begin(ctx)
        session = opts.session()
        endpoint = session.endpoint(host)
        not_a_typo(session, host, endpoint)
        pin_key(session, endpoint, yes)

    app.add_typer(group, name="hosts")


def survey(session, inventory: Inventory) -> tuple[list[HostRow], list[TargetRow]]:  # noqa: ANN001
    """Probe every host once (`pct list`) and every reachable target once, all in parallel."""
    endpoints = list(inventory.hosts.values())
    listings = session.each(lambda e: pct_list(session, e), endpoints)
    host_rows, states = [], {}
    for endpoint, listing in zip(endpoints, listings, strict=True):
        if isinstance(listing, OpsError):
            host_rows.append(HostRow(endpoint.name, endpoint.address, False, error=listing.message))
            continue
        found, remark = listing
        states[endpoint.name] = found
        count = len(found) if found is not None else None
        host_rows.append(HostRow(endpoint.name, endpoint.address, True, count, remark))
    failed = {r.name: r.error for r in host_rows if not r.reachable}
    targets = list(inventory.targets.values())
    rows = session.each(lambda t: probe(session, t, states, failed), targets)
    return host_rows, [
        r if isinstance(r, TargetRow) else _error_row(t, r)
        for t, r in zip(targets, rows, strict=True)
    ]


def pct_list(session, endpoint: Endpoint) -> tuple[dict[int, str] | None, str | None]:  # noqa: ANN001
    """(vmid -> status, None) from `pct list` on a host; (None, why) when it cannot tell."""
    result = session.host_machine(endpoint).run(["pct", "list"])
    if result.returncode == 127:
        return None, "no pct here (not a Proxmox VE node?)"
    if not result.ok:  # it answered, so it is reachable; its containers are probed one by one
        return None, f"pct list failed: {result.error_text}"
    states = {}
    for line in result.text.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 2 and fields[0].isdigit():
            states[int(fields[0])] = fields[1]
    return states, None


def probe(session, target: Target, states: dict, failed: dict) -> TargetRow:  # noqa: ANN001
    row = TargetRow(target.name, target.kind, _where(target), ",".join(target.role), "running")
    if target.kind == "pct":
        if target.host in failed:
            row.state, row.error = "unreachable", failed[target.host]
            return row
        listing = states.get(target.host)
        if listing is not None:
            row.state = listing.get(target.vmid, "missing")
            if row.state == "missing":
                row.error = f"no CT {target.vmid} on {target.host} (pct list)"
            if row.state != "running":
                return row
    result = session.machine(target).run(["sh", "-c", PROBE, "sh", target.workspace, target.python])
    if not result.ok:
        row.error = result.error_text
        return row
    facts = dict(line.split("=", 1) for line in result.text.splitlines() if "=" in line)
    if facts.get("disk_free_kb", "").isdigit():
        row.disk_free_bytes = int(facts["disk_free_kb"]) * 1024
    if facts.get("gpus", "").isdigit():
        row.gpus = int(facts["gpus"])
    row.python = facts.get("python") == "yes"
    if row.gpus is not None:
        try:
            found = runs_probe.probe(session.machine(target), names=None, gpus=True,
                                     records="none")  # fmt: skip
            row.devices = devices(found)
        except OpsError as exc:
            row.error = f"no GPU details: {exc.message}"
    return row


def devices(found: Probe) -> list[dict] | None:
    """Each GPU nvidia-smi shows, with the runs holding it (a rank's process on it, or an alive
    rank with that local rank) and the processes on it."""
    smi = found.gpus or {}
    by_pid, by_local = holders(found)
    out = []
    for gpu in smi.get("gpus") or []:
        index = gpu.get("index")
        procs = [{k: a.get(k) for k in ("pid", "name", "used_mib")}
                 for a in smi.get("apps") or [] if a.get("gpu") == index]  # fmt: skip
        held = [by_pid[p["pid"]] for p in procs if p["pid"] in by_pid]
        held += by_local.get(index, [])
        out.append({**gpu, "runs": sorted(set(held)), "processes": procs})
    return out


def holders(found: Probe) -> tuple[dict[int, str], dict[int, list[str]]]:
    """(pid -> run, local rank -> runs) of the target's running runs' alive ranks."""
    by_pid: dict[int, str] = {}
    by_local: dict[int, list[str]] = {}
    for view in found.runs:
        if not view.running:
            continue
        if view.status.get("pid"):
            by_pid[view.status["pid"]] = view.name
        for rank in view.raw.get("ranks") or []:
            if not rank.get("alive"):
                continue
            by_pid[rank.get("pid")] = view.name
            by_local.setdefault(rank.get("local_rank"), []).append(view.name)
    return by_pid, by_local


def gpu_entries(inventory: Inventory, rows: list[TargetRow]) -> list[str]:
    """For each target whose GPUs nvidia-smi showed and the inventory does not say (or says
    otherwise): the entry that lets an offline plan (`--dry-run launch`) count on them."""
    out = []
    for row in rows:
        found = [g for g in row.devices or [] if isinstance(g.get("memory_total_mib"), int)]
        if not found:
            continue
        target = inventory.targets[row.name]
        model = found[0].get("name")
        gib = round(min(g["memory_total_mib"] for g in found) / 1024, 1)
        said = (target.gpus, target.gpu_model, target.gpu_memory_gib)
        if said == (len(found), model, gib):
            continue
        entry = f"gpus: {len(found)}, gpu_model: {model}, gpu_memory_gib: {gib}"
        out.append(f"{row.name}: nvidia-smi shows {len(found)} x {model} ({gib} GiB); "
                   f"say so in {inventory.path}, targets.{row.name}: {{{entry}}}")  # fmt: skip
    return out


def _error_row(target: Target, error: OpsError) -> TargetRow:
    state = "unreachable" if error.code == ExitCode.UNREACHABLE else "error"
    if error.code == ExitCode.NOT_FOUND:
        state = "missing"
    if isinstance(error, NoAnswerError):
        state = NO_ANSWER
    return TargetRow(
        target.name, target.kind, _where(target), ",".join(target.role), state, error=error.message
    )


def _where(target: Target) -> str:
    if target.kind == "pct":
        return f"{target.host}/{target.vmid}"
    if target.kind == "ssh" and target.endpoint:
        return target.endpoint.address
    return "this machine"


def render(host_rows: list[HostRow], target_rows: list[TargetRow]) -> None:
    from dflashops.render import console, human_bytes, styled, table

    out = console()
    if host_rows:
        hosts = table(Col("HOST", keep=True), Col("ADDRESS", priority=3),
                      Col("REACHABLE", keep=True), Col("CTS", priority=2),
                      Col("NOTE", priority=1, wrap=True))  # fmt: skip
        for r in host_rows:
            mark = styled("yes", "green") if r.reachable else styled("no", "red")
            hosts.add_row(r.name, r.address, mark, _dash(r.containers), r.error or "")
        out.print(hosts)
        out.print()
    targets = table(Col("TARGET", keep=True), Col("KIND", priority=1), Col("WHERE", priority=4),
                    Col("ROLE", priority=2), Col("STATE", keep=True), Col("GPUS", priority=6),
                    Col("FREE DISK", priority=5), Col("PYTHON", priority=3),
                    Col("NOTE", priority=7, wrap=True))  # fmt: skip
    for r in target_rows:
        colour = {"running": "green", "stopped": "yellow"}.get(r.state, "red")
        free = human_bytes(r.disk_free_bytes) if r.disk_free_bytes is not None else "-"
        python = {True: "ok", False: "missing", None: "-"}[r.python]
        targets.add_row(r.name, r.kind, r.where, r.role, styled(r.state, colour),
                        _dash(r.gpus), free, python, r.error or "")  # fmt: skip
    out.print(targets)
    if any(r.devices for r in target_rows):
        out.print()
        out.print(gpu_table(target_rows))


def gpu_table(target_rows: list[TargetRow]) -> Grid:
    from dflashops.render import table

    grid = table(Col("TARGET", keep=True), Col("GPU", keep=True), Col("MEMORY USED", priority=3),
                 Col("UTIL", priority=2), Col("HELD BY", keep=True),
                 Col("MODEL", priority=1))  # fmt: skip
    for r in target_rows:
        for gpu in r.devices or []:
            grid.add_row(r.name, _dash(gpu.get("index")), _memory(gpu),
                         _percent(gpu.get("utilization")), _held(gpu), _dash(gpu.get("name")))  # fmt: skip
    return grid


def _memory(gpu: dict) -> str:
    used, total = gpu.get("memory_used_mib"), gpu.get("memory_total_mib")
    if used is None or total is None:
        return "-"
    return f"{used / 1024:.1f} of {total / 1024:.1f} GiB"


def _percent(value: int | None) -> str:
    return "-" if value is None else f"{value}%"


def _held(gpu: dict) -> str:
    """The runs holding it, else the processes on it (pid and name), else '-'."""
    if gpu["runs"]:
        return ", ".join(gpu["runs"])
    procs = [f"pid {p['pid']} ({p['name']})" for p in gpu["processes"]]
    return ", ".join(procs) or "-"


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


def not_a_typo(session, host: str, endpoint: Endpoint) -> None:  # noqa: ANN001
    """A bare name that is neither in the inventory nor an ~/.ssh/config alias, but close to
    a name of the inventory, is a typo: said (exit 4) before any DNS lookup."""
    inventory = session.inventory
    names = [*inventory.hosts, *(t.name for t in inventory.targets.values() if t.kind == "ssh")]
    if host in names or any(c in host for c in "@:,.") or endpoint.user or endpoint.port:
        return
    if resolve(endpoint).hostname != host or host in jump_hosts(inventory):  # ssh knows it
        return
    hint = did_you_mean(host, names)
    if hint:
        raise NotFoundError(f"{host}: not a host of {inventory.path}{hint}")
    known = ", ".join(sorted(inventory.hosts)) or "none"
    raise NotFoundError(
        f"{host}: not a host of {inventory.path} (hosts: {known}), nor an ~/.ssh/config alias; "
        f"describe it under hosts: in that file (or give root@{host} for a name DNS resolves)"
    )


def jump_hosts(inventory: Inventory) -> set[str]:
    """Every host named in a `jump` of the inventory (what a refusal may ask to trust)."""
    endpoints = [*inventory.hosts.values(), *(t.endpoint for t in inventory.targets.values())]
    return {hop.host for e in endpoints if e and e.jump for hop in parse_jump(e.jump)}


def pin_key(session, endpoint: Endpoint, yes: bool) -> None:  # noqa: ANN001
    from dflashops.ssh.known_hosts import (
        CHANGED,
        REVOKED,
        TRUSTED,
        KnownHosts,
        fingerprint,
        host_key_files,
        pinned_keys_file,
    )

    conn = session.connection(endpoint)
    resolved = conn.resolved
    key = conn.server_key()
    fp, name = key.fingerprint, resolved.key_name
    found = KnownHosts.load(host_key_files(resolved)).verdict(name, key)
    if found.state == TRUSTED:
        context.note(
            f"{endpoint.name}: {key.get_name()} {fp} is already trusted ({found.entry.where})"
        )
        return
    if found.state == REVOKED:
        raise HostKeyError(
            f"{endpoint.name}: the key now offered ({fp}) is marked @revoked in "
            f"{found.entry.where}; not pinning it"
        )
    if found.state == CHANGED:
        raise UsageError(
            f"{endpoint.name}: the key now offered ({fp}) differs from the one pinned in "
            f"{found.entry.where} ({fingerprint(found.entry.blob)}); if the host was reinstalled, "
            "delete that line and try again"
        )
    context.note(f"{resolved.label} offers {key.get_name()} key {fp}")
    if session.dry_run:
        return
    if not yes:
        if not sys.stdin.isatty():
            raise UsageError(
                "not pinning without confirmation: check the fingerprint, then add --yes"
            )
        if not typer.confirm("Trust this key and pin it?", default=False):
            raise OpsError("not pinned", ExitCode.FAILED)
    path = endpoint.known_hosts or pinned_keys_file()
    _append_key(path, name, key)
    context.note(f"pinned in {path}")


def _append_key(path: Path, name: str, key) -> None:  # noqa: ANN001
    path.parent.mkdir(parents=True, exist_ok=True)
    line = f"{name} {key.get_name()} {key.get_base64()}\n"
    existing = path.read_text() if path.exists() else ""
    if existing and not existing.endswith("\n"):
        line = "\n" + line
    with open(path, "a") as f:
        f.write(line)
