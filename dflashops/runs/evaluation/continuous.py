"""Starting a continuous eval (the kind: runs/evaluation/continuous_kind.py): `eval RUN --every N --on TARGET`
and `launch ... --eval-on TARGET --eval-every N`.

Two programs of ours, both detached in tmux sessions of our own server (they survive the
operator): on the run's target (node 0, where its checkpoints are), the checkpoint server
(remote/ckpt_server.py) in <ws>/evals/RUN/serve/ID/, listening on that target's address from
the inventory (other targets reach it there: containers on a bridge, no DNS); on the eval
target, the follower job (remote/follow_eval.py) in <ws>/evals/RUN/follow/ID/, started as any
job starts (lifecycle/start.py). The two share a random token, written by us into a new 0600 file on each
side (<ws>/dflashops/secrets/ckpt-RUN-ID-serve.json and ckpt-RUN-ID-follow.json: two names,
as both sides may be one target): never on a command line, in a log or in a job's files. The
server deletes its file once it has read it; the follower deletes its own as it ends (a resume
whose token is gone gets a new server, as below). A follower that fails to start takes its server down with it. Once the run has
ended the server waits `linger` seconds (LINGER_S; DFLASHOPS_CKPT_LINGER_S) for a follower gone
quiet; a follower resumed after its server has gone gets a new one (`revive_server`: a new
port, a new token), so it still scores what it missed.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import secrets as random_tokens
import time
from typing import Any

from dflashops import context, transfer
from dflashops.errors import OpsError, UsageError
from dflashops.inventory import Target
from dflashops.remote import layout
from dflashops.remote import source as helper_source
from dflashops.runs.evaluation.continuous_kind import FOLLOW
from dflashops.runs.evaluation.job import (
    Extra,
    chosen_engine,
    engine_argv,
    engine_said,
    eval_argv,
    start_on,
)
from dflashops.runs.evaluation.pulls import beside
from dflashops.runs.evaluation.results import evals_doc
from dflashops.runs.lifecycle.claim import secrets_home
from dflashops.runs.lifecycle.placement import LOOPBACK, Node, Placement, new_run_id
from dflashops.runs.lifecycle.start import TMUX, write_run_files, write_secrets
from dflashops.runs.reading.probe import probe
from dflashops.runs.reading.survey import find
from dflashops.runs.reading.view import RunView, ckpt_copy_dir, tmux_session
from dflashops.runs.training.config import parse_config
from dflashops.runs.training.kind import TRAINING
from dflashops.ssh.session import Session
from dflashops.targets.base import Machine

SERVER = "ckpt_server.py"
POLL_S = 5.0  # how often the follower asks for new checkpoints
LINGER_S = 600.0  # how long the server waits for a quiet follower once the run has ended
LINGER_ENV = "DFLASHOPS_CKPT_LINGER_S"  # another linger (seconds), e.g. a test's
SERVER_START_S = 20.0  # how long we wait for the server's port


def start_follow(
    reader: Session, writer: Session, run: str, every: int, dest: Target, extra: Extra
) -> dict[str, Any]:
    """Check what the evaluations need, start the server, then the follower."""
    if every < 1:
        raise UsageError(f"--every {every}: a number of steps, >= 1")
    linger_s()  # a bad setting refused before anything starts
    view = find(reader, run, host=extra.host, records="none", files=[layout.RUN_CONFIG])
    if view.where != TRAINING.home:
        raise UsageError(f"{run} is not a training run in {view.target}:runs/; nothing to follow")
    source = reader.inventory.target(view.target)
    address = server_address(source, dest)
    refuse_second(reader, run, dest)
    config = parse_config(view, extra.sets)
    chosen = chosen_engine(reader.machine(dest), extra.engine)
    extra.engine = chosen.removesuffix("-auto")
    engine = engine_argv(reader.machine(dest), extra.engine)
    base = eval_argv(reader.machine(dest), writer.machine(dest), run, config, extra) + engine
    beside(writer.machine(dest), ckpt_copy_dir(dest, run, 0),
           (view.raw.get("files") or {}).get(layout.RUN_CONFIG))  # fmt: skip
    name, job_id = FOLLOW.new_job(run)
    token = random_tokens.token_hex(32)
    port = start_server(writer.machine(source), view, address, job_id, token)
    try:
        job = start_follower(reader, writer, view, dest, (name, job_id), every, base,
                             {"address": address, "port": port}, token)  # fmt: skip
    except BaseException:
        stop_server(writer.machine(source), run, job_id)
        raise
    context.note(f"{dest.name}: continuous eval {name} of {run} started (every {every} steps, "
                 f"{engine_said(dest, chosen)}; "
                 f"checkpoints from {source.name} at {address}:{port}; tmux {job['tmux']})")  # fmt: skip
    return job


def server_address(source: Target, dest: Target) -> str:
    """Where the eval target reaches the run's target: its own address from the inventory."""
    if source.name == dest.name:
        return LOOPBACK
    address = source.node_address
    if not address:
        raise UsageError(
            f"{source.name} has no address in the inventory for {dest.name} to reach it at; "
            f"add `address: IP` to {source.name} (its address on the network they share)"
        )
    return address


def follows(session: Session, run: str, dest: Target) -> list[dict[str, Any]]:
    """The continuous evals of `run` on `dest` (their state.json, "alive", "dir", "job")."""
    machine = session.machine(dest)
    doc = evals_doc(machine, run)
    if doc is None and not machine.dry_run:
        raise OpsError(f"{dest.name}: could not read its evals (<ws>/evals/{run}/)")
    return (doc or {}).get("follows") or []


def refuse_second(session: Session, run: str, dest: Target) -> None:
    for job in follows(session, run, dest):
        if job.get("alive"):
            raise UsageError(
                f"{run} is followed on {dest.name} already ({FOLLOW.template.format(run, job['job'])}"
                f"); stop it first to start another"
            )


def token_path(target: Target, run: str, job_id: str, side: str) -> str:
    """The token file of one side ("serve" or "follow") of a continuous eval."""
    return posixpath.join(secrets_home(target), f"ckpt-{run}-{job_id}-{side}.json")


def serve_dir(target: Target, run: str, job_id: str) -> str:
    return posixpath.join(target.workspace, layout.EVALS, run, "serve", job_id)


def linger_s() -> float:
    text = os.environ.get(LINGER_ENV)
    try:
        return float(text) if text else LINGER_S
    except ValueError:
        raise UsageError(f"{LINGER_ENV}={text!r}: a number of seconds") from None


def start_server(machine: Machine, view: RunView, address: str, job_id: str, token: str) -> int:
    """The checkpoint server on the run's target, in a tmux session of ours; its port. (A
    server started again for a resumed follower has an id of its own: `job_id` is that.)"""
    target = machine.target
    where = serve_dir(target, view.name, job_id)
    secret = token_path(target, view.name, job_id, "serve")
    write_secrets(machine, secret, {"token": token})
    conf = {"run_dir": view.dir, "address": address, "token_file": secret, "linger": linger_s()}
    write_run_files(machine, where, {SERVER: helper_source(SERVER),
                                     "serve.json": json.dumps(conf, indent=2) + "\n"})  # fmt: skip
    session = tmux_session(f"serve-{view.name}-{job_id}")
    argv = [*TMUX, "new-session", "-d", "-s", session, "-c", where,
            "python3", posixpath.join(where, SERVER), where]  # fmt: skip
    started = machine.run(argv)
    if machine.dry_run:
        return 0
    if not started.ok:
        raise OpsError(f"{target.name}: the checkpoint server did not start: {started.error_text}")
    return server_port(machine, where)


def server_port(machine: Machine, where: str) -> int:
    state_path = posixpath.join(where, layout.STATE_FILE)
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        with contextlib.suppress(OpsError, ValueError):
            port = json.loads(transfer.read_text(machine, state_path)).get("port")
            if port:
                return int(port)
        time.sleep(0.5)
    log = posixpath.join(where, layout.CONSOLE_LOG)
    raise OpsError(f"{machine.name}: the checkpoint server gave no port within "
                   f"{SERVER_START_S:.0f} s; see {log} there")  # fmt: skip


def stop_server(machine: Machine, run: str, job_id: str) -> None:
    session = tmux_session(f"serve-{run}-{job_id}")
    machine.run([*TMUX, "kill-session", "-t", "=" + session])


def server_alive(machine: Machine, run: str, serve_id: str) -> bool:
    session = tmux_session(f"serve-{run}-{serve_id}")
    return machine.run([*TMUX, "has-session", "-t", "=" + session]).ok


def revive_server(reader: Session, writer: Session, follower: RunView) -> None:
    """Before a continuous eval resumes: its checkpoint server, started again where it has
    gone (it ended a while after the run did), lost the follower's token, or runs an older
    program than the follower about to be written; its port and token in the follower's
    job.json."""
    s = follower.status
    run, job_id, dest = s.get("run"), s.get("job"), reader.inventory.target(follower.target)
    path = posixpath.join(follower.dir, "job.json")
    try:
        plan = json.loads(transfer.read_text(reader.machine(dest), path))
    except ValueError:
        raise OpsError(f"{dest.name}: {path} is not JSON; start a new `dflashops eval {run} "
                       "--every N --on TARGET`") from None  # fmt: skip
    source = reader.inventory.target(s.get("from") or "")
    old_id = plan.get("serve_id") or job_id
    why = "had ended"
    if server_alive(reader.machine(source), run, old_id):
        current = _runs_today(reader.machine(source), serve_dir(source, run, old_id))
        if current and _has_token(reader.machine(dest), plan.get("token_file")):
            return
        why = "had lost its token" if current else "ran an older program (another protocol)"
        stop_server(writer.machine(source), run, old_id)
    trained = find(reader, run, host=source.name, records="none")
    serve_id = f"{job_id}-r{random_tokens.token_hex(2)}"
    token = random_tokens.token_hex(32)
    address = plan["server"]["address"]
    port = start_server(writer.machine(source), trained, address, serve_id, token)
    secret = token_path(dest, run, serve_id, "follow")
    write_secrets(writer.machine(dest), secret, {"token": token})
    old_token = plan.get("token_file")
    plan.update(server={"address": address, "port": port}, token_file=secret, serve_id=serve_id)
    write_run_files(writer.machine(dest), follower.dir,
                    {"job.json": json.dumps(plan, indent=2) + "\n"})  # fmt: skip
    _forget_token(writer.machine(dest), old_token)
    context.note(f"{source.name}: the checkpoint server of {run} {why}; started again "
                 f"at {address}:{port} for {follower.name}")  # fmt: skip


def _runs_today(machine: Machine, where: str) -> bool:
    """Whether the server in `where` runs this version's program (an older one speaks another
    protocol than the follower that resumes, which is written anew)."""
    try:
        return transfer.read_text(machine, posixpath.join(where, SERVER)) == helper_source(SERVER)
    except OpsError:
        return False


def _forget_token(machine: Machine, path: Any) -> None:
    """The token file of a server replaced (a follower killed before it could delete it)."""
    home = secrets_home(machine.target) + "/"
    if isinstance(path, str) and path.startswith(home) and "/" not in path[len(home) :]:
        machine.run(["rm", "-f", "--", path])


def _has_token(machine: Machine, path: Any) -> bool:
    if not isinstance(path, str) or not path:
        return False
    return probe(machine, paths=[path]).paths.get(path) not in (None, "missing")


def start_follower(
    reader: Session,
    writer: Session,
    view: RunView,
    dest: Target,
    names: tuple[str, str],
    every: int,
    base: list[str],
    server: dict[str, Any],
    token: str,
) -> dict[str, Any]:
    name, job_id = names
    run, ws = view.name, dest.workspace
    secret = token_path(dest, run, job_id, "follow")
    write_secrets(writer.machine(dest), secret, {"token": token})
    plan = {"run": run, "every": every, "server": server, "token_file": secret, "argv": base,
            "ckpts": posixpath.join(ws, layout.CKPTS, run), "results": posixpath.join(ws, layout.EVALS, run),
            "lock": posixpath.join(ws, layout.EVALS, ".evaluating"), "poll": POLL_S}  # fmt: skip
    own = {"kind": FOLLOW.name, "run": run, "job": job_id, "every": every, "from": view.target,
           "server": server, "launched": time.time()}  # fmt: skip
    placement = start_on(reader, writer, Placement(FOLLOW, name, new_run_id(),
                                                   [Node(0, dest, 1)], state=own), plan)  # fmt: skip
    return {**own, "name": name, "target": dest.name, "tmux": tmux_session(name),
            "dir": placement.dir(placement.nodes[0])}  # fmt: skip
