"""hosts.yaml in the contract's format (CONTRACTS.md section 1) for the bed's hosts."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from .container import Container
from .host import Host

if TYPE_CHECKING:
    from .bed import TestBed

# Paths that exist in every container of both tiers (and on the fake hosts).
DEFAULTS = {"workspace": "/workspace", "python": "/usr/bin/python3"}


def write_inventory(
    bed: TestBed,
    path: Path,
    targets: dict,
    *,
    pin_keys: bool = True,
    extra_defaults: dict | None = None,
    extra_hosts: dict | None = None,
) -> Path:
    """Write `path` with one target per entry of `targets`; a target is given as

    - `("pve1", 201)` or a Container: a pct target (`host` + `vmid`), plus optional extra
      keys as a third item: `("pve1", 201, {"role": "train"})`;
    - `"pve1"` or a Host: a `kind: ssh` target reaching that fake host directly;
    - a dict: written as is.

    `hosts:` gets every bed host a target uses, with address, port, user root, the bed's
    client key as identity and, when `pin_keys`, a known_hosts file written next to `path`
    (`known_hosts`) that pins all bed hosts. `extra_hosts` adds hosts by name, e.g.
    `{"ghost": {"address": tb.unused_address()}}` (same defaults for the other keys).
    """
    known_hosts = path.parent / "known_hosts"
    if pin_keys:
        bed.write_known_hosts(known_hosts)

    def connection(address: str, port: int) -> dict:
        entry = {"address": address, "port": port, "user": "root", "identity": str(bed.client_key)}
        if pin_keys:
            entry["known_hosts"] = str(known_hosts)
        return entry

    hosts: dict[str, dict] = {}
    out: dict[str, dict] = {}
    for name, spec in targets.items():
        if isinstance(spec, Container):
            spec = (spec.host.name, spec.vmid)
        if isinstance(spec, (str, Host)):
            host = spec if isinstance(spec, Host) else bed.hosts[spec]
            out[name] = {"kind": "ssh", **connection(host.address, host.port)}
        elif isinstance(spec, tuple):
            host_name, vmid, *extra = spec
            out[name] = {"host": host_name, "vmid": vmid, **(extra[0] if extra else {})}
        elif isinstance(spec, dict):
            out[name] = dict(spec)
        else:
            raise TypeError(f"target {name}: can't use {spec!r}")
        host_name = out[name].get("host")
        if host_name in bed.hosts:
            host = bed.hosts[host_name]
            hosts[host_name] = connection(host.address, host.port)
    for name, entry in (extra_hosts or {}).items():
        hosts[name] = {**connection(entry["address"], 22), **entry}
    doc = {
        "version": 1,
        "defaults": {**DEFAULTS, **(extra_defaults or {})},
        "hosts": hosts,
        "targets": out,
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False, default_flow_style=False))
    return path
