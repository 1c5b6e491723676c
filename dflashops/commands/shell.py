"""`shell TARGET`: an interactive shell in a target, on the user's terminal (a pty end to end).

Containers and SSH machines are reached by the OpenSSH client (`ssh -t`) under the private
config every bulk copy uses (strict host keys, our known_hosts files, the jump chain), after
the usual connection has checked the host key and the login; a container's shell is
`pct exec VMID -- ...` on its host, with the target's environment. The local target gets a
local shell. `on_terminal` is shared with `attach`.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
from pathlib import Path

import typer

from dflashops import context
from dflashops.errors import OpsError, UsageError
from dflashops.targets.base import Machine

# bash where there is one, else sh; in the workspace when it exists. No user value in it:
# the workspace arrives as $1.
SHELL_SCRIPT = 'cd -- "$1" 2>/dev/null; command -v bash >/dev/null 2>&1 && exec bash; exec sh'


def register(app: typer.Typer) -> None:
    @app.command("shell")
    @context.command
    def shell(
        ctx: typer.Context,
        target: str = typer.Argument(..., metavar="TARGET", help="A target of the inventory."),
    ) -> None:
        """Open an interactive shell in TARGET.

        Needs a terminal (a pty end to end); `exit` comes back with the shell's exit code.
        """
        opts = context.get(ctx)
        machine = opts.session().machine(target)
        argv = ["/bin/sh", "-c", SHELL_SCRIPT, "sh", machine.target.workspace]
        if not opts.dry_run and machine.target.kind != "local":
            machine.run(["true"])  # a stopped or missing container: our one line, not pct's
        hint = f"for scripts use `dflashops exec {target} -- ARGV...`"
        raise typer.Exit(on_terminal(machine, argv, what="shell", hint=hint))


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
    from dflashops.openssh import terminal_argv

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


def _close_chain(conn) -> None:  # noqa: ANN001 (dflashops.ssh.Connection)
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
