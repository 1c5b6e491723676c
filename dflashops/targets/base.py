"""The one interface to every machine: run an argv, with stdin and streaming; nothing else.

Files move over the same `run` (see `dflashops.transfer`), so a new way of reaching a machine
needs only `spawn`. Commands never build ssh or pct strings themselves.
"""

from __future__ import annotations

import contextlib
import hashlib
import shlex
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO, Protocol

from dflashops.inventory import Target

Sink = Callable[[bytes], None]
Stdin = bytes | BinaryIO | Iterable[bytes] | None
CHUNK = 1 << 20
TAIL = 8192


@dataclass
class Result:
    argv: list[str]
    returncode: int
    stdout: bytes = b""
    stderr: bytes = b""

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def text(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    @property
    def error_text(self) -> str:
        lines = self.stderr.decode("utf-8", "replace").strip().splitlines()
        return lines[-1] if lines else f"exit code {self.returncode}"


class Process(Protocol):
    """A started command: bytes in, bytes out, an exit code."""

    def write(self, data: bytes) -> None: ...
    def close_stdin(self) -> None: ...
    def read_stdout(self, size: int) -> bytes: ...
    def read_stderr(self, size: int) -> bytes: ...
    def wait(self) -> int: ...
    def kill(self) -> None: ...


class Machine:
    """Base of every target kind. Subclasses implement `wrap` and `spawn`."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.dry_run = False
        self.announce: Callable[[str], None] = print

    @property
    def via(self) -> str:
        """Where commands really start: the Proxmox host for containers, else the target."""
        return self.target.host or self.target.name

    @property
    def name(self) -> str:
        return self.target.name

    def wrap(self, argv: list[str], env: dict[str, str], cwd: str | None) -> list[str]:
        """The argv as the machine will really run it (environment and cwd made explicit)."""
        raise NotImplementedError

    def env_argv(
        self,
        env: dict[str, str],
        cwd: str | None,
        *,
        base: tuple[str, ...] = (),
        clear: bool = False,
    ) -> list[str]:
        """`env [-i] [-C cwd] [base...] [target's env] [env]`: the environment, explicitly."""
        chdir = ["-C", cwd] if cwd else []
        assignments = [f"{k}={v}" for k, v in {**self.target.env, **env}.items()]
        head = ["/usr/bin/env", "-i"] if clear else ["env"]
        return [*head, *chdir, *base, *assignments]

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str | None) -> Process:
        raise NotImplementedError

    def describe_argv(self, argv: list[str], env=None, cwd=None) -> str:
        """What `--dry-run` prints: the exact command line that would run on the host."""
        return shlex.join(_abbreviate(a) for a in self.wrap(argv, dict(env or {}), cwd))

    def run(
        self,
        argv: list[str],
        *,
        stdin: Stdin = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdout: Sink | None = None,
        stderr: Sink | None = None,
    ) -> Result:
        """Run `argv` exactly as given. Output is captured unless a sink is given for it;
        a streamed stderr still leaves its last few KiB in `Result.stderr` for diagnostics."""
        if not argv:
            raise ValueError("empty argv")
        if self.dry_run:
            self.announce(f"{self.via}: {self.describe_argv(argv, env, cwd)}")
            return Result(list(argv), 0)
        proc = self.spawn(list(argv), dict(env or {}), cwd)
        out: list[bytes] = []
        err = _Tail(limit=None if stderr is None else TAIL)
        held = _Holdback(stderr, self.is_way_in_error) if stderr is not None else None
        readers = [
            _Pump(proc.read_stdout, stdout or out.append, proc),
            _Pump(proc.read_stderr, err.tee(held.take if held else None), proc),
        ]
        feeder = _Feeder(proc, stdin)
        try:
            for reader in readers:
                reader.join()
        except BaseException:
            proc.kill()
            raise
        # Our own stdin may never end (a pipe held open by a parent): don't wait for it once
        # the command is done. Data we generate ourselves is always waited for.
        feeder.finish(wait=not _is_stream(stdin))
        result = Result(list(argv), proc.wait(), b"".join(out), err.value())
        self.check(result)
        if held:
            held.release()
        return result

    def check(self, result: Result) -> None:
        """Raise for failures of the way in (a stopped container), not of the command itself."""

    def is_way_in_error(self, line: bytes) -> bool:
        """True for a stderr line that may be the way in failing (held back from the user
        until the exit code tells whether `check` turns it into our own one-line error)."""
        return False


def _abbreviate(arg: str) -> str:
    """Inline helper programs are shown by size and digest, not pages of source."""
    if len(arg) < 400 or "\n" not in arg:
        return arg
    digest = hashlib.sha256(arg.encode()).hexdigest()[:12]
    return f"<program: {len(arg)} bytes, sha256 {digest}>"


class _Tail:
    """Collects stderr whole, or only its last `limit` bytes while passing it on to a sink."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.parts: list[bytes] = []
        self.size = 0

    def tee(self, sink: Sink | None) -> Sink:
        def take(chunk: bytes) -> None:
            if sink is not None:
                sink(chunk)
            self.parts.append(chunk)
            self.size += len(chunk)
            if self.limit is not None and self.size > 2 * self.limit:
                joined = b"".join(self.parts)[-self.limit :]
                self.parts, self.size = [joined], len(joined)

        return take

    def value(self) -> bytes:
        joined = b"".join(self.parts)
        return joined if self.limit is None else joined[-self.limit :]


class _Holdback:
    """Passes stderr on, except leading lines that look like the way in failing: those wait."""

    def __init__(self, sink: Sink, suspicious: Callable[[bytes], bool]) -> None:
        self.sink = sink
        self.suspicious = suspicious
        self.held = b""
        self.open = False

    def take(self, chunk: bytes) -> None:
        if self.open:
            self.sink(chunk)
            return
        self.held += chunk
        *lines, rest = self.held.split(b"\n")
        if any(not self.suspicious(line) for line in lines) or len(rest) > 4096:
            self.release()

    def release(self) -> None:
        self.open = True
        if self.held:
            self.sink(self.held)
            self.held = b""


class _Pump:
    """Drains one output stream into a sink on its own thread. If the sink fails (our stdout
    closed, a full disk), the command is stopped, the stream is still drained so the command
    can exit, and the sink's error is raised by `join`."""

    def __init__(self, read: Callable[[int], bytes], sink: Sink, proc: Process) -> None:
        self.read, self.sink, self.proc = read, sink, proc
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self) -> None:
        while chunk := self.read(CHUNK):
            if self.error is not None:
                continue
            try:
                self.sink(chunk)
            except BaseException as exc:  # noqa: BLE001 (raised again by join)
                self.error = exc
                self.proc.kill()

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


class _Feeder:
    """Writes stdin on its own thread; errors from producing the data are raised by finish()."""

    def __init__(self, proc: Process, stdin: Stdin) -> None:
        self.proc = proc
        self.stdin = stdin
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self.feed, daemon=True)
        self.thread.start()

    def feed(self) -> None:
        try:
            for chunk in _chunks(self.stdin):
                try:
                    self.proc.write(chunk)
                except (OSError, EOFError):
                    return  # the command stopped reading; its exit code tells the story
        except BaseException as exc:  # noqa: BLE001 (re-raised in finish)
            self.error = exc
        finally:
            with contextlib.suppress(OSError, EOFError):
                self.proc.close_stdin()

    def finish(self, wait: bool) -> None:
        if wait:
            self.thread.join()
        if self.error is not None:
            raise self.error


def _is_stream(stdin: Stdin) -> bool:
    return hasattr(stdin, "read")


def _chunks(stdin: Stdin) -> Iterator[bytes]:
    if stdin is None:
        return
    if isinstance(stdin, (bytes, bytearray, memoryview)):
        view = memoryview(stdin)
        for start in range(0, len(view), CHUNK):
            yield bytes(view[start : start + CHUNK])
        return
    if hasattr(stdin, "read"):
        read = getattr(stdin, "read1", stdin.read)
        while chunk := read(CHUNK):
            yield chunk
        return
    yield from stdin
