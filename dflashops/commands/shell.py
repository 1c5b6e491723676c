"""`shell TARGET`: an interactive shell in a target, on the user's terminal (a pty end to end).

Containers and SSH machines are reached by the OpenSSH client (`ssh -t`) under the private
config every bulk copy uses (strict host keys, our known_hosts files, the jump chain), after
the usual connection has checked the host key and the login; a container's shell is
`pct exec VMID -- ...` on its host, with the target's environment. The local target gets a
local shell. Its terminal (attached.on_terminal) is shared with `attach`.
"""

from __future__ import annotations

import typer

from dflashops import context
from dflashops.attached import on_terminal

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
        opts = context.begin(ctx)
        machine = opts.session().machine(target)
        argv = ["/bin/sh", "-c", SHELL_SCRIPT, "sh", machine.target.workspace]
        if not opts.dry_run and machine.target.kind != "local":
            machine.run(["true"])  # a stopped or missing container: our one line, not pct's
        hint = f"for scripts use `dflashops exec {target} -- ARGV...`"
        raise typer.Exit(on_terminal(machine, argv, what="shell", hint=hint))
