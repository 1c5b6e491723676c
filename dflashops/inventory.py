"""hosts.yaml -> typed hosts and targets (contract section 1), validated before any connection."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflashops.errors import InventoryError, NotFoundError
from dflashops.yamlfile import LocatedYaml, YamlFileError, did_you_mean, load_located

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ROLES = ("train", "eval")
KINDS = ("pct", "ssh", "local")

DEFAULTS: dict[str, Any] = {
    "workspace": "/workspace",
    "python": "/root/venv/bin/python",
    "env": {},
    "path": DEFAULT_PATH,
    "engines": {},
}
ENGINES = ("vllm",)  # generation engines a target may have an environment of its own for
# another environment of an engine, under a name of its own: vllm-0.31, vllm-nightly
ENGINE_VARIANT = re.compile(r"^([a-z]+)-([A-Za-z0-9][A-Za-z0-9._-]{0,31})\Z")
CONNECTION_KEYS = (
    "address", "user", "port", "identity", "known_hosts", "jump", "connect_timeout", "max_sessions",
)  # fmt: skip
# What may name a host and a login: these reach ssh's command line, a ProxyCommand's %h and
# %r and `Match exec` (run by /bin/sh), so no whitespace, `%`, leading `-` or shell syntax.
ADDRESS_RE = re.compile(r"^[0-9A-Za-z_][0-9A-Za-z._:-]{0,252}\Z")  # an IP address, a host name
USER_RE = re.compile(r"^[0-9A-Za-z_][0-9A-Za-z._-]{0,63}\Z")
NOT_AN_ADDRESS = "is not an IP address or host name (letters, digits, '.', '_', '-', ':')"
NOT_A_USER = "is not a user name (letters, digits, '.', '_', '-')"
GPU_KEYS = ("gpu_model", "gpu_memory_gib")  # what the GPUs are, for plans made offline
TARGET_KEYS = ("kind", "host", "vmid", "role", "gpus", *GPU_KEYS, *DEFAULTS, *CONNECTION_KEYS)
DEMO_INVENTORY = "demo-hosts.yaml"  # the clone's inventory of `local` only (never looked up)


@dataclass(frozen=True)
class Endpoint:
    """An SSH server: a Proxmox host, or a plain `kind: ssh` machine. `user` and `port` are
    None when not given, so that ~/.ssh/config can set them (else root and 22)."""

    name: str
    address: str
    user: str | None = None
    port: int | None = None
    identity: Path | None = None
    known_hosts: Path | None = None
    jump: str | None = None
    connect_timeout: float = 10.0
    max_sessions: int = 8


@dataclass(frozen=True)
class Hop:
    """One hop of a ProxyJump spec: `[user@]host[:port]`."""

    host: str
    user: str | None = None
    port: int | None = None

    def __str__(self) -> str:
        user = f"{self.user}@" if self.user else ""
        return f"{user}{self.host}" + (f":{self.port}" if self.port else "")


def parse_jump(spec: str) -> list[Hop]:
    """`a,user@b:2222` -> hops in order; ValueError naming the bad part."""
    hops = []
    for part in spec.split(","):
        part = part.strip()
        user, _, rest = part.rpartition("@")
        host, _, port = rest.partition(":")
        if not host or (port and not (port.isdigit() and 0 < int(port) < 65536)):
            raise ValueError(f"{part!r} is not [user@]host[:port]")
        if not ADDRESS_RE.match(host):
            raise ValueError(f"{host!r} {NOT_AN_ADDRESS}")
        if user and not USER_RE.match(user):
            raise ValueError(f"{user!r} {NOT_A_USER}")
        hops.append(Hop(host=host, user=user or None, port=int(port) if port else None))
    return hops


def engine_of(name: str) -> str:
    """The engine an `engines:` entry is an environment of: vllm-0.31 -> vllm."""
    found = ENGINE_VARIANT.match(name)
    return found.group(1) if found else name


@dataclass(frozen=True)
class Target:
    """Where work runs: a container on a Proxmox host, an SSH machine, or this machine."""

    name: str
    kind: str
    workspace: str
    python: str
    env: dict[str, str] = field(default_factory=dict)
    path: str = DEFAULT_PATH
    role: tuple[str, ...] = ROLES
    gpus: int | None = None
    endpoint: Endpoint | None = None
    vmid: int | None = None
    address: str | None = None  # where other targets reach it (a run over several targets)
    engines: dict[str, str] = field(default_factory=dict)  # engine -> its environment's python
    gpu_model: str | None = None  # as nvidia-smi names it: "NVIDIA H200"
    gpu_memory_gib: float | None = None  # one GPU's memory

    @property
    def host(self) -> str | None:
        return self.endpoint.name if self.endpoint else None

    @property
    def node_address(self) -> str | None:
        """The address other targets reach this one at: a pct target's `address`, an ssh
        target's own address."""
        if self.address:
            return self.address
        return self.endpoint.address if self.kind == "ssh" and self.endpoint else None


@dataclass
class Inventory:
    path: Path
    hosts: dict[str, Endpoint]
    targets: dict[str, Target]

    def target(self, name: str) -> Target:
        try:
            return self.targets[name]
        except KeyError:
            known = ", ".join(sorted(self.targets)) or "none"
            raise NotFoundError(
                f"no target '{name}' in {self.path}{did_you_mean(name, list(self.targets))}"
                f" (targets: {known})"
            ) from None


def find_inventory(explicit: str | None) -> Path:
    """The lookup order of contract section 1; the path found, absolute (errors name it)."""
    if explicit:
        path = Path(explicit).expanduser().absolute()
        if not path.is_file():
            raise InventoryError(f"{path}: no such inventory file (given with --inventory)")
        return path
    env = os.environ.get("DFLASHOPS_INVENTORY")
    if env:
        path = Path(env).expanduser().absolute()
        if not path.is_file():
            raise InventoryError(f"{path}: no such inventory file (from $DFLASHOPS_INVENTORY)")
        return path
    for candidate in (Path("hosts.yaml"), Path.home() / ".config" / "dflashops" / "hosts.yaml"):
        if candidate.is_file():
            return candidate.absolute()
    raise InventoryError(
        f"no inventory: neither {Path('hosts.yaml').absolute()} nor "
        f"{Path.home() / '.config' / 'dflashops' / 'hosts.yaml'} exists; create the second "
        f"(see the README), or give --inventory PATH or $DFLASHOPS_INVENTORY (a clone's "
        f"{DEMO_INVENTORY} has the demo's `local` target)"
    )


def load_inventory(path: Path) -> Inventory:
    try:
        doc = load_located(path)
        return _Parser(doc).parse()
    except YamlFileError as exc:
        raise InventoryError(str(exc)) from None
    except OSError as exc:
        raise InventoryError(f"{path}: cannot read: {exc.strerror}") from None


class _Parser:
    def __init__(self, doc: LocatedYaml) -> None:
        self.doc = doc
        self.base = doc.path.resolve().parent

    def fail(self, key: str, problem: str) -> YamlFileError:
        return self.doc.error(key, problem)

    def parse(self) -> Inventory:
        data = self.doc.data
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise YamlFileError(
                f"{self.doc.path}:1: expected a mapping with version, hosts, targets"
            )
        self.check_keys("", data, ("version", "defaults", "hosts", "targets"))
        version = data.get("version", 1)
        if version != 1:
            raise self.fail("version", f"{version!r} is not supported; write 'version: 1'")
        defaults = self.section(data, "defaults")
        self.check_keys("defaults", defaults, tuple(DEFAULTS) + GPU_KEYS + CONNECTION_KEYS[1:])
        hosts = {
            name: self.endpoint(f"hosts.{name}", name, spec, defaults)
            for name, spec in self.named_sections(data, "hosts")
        }
        targets = {
            name: self.target(f"targets.{name}", name, spec, defaults, hosts)
            for name, spec in self.named_sections(data, "targets")
        }
        for key, endpoint in [(f"hosts.{h}", e) for h, e in hosts.items()] + [
            (f"targets.{t.name}", t.endpoint) for t in targets.values() if t.kind == "ssh"
        ]:
            if endpoint and endpoint.jump and endpoint.jump == endpoint.name:
                raise self.fail(f"{key}.jump", "a host cannot jump through itself")
        return Inventory(path=self.doc.path, hosts=hosts, targets=targets)

    def section(self, data: dict, key: str) -> dict:
        value = data.get(key) or {}
        if not isinstance(value, dict):
            raise self.fail(key, "expected a mapping")
        return value

    def named_sections(self, data: dict, key: str) -> list[tuple[str, dict]]:
        out = []
        for name, spec in self.section(data, key).items():
            if not NAME_RE.match(name):
                raise self.fail(f"{key}.{name}", "names are letters, digits, '.', '_', '-' (1-64)")
            if spec is None:
                spec = {}
            if not isinstance(spec, dict):
                raise self.fail(f"{key}.{name}", "expected a mapping of settings")
            out.append((name, spec))
        return out

    def check_keys(self, prefix: str, spec: dict, allowed: tuple[str, ...]) -> None:
        for key in spec:
            if key not in allowed:
                dotted = f"{prefix}.{key}" if prefix else key
                raise self.fail(dotted, f"unknown key{did_you_mean(key, list(allowed))}")

    def endpoint(self, key: str, name: str, spec: dict, defaults: dict) -> Endpoint:
        self.check_keys(key, spec, CONNECTION_KEYS)
        merged = {k: v for k, v in defaults.items() if k in CONNECTION_KEYS} | spec
        if "address" not in merged:
            raise self.fail(key, "missing 'address' (an IP address or an ~/.ssh/config alias)")
        return Endpoint(
            name=name,
            address=self.matching(f"{key}.address", merged["address"], ADDRESS_RE, NOT_AN_ADDRESS),
            user=self.user(f"{key}.user", merged.get("user")),
            port=self.optional_int(f"{key}.port", merged.get("port"), 1, 65535),
            identity=self.file_path(f"{key}.identity", merged.get("identity")),
            known_hosts=self.file_path(f"{key}.known_hosts", merged.get("known_hosts")),
            jump=self.jump(f"{key}.jump", merged.get("jump")),
            connect_timeout=self.number(
                f"{key}.connect_timeout", merged.get("connect_timeout", 10)
            ),
            max_sessions=self.integer(
                f"{key}.max_sessions", merged.get("max_sessions", 8), 1, 1000
            ),
        )

    def matching(self, key: str, value: Any, pattern: re.Pattern, problem: str) -> str:
        text = self.text(key, value)
        if not pattern.match(text):
            raise self.fail(key, f"{text!r} {problem}")
        return text

    def user(self, key: str, value: Any) -> str | None:
        return None if value is None else self.matching(key, value, USER_RE, NOT_A_USER)

    def jump(self, key: str, value: Any) -> str | None:
        text = self.optional_text(key, value)
        if text is not None:
            try:
                parse_jump(text)
            except ValueError as exc:
                raise self.fail(
                    key, f"{exc}; give a host of this file or of ~/.ssh/config"
                ) from None
        return text

    def target(
        self, key: str, name: str, spec: dict, defaults: dict, hosts: dict[str, Endpoint]
    ) -> Target:
        self.check_keys(key, spec, TARGET_KEYS)
        kind = spec.get("kind") or ("pct" if "vmid" in spec or "host" in spec else None)
        if kind is None:
            kind = "ssh" if "address" in spec else "pct"
        if kind not in KINDS:
            raise self.fail(f"{key}.kind", f"{kind!r} is not one of {', '.join(KINDS)}")
        merged = DEFAULTS | {k: v for k, v in defaults.items() if k in DEFAULTS} | spec

        def src(k: str) -> str:  # errors point at the line the value came from
            return f"{key}.{k}" if k in spec else f"defaults.{k}"

        common = dict(
            name=name,
            kind=kind,
            workspace=self.workspace(src("workspace"), merged["workspace"], kind),
            python=self.text(src("python"), merged["python"]),
            env=self.env(src("env"), merged["env"]),
            path=self.text(src("path"), merged["path"]),
            role=self.roles(f"{key}.role", spec.get("role", list(ROLES))),
            gpus=self.optional_int(f"{key}.gpus", spec.get("gpus"), 0, 1024),
            engines=self.engines(src("engines"), merged["engines"], kind),
            **self.gpu_kind(key, spec, defaults),
        )
        if kind == "pct":
            return Target(**common, **self.pct_placement(key, spec, hosts))
        if kind == "ssh":
            return Target(**common, endpoint=self.ssh_endpoint(key, name, spec, defaults, hosts))
        for extra in ("host", "vmid", *CONNECTION_KEYS):
            if extra in spec:
                raise self.fail(f"{key}.{extra}", "not allowed for kind: local")
        return Target(**common)

    def gpu_kind(self, key: str, spec: dict, defaults: dict) -> dict[str, Any]:
        """gpu_model and gpu_memory_gib: the target's, else the defaults'."""
        model = spec.get("gpu_model", defaults.get("gpu_model"))
        memory = spec.get("gpu_memory_gib", defaults.get("gpu_memory_gib"))
        where = {k: f"{key}.{k}" if k in spec else f"defaults.{k}" for k in GPU_KEYS}
        if memory is not None and (type(memory) not in (int, float) or not 0 < memory <= 4096):
            raise self.fail(where["gpu_memory_gib"], f"expected one GPU's memory in GiB (e.g. "
                            f"139.8, as `dflashops hosts` shows it), got {memory!r}")  # fmt: skip
        return {
            "gpu_model": None if model is None else self.text(where["gpu_model"], model),
            "gpu_memory_gib": None if memory is None else float(memory),
        }

    def pct_placement(self, key: str, spec: dict, hosts: dict[str, Endpoint]) -> dict:
        for extra in CONNECTION_KEYS:
            if extra in spec and extra != "address":
                raise self.fail(
                    f"{key}.{extra}", "set connection keys on the host, not the container"
                )
        if "host" not in spec:
            raise self.fail(key, "missing 'host' (the Proxmox node under hosts: that runs this CT)")
        host = spec["host"]
        if host not in hosts:
            known = ", ".join(sorted(hosts)) or "none defined"
            raise self.fail(
                f"{key}.host",
                f"'{host}' is not a host in this file{did_you_mean(str(host), list(hosts))}"
                f" (hosts: {known})",
            )
        if "vmid" not in spec:
            raise self.fail(key, "missing 'vmid' (the container's numeric ID, as in `pct list`)")
        vmid = self.integer(f"{key}.vmid", spec["vmid"], 100, 999_999_999)
        address = spec.get("address")
        if address is not None:
            address = self.text(f"{key}.address", address)
            if not ADDRESS_RE.match(address):
                raise self.fail(
                    f"{key}.address",
                    f"{address!r}: give the container's IP address on its bridge (e.g. "
                    "10.1.2.200), where the other targets of a run reach it",
                )
        return {"endpoint": hosts[host], "vmid": vmid, "address": address}

    def ssh_endpoint(
        self, key: str, name: str, spec: dict, defaults: dict, hosts: dict[str, Endpoint]
    ) -> Endpoint:
        if "vmid" in spec:
            raise self.fail(f"{key}.vmid", "only containers (kind: pct) have a vmid")
        connection = {k: v for k, v in spec.items() if k in CONNECTION_KEYS}
        if "host" in spec:
            if connection:
                raise self.fail(f"{key}.host", "give either 'host' or connection keys, not both")
            if spec["host"] not in hosts:
                raise self.fail(f"{key}.host", f"'{spec['host']}' is not a host in this file")
            return hosts[spec["host"]]
        return self.endpoint(key, name, connection, defaults)

    def workspace(self, key: str, value: Any, kind: str) -> str:
        text = self.text(key, value)
        if kind == "local":
            return str((self.base / Path(text).expanduser()).resolve())
        if not text.startswith("/"):
            raise self.fail(key, f"'{text}' must be an absolute path inside the target")
        return text.rstrip("/") or "/"

    def engines(self, key: str, value: Any, kind: str) -> dict[str, str]:
        if not isinstance(value, dict):
            raise self.fail(
                key, "expected a mapping of engine: python, e.g. {vllm: /opt/vllm/bin/python}"
            )
        out = {}
        for name, python in value.items():
            if engine_of(str(name)) not in ENGINES:
                raise self.fail(f"{key}.{name}", f"not an engine we run (engines: "
                                f"{', '.join(ENGINES)}, or ENGINE-LABEL for another environment of "
                                f"one){did_you_mean(str(name), list(ENGINES))}")  # fmt: skip
            text = self.text(f"{key}.{name}", python)
            if kind == "local":  # a venv's python is a symlink: never resolved
                text = os.path.abspath(self.base / Path(text).expanduser())
            elif not text.startswith("/"):
                raise self.fail(
                    f"{key}.{name}", f"'{text}' must be an absolute path inside the target"
                )
            out[name] = text
        return out

    def roles(self, key: str, value: Any) -> tuple[str, ...]:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not items:
            raise self.fail(key, "expected train, eval or a list of them")
        for item in items:
            if item not in ROLES:
                raise self.fail(key, f"{item!r} is not one of {', '.join(ROLES)}")
        return tuple(items)

    def env(self, key: str, value: Any) -> dict[str, str]:
        if not isinstance(value, dict):
            raise self.fail(key, "expected a mapping of NAME: value")
        out = {}
        for name, item in value.items():
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*\Z", str(name)):
                raise self.fail(f"{key}.{name}", "not a valid environment variable name")
            if isinstance(item, (dict, list)) or item is None:
                raise self.fail(f"{key}.{name}", "expected a string or number")
            out[str(name)] = str(item)
        return out

    def _checked(self, key: str, value: Any, ok: Callable[[Any], bool], expected: str) -> Any:
        if not ok(value):
            raise self.fail(key, f"expected {expected}, got {value!r}")
        return value

    def text(self, key: str, value: Any) -> str:
        return self._checked(key, value, lambda v: isinstance(v, str) and v != "", "a string")

    def optional_text(self, key: str, value: Any) -> str | None:
        return None if value is None else self.text(key, value)

    def integer(self, key: str, value: Any, low: int, high: int) -> int:
        expected = f"an integer {low}..{high}"
        return self._checked(key, value, lambda v: type(v) is int and low <= v <= high, expected)

    def optional_int(self, key: str, value: Any, low: int, high: int) -> int | None:
        return None if value is None else self.integer(key, value, low, high)

    def number(self, key: str, value: Any) -> float:
        ok = self._checked(
            key, value, lambda v: type(v) in (int, float) and v > 0, "a positive number of seconds"
        )
        return float(ok)

    def file_path(self, key: str, value: Any) -> Path | None:
        if value is None:
            return None
        path = Path(self.text(key, value)).expanduser()
        return path if path.is_absolute() else (self.base / path)
