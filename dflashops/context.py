"""The global options of a command line and what they lazily open (inventory, session)."""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from dflashops.errors import ExitCode, OpsError

if TYPE_CHECKING:
    from dflashops.inventory import Inventory

F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class Context:
    inventory_path: str | None = None
    json: bool = False
    dry_run: bool = False
    verbose: int = 0
    timeout: float | None = None  # --timeout: overrides every command's default deadline
    command: str = ""  # the command being run (its default deadline)
    deadlines: dict[str, float] = field(default_factory=dict)  # a command's default deadline
    _inventory: Inventory | None = field(default=None, repr=False)
    _session: Any = field(default=None, repr=False)

    def inventory(self) -> Inventory:
        if self._inventory is None:
            from dflashops.inventory import find_inventory, load_inventory  # not for --help

            self._inventory = load_inventory(find_inventory(self.inventory_path))
        return self._inventory

    def session(self):  # noqa: ANN201 (Session, imported lazily)
        if self._session is None:
            from dflashops.ssh.session import Session

            self._session = Session(
                self.inventory(),
                dry_run=self.dry_run,
                announce=self.announce,
                timeout=self.deadline(),
            )
        return self._session

    @contextmanager
    def sessions(self) -> Iterator[tuple[Any, Any]]:
        """(reader, writer) Sessions. Under --dry-run no connection is opened: every write is
        only printed (stdout), a read of a remote target is only said (stderr: it needs the
        host) and comes back empty; a `local` target is still read (it changes nothing)."""
        writer = self.session()
        if not self.dry_run:
            yield writer, writer
            return
        from dflashops.ssh.session import Session

        reader = Session(self.inventory(), offline=True, announce=note, timeout=self.deadline())
        try:
            yield reader, writer
        finally:
            reader.close()

    def dry_run_done(self, **doc: Any) -> None:
        """The end of a --dry-run, whose argv went to stdout (to stderr under --json): under
        --json, its one document, {"dry_run": true, ...what it would have done}."""
        if self.json:
            self.emit({"dry_run": True, **doc})

    def deadline(self) -> float:
        """Seconds a remote call may go without an answer: --timeout, else the command's."""
        from dflashops.targets.base import DEFAULT_TIMEOUT_S

        if self.timeout is not None:
            return self.timeout
        return self.deadlines.get(self.command, DEFAULT_TIMEOUT_S)

    def want_json(self, flag: bool = False) -> bool:
        """True when JSON was asked for, globally or by the command's own --json."""
        self.json = self.json or flag
        return self.json

    def announce(self, line: str) -> None:
        """A --dry-run line: stdout, unless stdout is reserved for the JSON document."""
        (note if self.json else say)(line)

    def close(self) -> None:
        if self._session is not None:
            self._session.close()

    def answer(self, document: Any, text: str | Callable[[], None]) -> None:
        """A command's closing: its one JSON document under --json, else its text (a line on
        stdout, or what `text()` prints)."""
        if self.json:
            self.emit(document)
        elif callable(text):
            text()
        else:
            say(text)

    def emit(self, document: Any) -> None:
        """The one JSON document of a `--json` reading command."""
        text = json.dumps(document, indent=2, default=str) + "\n"
        for start in range(0, len(text), 1 << 16):  # a reader that leaves early is noticed
            sys.stdout.write(text[start : start + (1 << 16)])
            sys.stdout.flush()


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def note(line: str) -> None:
    """Progress and remarks: stderr, never mixed into --json output."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def fail(message: str, code: int) -> None:
    """The error, each of its lines prefixed (one per problem, e.g. parity's mismatches)."""
    lines = message.splitlines() or [""]
    sys.stderr.write("".join(f"dflashops: error: {line}\n" for line in lines))
    sys.stderr.flush()
    raise typer.Exit(code)


def stream_sink(stream) -> Callable[[bytes], None]:  # noqa: ANN001
    """Bytes to one of our own streams, flushed at once (remote output, followed logs)."""
    buffer = stream.buffer

    def write(chunk: bytes) -> None:
        buffer.write(chunk)
        buffer.flush()

    return write


def _quiet_broken_pipe() -> None:
    """Our reader went away (`... | head`): stop quietly, as Unix tools do (141 = 128+SIGPIPE)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not fail again
    raise typer.Exit(141)


# typer vendors click from 0.26 on; its ClickException is wherever BadParameter's base is
_CLICK_EXCEPTION = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def get(ctx: typer.Context) -> Context:
    obj = ctx.find_root().obj
    return obj if isinstance(obj, Context) else Context()


def begin(ctx: typer.Context, json_out: bool = False) -> Context:
    """A command's opening: its Context, with --json settled (the global option or the
    command's own); the command closes with `Context.answer` (or `emit`, `dry_run_done`)."""
    opts = get(ctx)
    opts.want_json(json_out)
    return opts


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (a closed terminal, a killed operator): handled as Ctrl-C is, so what
    a command made so far is taken back (a launch's claim, a resume's changes, a copy)."""


def _terminated(signum: int, _frame: Any) -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):  # the taking back is not cut short again
        signal.signal(sig, signal.SIG_IGN)
    raise Terminated(signal.Signals(signum).name)


def take_termination() -> None:
    """SIGTERM and SIGHUP raise Terminated, unless they are ignored (nohup keeps SIGHUP so)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) == signal.SIG_DFL:
            signal.signal(sig, _terminated)


def command(fn: F) -> F:
    """Turn OpsError into one line and its exit code; Ctrl-C, SIGTERM and SIGHUP into 130;
    close connections."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = next((a for a in args if isinstance(a, typer.Context)), kwargs.get("ctx"))
        if ctx is not None and isinstance(ctx.find_root().obj, Context):
            ctx.find_root().obj.command = ctx.info_name or ""
        try:
            take_termination()
            return fn(*args, **kwargs)
        except OpsError as exc:
            fail(exc.message, int(exc.code))
        except KeyboardInterrupt as exc:
            got = f" ({exc.args[0]})" if isinstance(exc, Terminated) else ""
            fail(f"interrupted{got}", int(ExitCode.INTERRUPTED))
        except BrokenPipeError:
            _quiet_broken_pipe()
        except (typer.Exit, typer.Abort, _CLICK_EXCEPTION):
            raise
        except Exception as exc:  # a bug of ours: still one line, the details on request
            if ctx is not None and get(ctx).verbose:
                traceback.print_exc()
            fail(
                f"internal error: {type(exc).__name__}: {exc} (rerun with -v for details)",
                int(ExitCode.FAILED),
            )
        finally:
            if ctx is not None:
                get(ctx).close()

    return wrapper  # type: ignore[return-value]
