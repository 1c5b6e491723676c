"""`attach [RUN] [--host TARGET] [--node K]`: the user's terminal in the run's tmux session
(`dflash-RUN` on our private tmux server) where it runs: node 0 of a run over several
targets, or node K. Detaching (C-b d) comes back with exit 0; the run goes on.

The launcher's own window shows nothing (everything goes to console.log, so a terminal can
never hold up the trainer), so the session gets a window `console` that follows console.log
(`tail -F`) and ends with the launcher (checked every 0.2 s, a zombie counting as ended): the
session still ends with the run.
"""

from __future__ import annotations

import posixpath

import typer

from dflashops import context
from dflashops.attached import on_terminal
from dflashops.commands import _options
from dflashops.errors import NotFoundError
from dflashops.remote import layout
from dflashops.runs.lifecycle.rehearse import unread_is_said
from dflashops.runs.reading.survey import resolve
from dflashops.runs.reading.view import RunView, tmux_session

# $1: the session, $2: its console.log. The launcher is the first window's pane. The console
# window ends when the launcher is gone or a zombie: tmux can miss a pane's SIGCHLD while it
# spawns another pane (libutempter, tmux#311), and `tail --pid` waits on a zombie for ever;
# the console window's own end makes tmux reap both.
ATTACH = """\
s="=$1"; log=$2
watch='tail -n 200 -s 0.2 -F "$2" & t=$!
while :; do
  case $(sed -n "s/^State:[[:space:]]*//p" "/proc/$1/status" 2>/dev/null) in ""|Z*|X*) break ;; esac
  sleep 0.2
done
kill $t'
set -- tmux -L dflashops -f /dev/null
if ! "$@" list-windows -t "$s:" -F '#{window_name}' | grep -qx console; then
  pid=$("$@" display-message -p -t "$s:0" '#{pane_pid}')
  "$@" new-window -d -t "$s:" -n console sh -c "$watch" sh "$pid" "$log"
fi
"$@" select-window -t "$s:console" 2>/dev/null
exec "$@" attach-session -t "$s"
"""


def register(app: typer.Typer) -> None:
    @app.command("attach")
    @context.command
    def attach(
        ctx: typer.Context,
        run: str = typer.Argument(
            None, metavar="RUN", help="A running run (default: the newest running one)."
        ),
        host: str = _options.HOST_OPTION,
        node: int = typer.Option(
            0, "--node", min=0, metavar="K", help="Node K of a run over several targets."
        ),
    ) -> None:
        """Attach this terminal to a run's tmux session.

        C-b d detaches (exit 0); the run goes on.
        """
        opts = context.begin(ctx)
        what = f"run {run}" if run else "the newest running run"
        with opts.sessions() as (reader, writer), unread_is_said(reader, what):
            view = on_node(resolve(reader, run, host=host, records="none"), node)
            console = posixpath.join(view.dir, layout.CONSOLE_LOG)
            argv = ["/bin/sh", "-c", ATTACH, "sh", tmux_session(view.name), console]
            hint = f"`dflashops logs {view.name} --follow` shows its output"
            code = on_terminal(writer.machine(view.target), argv, what="attach", hint=hint)
        raise typer.Exit(code)


def on_node(view: RunView, node: int) -> RunView:
    """Node `node`'s view of a run, refused unless its tmux session is there."""
    nodes = sorted(view.nodes or [view], key=lambda v: v.node_index)
    if node >= len(view.node_targets):
        raise NotFoundError(f"{view.name}: no node {node} (nodes 0..{len(view.node_targets) - 1})")
    found = next((v for v in nodes if v.node_index == node), None)
    if found is None:
        raise NotFoundError(f"{view.name}: node {node} ({view.node_targets[node]}) was not read")
    if not found.raw.get("tmux"):
        where = f" on {found.target}" if view.multi else ""
        raise NotFoundError(
            f"{view.name}: not running{where} ({found.state}), so there is no session to attach "
            f"to; its output: dflashops logs {view.name}"
        )
    return found
