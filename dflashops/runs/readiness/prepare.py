"""What `setup` makes ready inside a container before its venv: the system packages doctor
finds missing (apt, as root there), and the lines only the Proxmox host's owner can apply."""

from __future__ import annotations

from dflashops import context
from dflashops.runs.readiness import doctor
from dflashops.targets.base import Machine

APT_S = 600.0  # apt's deadline of silence (an index update, a download)
APT_ENV = {"DEBIAN_FRONTEND": "noninteractive"}


def missing_packages(facts: dict) -> list[str]:
    """The apt packages of doctor's checks that the target lacks (tmux, python3-venv, libnuma1)."""
    return [doctor.APT[key] for key in ("venv", "tmux", "libnuma") if facts and not facts.get(key)]


def apt_install(machine: Machine, package: str) -> str | None:
    """Install one package; None when done, else apt's last line (the index is updated once
    when apt does not know the package)."""
    argv = ["apt-get", "install", "-y", "--no-install-recommends", package]
    done = machine.run(argv, env=APT_ENV, timeout=APT_S)
    if done.ok:
        return None
    if b"Unable to locate package" in done.stderr:
        machine.run(["apt-get", "update"], env=APT_ENV, timeout=APT_S)
        done = machine.run(argv, env=APT_ENV, timeout=APT_S)
        if done.ok:
            return None
    return done.error_text


def install_packages(machine: Machine, facts: dict) -> dict[str, str]:
    """Each missing package installed (one at a time: one that cannot be had leaves the
    others); {package: "installed" | why not}."""
    wanted = missing_packages(facts)
    if not wanted:
        return {}
    if machine.target.kind != "pct":  # not a container of ours: said, never installed
        for package in wanted:
            context.note(f"{machine.name}: {package} missing (doctor says what it is for)")
        return dict.fromkeys(wanted, "not a container: not installed")
    if not facts.get("root") or not facts.get("apt"):
        why = "not root there" if not facts.get("root") else "no apt-get there"
        for package in wanted:
            context.note(f"{machine.name}: {package} missing, not installed ({why}): install it")
        return dict.fromkeys(wanted, why)
    done = {}
    for package in wanted:
        context.note(f"{machine.name}: apt-get install {package}")
        failed = apt_install(machine, package)
        done[package] = "installed" if failed is None else failed
        if failed is not None:
            context.note(f"{machine.name}: {package} not installed: {failed}")
    return done


def host_lines(machine: Machine, facts: dict) -> list[str]:
    """What only the Proxmox host's owner can fix, for a target hosts.yaml gives GPUs: the
    passthrough and a larger /dev/shm, as lines of the container's config."""
    target = machine.target
    if not facts or not target.gpus:
        return []
    checks = [*doctor.gpu_checks(target, facts, True, f"hosts.yaml gives it {target.gpus} GPU(s)"),
              doctor.shm_check(target, facts, True)]  # fmt: skip
    lines = []
    for check in checks:
        if check.failed:
            lines += [f"{target.name}: {check.name}: {check.text}", *check.host_fix]
    return lines
