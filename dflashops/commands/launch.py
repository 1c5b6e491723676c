"""`launch RUN --host TARGET [--config FILE|TEMPLATE] [--set KEY=VALUE]... [--secret NAME]...`

Writes <ws>/runs/RUN/{run.yaml, launch.sh, state.json} (verified copies), secrets into a 0600
secrets.env that launch.sh sources, and starts launch.sh in the detached tmux session
dflash-RUN; then waits for the trainer's first sign of life or its early exit.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import shlex
import tempfile
import time
from pathlib import Path
from typing import Any

import typer
import yaml

from dflashops import bundle, context, runs, transfer
from dflashops.commands.setup import sync_workload
from dflashops.errors import OpsError, TransferError, UsageError
from dflashops.inventory import Target
from dflashops.render import Stopwatch, duration
from dflashops.runs import RunView
from dflashops.targets.base import Machine
from dflashops.yamlfile import YamlFileError, load_located

LAUNCH_SCRIPT = "launch.sh"
SECRETS = "secrets.env"
SECRET_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
KEY_PART = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# options that `resume` shares
SECRETS_OPTION = typer.Option(
    None,
    "--secret",
    metavar="NAME",
    help="Pass NAME from your environment (e.g. WANDB_API_KEY) to the trainer through a 0600 "
    "file, never on a command line (resume: replaces the run's secrets).",
)
FOLLOW_OPTION = typer.Option(
    False, "--follow", "-f", help="Then watch it, as status --follow does."
)
WAIT_OPTION = typer.Option(
    900, "--wait", metavar="SECONDS", help="How long to wait for the first sign of life."
)
JSON_OPTION = typer.Option(False, "--json", help="Print one JSON document.")


def register(app: typer.Typer) -> None:
    @app.command("launch")
    @context.command
    def launch(
        ctx: typer.Context,
        run: str = typer.Argument(
            ..., metavar="RUN", help="A new run name, unique across the inventory."
        ),
        host: str = typer.Option(..., "--host", metavar="TARGET", help="The target to train on."),
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
        secrets: list[str] = SECRETS_OPTION,
        follow: bool = FOLLOW_OPTION,
        wait: float = WAIT_OPTION,
        json_out: bool = JSON_OPTION,
    ) -> None:
        """Start a training run in a detached tmux session on a target."""
        opts = context.get(ctx)
        opts.want_json(json_out)
        runs.check_name(run)
        text = resolve_config(config, sets or [], run)
        env_file = secret_file(secrets or [])
        target = opts.inventory().target(host)
        with runs.sessions(opts) as (reader, writer):
            claim_name(reader, run, target)
            machine = writer.machine(target)
            rundir = runs.run_dir(target, run)
            context.note(f"{target.name}: syncing the workload")
            sync_workload(machine)
            make_run_dir(machine, rundir, text, run)
            if env_file is not None:
                write_secrets(machine, rundir, env_file)
            start(machine, run, rundir, resume=False)
            if opts.dry_run:
                context.note("dry run: nothing was changed")
                runs.dry_run_done(opts, run=run, target=target.name, dir=rundir)
                return
            view = wait_for_life(reader.machine(target), run, timeout=wait)
            then_follow(opts, reader, view, follow)


def then_follow(opts: context.Context, reader: Any, view: RunView, follow: bool) -> None:
    """Report the started run; with --follow, go on as `status --follow` (one JSON document
    at the end under --json)."""
    if not (follow and opts.json):
        report(opts, view)
    if follow:
        from dflashops.commands.status import follow_run

        emit = opts.emit if opts.json else None
        raise typer.Exit(follow_run(reader, view, None, interval=5.0, emit=emit))


def report(opts: context.Context, view: RunView) -> None:
    if opts.json:
        opts.emit(view.summary())
        return
    step = f", step {view.step}/{view.total_steps}" if view.step is not None else ""
    context.say(
        f"{view.name}: {view.state} on {view.target} (tmux {runs.tmux_session(view.name)}"
        f"{step}); watch it with: dflashops status {view.name} --follow"
    )


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
        apply_set(data, item)
    shown = " ".join(f"--set {shlex.quote(s)}" for s in sets)
    body = yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    return f"{header}\n# with {shown}\n{body}"


def apply_set(data: dict[str, Any], item: str) -> None:
    key, sep, raw = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(KEY_PART.match(p) for p in parts):
        raise UsageError(f"--set {item}: expected KEY=VALUE with a dotted key, e.g. loss.gamma=7")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        raise UsageError(f"--set {item}: the value is not valid YAML") from None
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise UsageError(f"--set {item}: {where} is a value, not a section")
        node = child
    node[parts[-1]] = value


# ---------------------------------------------------------------- secrets


def secret_file(names: list[str]) -> bytes | None:
    """The secrets.env text for --secret NAME... (values from our environment), or None."""
    if not names:
        return None
    lines = ["# --secret values from `dflashops launch`; mode 0600; sourced by launch.sh"]
    for name in names:
        if not SECRET_NAME.match(name):
            raise UsageError(
                f"--secret {name}: give an environment variable's name (its value is read from "
                "your environment), e.g. --secret WANDB_API_KEY"
            )
        value = os.environ.get(name)
        if value is None:
            raise UsageError(f"--secret {name}: not set in your environment")
        lines.append(f"{name}={shlex.quote(value)}")
    return ("\n".join(lines) + "\n").encode()


def write_secrets(machine: Machine, rundir: str, content: bytes) -> None:
    """secrets.env, created 0600 (umask) from our stdin: never on a command line."""
    path = posixpath.join(rundir, SECRETS)
    script = 'umask 077 && rm -f -- "$1" && cat > "$1"'
    result = machine.run(["sh", "-c", script, "sh", path], stdin=content)
    if machine.dry_run:
        return
    if not result.ok:
        raise OpsError(f"{machine.name}: could not write {path}: {result.error_text}")
    found = transfer.describe_remote(machine, rundir, [SECRETS]).get(SECRETS, {})
    if found.get("sha256") != hashlib.sha256(content).hexdigest():
        raise TransferError(f"{machine.name}: {path} differs after the copy; launch again")


# ---------------------------------------------------------------- the run directory


def claim_name(reader: Any, run: str, target: Target) -> None:
    """Refuse a name used anywhere (runs/ or archive/ of any target)."""
    found = runs.survey(reader, names=[run], archive=True, records="none")
    places = found.where(run)
    if places:
        shown = ", ".join(f"{t}:{w}/{run}" for t, w in places)
        raise UsageError(
            f"run name {run!r} is taken ({shown}); choose another name, or resume it with "
            f"`dflashops resume {run}`"
        )
    if target.name in found.errors:
        raise found.errors[target.name]
    for name, err in found.errors.items():
        context.note(f"warning: {name} not checked for a run named {run!r}: {err.message}")


def make_run_dir(machine: Machine, rundir: str, config_text: str, run: str) -> None:
    """Create the run directory (mkdir fails if it exists: the name is claimed atomically) and
    copy run.yaml, launch.sh and the first state.json into it, verified."""
    parent = posixpath.dirname(rundir)
    made = machine.run(["mkdir", "-p", "--", parent])
    if not made.ok and not machine.dry_run:
        raise OpsError(f"{machine.name}: cannot create {parent}: {made.error_text}")
    made = machine.run(["mkdir", "--", rundir])
    if not made.ok and not machine.dry_run:
        if "exists" in made.error_text:
            raise UsageError(f"run name {run!r} is taken: {machine.name}:{rundir} exists")
        raise OpsError(f"{machine.name}: cannot create {rundir}: {made.error_text}")
    with tempfile.TemporaryDirectory(prefix="dflashops-launch-") as tmp:
        local = Path(tmp)
        (local / "run.yaml").write_text(config_text)
        script = local / LAUNCH_SCRIPT
        script.write_text(launch_script(machine.target, run, rundir))
        script.chmod(0o755)
        state = {
            "status": "launching",
            "tmux": runs.tmux_session(run),
            "launched": time.time(),
            "target": machine.name,
        }
        (local / "state.json").write_text(json.dumps(state, indent=2) + "\n")
        transfer.put(machine, local, rundir)


RECORD_EXIT = """\
import json, os, sys, time
code = int(sys.argv[1])
try:
    with open("state.json") as f:
        state = json.load(f)
except (OSError, ValueError):
    state = {}
state["exit_code"] = code
if code != 0:
    state["status"] = "failed"
state.setdefault("finished", None)
state["finished"] = state["finished"] or time.time()
with open(".state.json.exit", "w") as f:
    json.dump(state, f, indent=2)
os.replace(".state.json.exit", "state.json")
"""


def launch_script(target: Target, run: str, rundir: str) -> str:
    """The shell script tmux runs: environment, secrets, the trainer, its exit code recorded."""
    q = shlex.quote
    path = os.environ.get("PATH", target.path) if target.kind == "local" else target.path
    exports = [f"export PATH={q(path)}"]
    exports.append(f"export PYTHONPATH={q(posixpath.join(target.workspace, bundle.REMOTE_HOME))}")
    exports.append("export PYTHONUNBUFFERED=1")
    exports += [f"export {k}={q(v)}" for k, v in target.env.items()]
    train = [target.python, "-m", "workload.train", "--config", "run.yaml", "--run-dir", rundir]
    stamp = "$(date -u '+%Y-%m-%d %H:%M:%S') UTC"
    return "\n".join(
        [
            "#!/bin/sh",
            f"# Written by `dflashops launch` for run {run} on {target.name}; tmux session",
            f"# {runs.tmux_session(run)} runs it, `dflashops resume {run}` runs it again with",
            "# --resume. The trainer's output goes to console.log, its exit code to exit_code",
            "# and state.json, even when it dies hard.",
            f"cd {q(rundir)} || exit 1",
            *exports,
            f"if [ -f {SECRETS} ]; then set -a; . ./{SECRETS}; set +a; fi",
            "rm -f exit_code",
            # the shell outlives a hangup or Ctrl-C in the pane, to record how the trainer ended
            "trap 'echo \"[dflashops] launch.sh got a signal\" >> console.log' HUP INT TERM",
            f'echo "[dflashops] {stamp}: {shlex.join(train)} $*" >> console.log',
            f'{shlex.join(train)} "$@" >> console.log 2>&1 < /dev/null',
            "code=$?",
            'echo "$code" > exit_code',
            f'echo "[dflashops] {stamp}: exit code $code" >> console.log',
            "python3 - \"$code\" >> console.log 2>&1 <<'EOF'",
            RECORD_EXIT.rstrip("\n"),
            "EOF",
            'exit "$code"',
            "",
        ]
    )


# ---------------------------------------------------------------- starting and waiting


def start(machine: Machine, run: str, rundir: str, *, resume: bool) -> None:
    """launch.sh in a new detached tmux session (it survives the SSH connection)."""
    session = runs.tmux_session(run)
    command = ["sh", posixpath.join(rundir, LAUNCH_SCRIPT)] + (["--resume"] if resume else [])
    argv = ["tmux", "new-session", "-d", "-s", session, "-c", rundir, shlex.join(command)]
    result = machine.run(argv)
    if machine.dry_run:
        return
    if result.returncode == 127:
        raise OpsError(f"{machine.name}: tmux is not installed there (apt install tmux)")
    if not result.ok:
        raise OpsError(f"{machine.name}: tmux new-session -s {session}: {result.error_text}")


def wait_for_life(machine: Machine, run: str, *, timeout: float) -> RunView:
    """Until the trainer runs (state.json says so), ends, or `timeout` passes."""
    clock = Stopwatch()
    next_note = 5.0
    context.note(f"{run}: starting on {machine.name} (the trainer loads the target model first)")
    while True:
        view = runs.reread(machine, run, records="recent", console=8192)
        if view.state == "running" and view.status.get("status") == "running":
            return view
        if view.state in ("finished", "stopped"):
            return view
        if view.state in ("failed", "unknown"):
            raise trainer_failure(view, machine.target)
        if clock.seconds > timeout:
            context.note(
                f"{run}: still starting after {duration(clock.seconds)}; it goes on: "
                f"`dflashops logs {run} --follow` shows what it prints"
            )
            return view
        if clock.seconds >= next_note:
            said = last_lines(view)[-1:] or ["(no output yet)"]
            context.note(f"{run}: starting ({duration(clock.seconds)}): {said[0]}")
            next_note += 10
        time.sleep(1.0 if clock.seconds < 30 else 3.0)


def last_lines(view: RunView) -> list[str]:
    tail = (view.raw.get("console") or {}).get("tail") or ""
    lines = [line.rstrip() for line in tail.splitlines()]
    return [line for line in lines if line.strip() and not line.startswith("[dflashops]")]


def trainer_failure(view: RunView, target: Target) -> OpsError:
    """The trainer's early exit as our error: its config refusal (exit 2) becomes our exit 2."""
    code = view.exit_code
    lines = last_lines(view)
    if code == 2:
        refusals = [line for line in lines if line.startswith("error: ")]
        message = (refusals or lines or ["(no message)"])[-1].removeprefix("error: ")
        return UsageError(f"{view.name}: the trainer refused to start: {message}")
    if code == 127:
        return OpsError(
            f"{view.name}: {target.python} not found on {target.name}; "
            f"run `dflashops setup {target.name}` first"
        )
    why = view.note or f"exit code {code}"
    last = lines[-1] if lines else "no output"
    return OpsError(
        f"{view.name}: the trainer failed ({why}): {last} (see `dflashops logs {view.name}`)"
    )
