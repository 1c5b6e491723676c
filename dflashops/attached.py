"""Running a command in a target attached to us: on our terminal (`on_terminal`, a pty end to
end: `shell`, `attach`), or with our stdin, stdout and stderr (`run_streaming`: `exec`,
`run-script`)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from dflashops import context
from dflashops.errors import OpsError, UsageError
from dflashops.targets.base import Machine, Result


def on_terminal(machine: Machine, argv: list[str], *, what: str, hint: str) -> int:
    """Run `argv` in `machine` with our terminal as its own (a pty where it runs remotely);
    its exit code. Under --dry-run, only what would run is printed. `what` and `hint` word
    the refusal when stdin is no terminal."""
    env = {"TERM": os.environ.get("TERM") or "xterm"}
    wrapped = machine.wrap(argv, env, None)
    if machine.dry_run:
        machine.announce(f"{machine.via}: {machine.describe_argv(argv, env)}")
        return 0
    if not _is_terminal():
        raise UsageError(f"{what} needs a terminal (stdin is not one); {hint}")
    if machine.target.kind == "local":
        Path(machine.target.workspace).mkdir(parents=True, exist_ok=True)
        return _wait(wrapped, _local_env())
    conn = machine.connection  # type: ignore[attr-defined]
    from dflashops.ssh.openssh import terminal_argv

    client = terminal_argv(conn, shlex.join(wrapped))
    if client is None:
        raise OpsError(f"{what} needs the OpenSSH client here: apt install openssh-client")
    _close_chain(conn)
    return _wait(client, None)


def _is_terminal() -> bool:
    try:
        return os.isatty(0)
    except OSError:
        return False


def _local_env() -> dict[str, str]:
    """Ours, less the marks of a tmux we may run in (tmux refuses to attach inside one)."""
    return {k: v for k, v in os.environ.items() if k not in ("TMUX", "TMUX_PANE")}


def _close_chain(conn) -> None:  # noqa: ANN001 (dflashops.ssh.connection.Connection)
    """Our own connections (and their jump hops) are not needed while the client runs."""
    hop = conn
    while hop is not None:
        onward = hop.jump_connection() if hop.resolved.jump else None
        hop.close()
        hop = onward


def _wait(argv: list[str], env: dict[str, str] | None) -> int:
    """The child owns the terminal: a Ctrl-C or Ctrl-\\ that reaches us is its to take."""
    try:
        proc = subprocess.Popen(argv, env=env)
    except FileNotFoundError:
        raise OpsError(f"{argv[0]}: not found") from None
    saved = signal.signal(signal.SIGQUIT, signal.SIG_IGN)
    try:
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:
                continue
    finally:
        signal.signal(signal.SIGQUIT, saved)
    return 128 - code if code < 0 else code


def run_streaming(
    machine: Machine,
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    forward_stdin: bool = True,
) -> Result:
    """Run with our stdin (when it is not a terminal) and our stdout/stderr attached."""
    attach = forward_stdin and sys.stdin is not None and not sys.stdin.isatty()
    stdin = _FdReader(sys.stdin.fileno()) if attach else None
    result = machine.run(
        argv,
        stdin=stdin,
        env=env,
        cwd=cwd,
        stdout=context.stream_sink(sys.stdout),
        stderr=context.stream_sink(sys.stderr),
    )
    return result


class _FdReader:
    """Our stdin read at the fd level: a thread blocked in it never holds a Python buffer lock."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def read1(self, size: int) -> bytes:
        return os.read(self.fd, size)

    read = read1
