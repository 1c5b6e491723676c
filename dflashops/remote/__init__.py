"""Small stdlib-only programs that run inside targets with their `python3 -c` (never imported
by the operator itself: their text is sent as an argument).

Each runs after a short preamble (PREAMBLE):
- a watchdog makes it die with the command that started it: when our channel closes (a
  deadline passed, Ctrl-C, a dropped connection), sshd closes the helper's stdout, and a thread
  waiting for exactly that interrupts the helper (SIGTERM when the helper handles it, as
  receive.py does to clean up, else SIGINT), then ends it 5 s later;
- its stdin and stdout pipes grow to 1 MiB: a copy then moves in 16 times fewer steps (about
  2 CPU seconds per GB less, measured on the test bed).
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from dflashops.errors import OpsError

if TYPE_CHECKING:
    from dflashops.targets.base import Machine, Result


PREAMBLE = """\
def _dflashops_preamble():
    import fcntl, os, select, signal, threading, time
    for fd in (0, 1):
        try:
            fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
        except OSError:
            pass  # not a pipe, or a smaller limit: a hint only
    main = threading.main_thread().ident
    def watch():
        poll = select.poll()
        poll.register(1, 0)  # errors only: the reader of our stdout went away
        events = 0
        while not events & (select.POLLERR | select.POLLHUP):
            events = poll.poll()[0][1]
            if events & select.POLLNVAL:
                return  # no stdout at all: nothing to watch
        handled = callable(signal.getsignal(signal.SIGTERM))
        signal.pthread_kill(main, signal.SIGTERM if handled else signal.SIGINT)
        time.sleep(5)
        os._exit(143)
    threading.Thread(target=watch, daemon=True).start()
_dflashops_preamble()
del _dflashops_preamble
"""


# A helper's import of another file of this folder (shared.py, describe.py: what several need)
SHARED_IMPORT = re.compile(r"^from dflashops\.remote\.(\w+) import (?:\([^)]*\)|.*)\n", re.M)


@cache
def source(name: str) -> str:
    """The text of the helper program `name` (e.g. "receive.py"). A helper's imports from the
    files beside it (for readers and linters) become those files' texts in front of it, each
    once, a file's own imports before it: in a target, a helper is one program, never a
    package."""
    text = _text(name)
    libraries = _libraries(name)
    if not libraries:
        return text
    front = "\n\n".join(f"# ---- {lib}\n{SHARED_IMPORT.sub('', _text(lib))}" for lib in libraries)
    return f"{front}\n\n# ---- {name}\n{SHARED_IMPORT.sub('', text)}"


def _text(name: str) -> str:
    return (Path(__file__).parent / name).read_text()


def _libraries(name: str) -> list[str]:
    """The files `name` imports from, with theirs, each once, every file after its own."""
    order: list[str] = []
    for lib in dict.fromkeys(SHARED_IMPORT.findall(_text(name))):
        for dep in [*_libraries(f"{lib}.py"), f"{lib}.py"]:
            if dep not in order:
                order.append(dep)
    return order


def python_argv(code: str, *args: str, name: str = "<helper>") -> list[str]:
    """The argv that runs python `code` in a target after the preamble (compiled on its own,
    so that its `from __future__` imports and tracebacks stay its own)."""
    return ["python3", "-c", f"{PREAMBLE}exec(compile({code!r}, {name!r}, 'exec'))\n", *args]


@cache
def _argv(name: str) -> tuple[str, ...]:
    return tuple(python_argv(source(name), name=name))


def argv(name: str, *args: str) -> list[str]:
    """The argv that runs helper `name` with `args` in a target."""
    return [*_argv(name), *args]


def run(machine: Machine, name: str, *args: str, stdin: bytes = b"", what: str) -> Result:
    """Run helper `name` in `machine`; an OpsError saying `what` failed when it does (a missing
    python3 named as such). Under --dry-run the result is empty and successful."""
    result = machine.run(argv(name, *args), stdin=stdin)
    check(machine, result, what)
    return result


def check(machine: Machine, result: Result, what: str, error: type[OpsError] = OpsError) -> None:
    if result.ok or machine.dry_run:
        return
    if result.returncode == 127:
        raise OpsError(f"{machine.name}: python3 not found; install it in the target")
    raise error(f"{machine.name}: {what} failed: {result.error_text}")
