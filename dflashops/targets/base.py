"""The one interface to every machine: run an argv, with stdin and streaming; nothing else.

Files move over the same `run` (see `dflashops.transfer`), so a new way of reaching a machine
needs only `spawn`. Commands never build ssh or pct strings themselves.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shlex
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO, Protocol

from dflashops.errors import NoAnswerError, TransferError
from dflashops.inventory import Target

Sink = Callable[[bytes], None]


@dataclass(frozen=True)
class FileSpan:
    """Bytes of an open file, already read into `data` (valid until the next item of the
    stdin is asked for): a command whose stdin is a pipe takes them straight from the file
    (sendfile: no copy through Python), any other way of sending takes `data`."""

    path: str  # for errors
    fd: int
    offset: int
    data: memoryview


Stdin = bytes | BinaryIO | Iterable[bytes | FileSpan] | None
CHUNK = 1 << 20
WRITE_SLICE = 1 << 18  # stdin goes in by this much at a time: a slow link still shows progress
TAIL = 8192
DEFAULT_TIMEOUT_S = 30.0
TICK_S = 0.1
NO_SENDFILE = (errno.EINVAL, errno.ENOSYS, errno.ENOTSOCK, errno.EOPNOTSUPP)  # into a pipe


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

    def write(self, data: bytes | memoryview) -> None: ...
    def stdin_pipe(self) -> int | None:
        """The fd of a pipe into the command (for sendfile); None where bytes go another way."""

    def close_stdin(self) -> None: ...
    def read_stdout(self, size: int) -> bytes: ...
    def read_stderr(self, size: int) -> bytes: ...
    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code; None when it has not come within `timeout` seconds."""

    def kill(self) -> None: ...


class Machine:
    """Base of every target kind. Subclasses implement `wrap` and `spawn`."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.dry_run = False
        self.announce: Callable[[str], None] = print
        self.timeout = DEFAULT_TIMEOUT_S  # seconds: the deadline of every call (see `run`)

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

    def spawn(
        self, argv: list[str], env: dict[str, str], cwd: str | None, *, bulk: bool = False
    ) -> Process:
        """Start `argv`; `bulk` asks for the fastest way to stream many bytes (see `run`)."""
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
        timeout: float | None = None,
        bulk: bool = False,
        watch_sink: bool = False,
    ) -> Result:
        """Run `argv` exactly as given. Output is captured unless a sink is given for it;
        a streamed stderr still leaves its last few KiB in `Result.stderr` for diagnostics.

        Deadline (`timeout`, default `self.timeout`: `--timeout` or the command's default):
        when stdout is captured, the call fails with NoAnswerError (exit 3) and the command is
        stopped once nothing has come out of it and none of our stdin has gone in for that
        long: a hung command fails, a copy that keeps moving bytes never does. When stdout
        streams to a sink (a long job, a followed log), the command may stay quiet for hours;
        then only the connection's keepalive, which needs an answer within the same deadline,
        bounds the call, unless `watch_sink` says the deadline holds there too (a copy that
        answers as it goes). `bulk`: a copy of many bytes (the OpenSSH client where installed).
        """
        if not argv:
            raise ValueError("empty argv")
        if self.dry_run:
            self.announce(f"{self.via}: {self.describe_argv(argv, env, cwd)}")
            return Result(list(argv), 0)
        limit = self.timeout if timeout is None else timeout
        watch = _Watch(limit if stdout is None or watch_sink else None)
        proc = self.spawn(list(argv), dict(env or {}), cwd, bulk=bulk)
        out: list[bytes] = []
        err = _Tail(limit=None if stderr is None else TAIL)
        held = _Holdback(stderr, self.is_way_in_error) if stderr is not None else None
        readers = [
            _Pump(proc.read_stdout, stdout or out.append, proc, watch),
            _Pump(proc.read_stderr, err.tee(held.take if held else None), proc, watch),
        ]
        feeder = _Feeder(proc, stdin, watch)
        try:
            for reader in readers:
                reader.join(watch)
            # Our own stdin may never end (a pipe held open by a parent): don't wait for it
            # once the command is done. Data we generate ourselves is always waited for.
            feeder.finish(watch, wait=not _is_stream(stdin))
            while (code := proc.wait(TICK_S)) is None:
                watch.check()
        except _Silent:
            proc.kill()
            raise NoAnswerError(self.name, limit) from None
        except BaseException:
            proc.kill()
            raise
        result = Result(list(argv), code, b"".join(out), err.value())
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


class _Silent(Exception):
    """The command showed no life within its deadline."""


class _Watch:
    """When the command last showed life: bytes out of it, or our stdin taken by it."""

    def __init__(self, limit: float | None) -> None:
        self.limit = limit
        self.last = time.monotonic()

    def touch(self) -> None:
        self.last = time.monotonic()

    def check(self) -> None:
        if self.limit is not None and time.monotonic() - self.last > self.limit:
            raise _Silent


class _Pump:
    """Drains one output stream into a sink on its own thread. If the sink fails (our stdout
    closed, a full disk), the command is stopped, the stream is still drained so the command
    can exit, and the sink's error is raised by `join`. A sink with an `ended` method is told
    when the stream has ended."""

    def __init__(self, read: Callable[[int], bytes], sink: Sink, proc: Process, watch: _Watch):
        self.read, self.sink, self.proc, self.watch = read, sink, proc, watch
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self) -> None:
        while chunk := self.read(CHUNK):
            self.watch.touch()
            if self.error is not None:
                continue
            try:
                self.sink(chunk)
            except BaseException as exc:  # noqa: BLE001 (raised again by join)
                self.error = exc
                self.proc.kill()
        if ended := getattr(self.sink, "ended", None):
            ended()

    def join(self, watch: _Watch) -> None:
        while self.thread.is_alive():
            self.thread.join(TICK_S)
            watch.check()
        if self.error is not None:
            raise self.error


class _Feeder:
    """Writes stdin on its own thread; errors from producing the data are raised by finish()."""

    def __init__(self, proc: Process, stdin: Stdin, watch: _Watch) -> None:
        self.proc = proc
        self.stdin = stdin
        self.watch = watch
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self.feed, daemon=True)
        self.thread.start()

    def feed(self) -> None:
        try:
            pipe = self.proc.stdin_pipe()
            for chunk in _chunks(self.stdin):
                try:
                    if isinstance(chunk, FileSpan) and pipe is not None:
                        if self.send_file(pipe, chunk):
                            continue
                        pipe = None  # no sendfile into a pipe here: the bytes are written
                    view = memoryview(chunk.data if isinstance(chunk, FileSpan) else chunk)
                    for start in range(0, len(view), WRITE_SLICE):  # slices are not copies
                        self.proc.write(view[start : start + WRITE_SLICE])
                        self.watch.touch()
                except (OSError, EOFError):
                    return  # the command stopped reading; its exit code tells the story
        except BaseException as exc:  # noqa: BLE001 (re-raised in finish)
            self.error = exc
        finally:
            with contextlib.suppress(OSError, EOFError):
                self.proc.close_stdin()

    def send_file(self, pipe: int, span: FileSpan) -> bool:
        """False when this system cannot sendfile into a pipe (before anything was sent)."""
        offset, end = span.offset, span.offset + len(span.data)
        while offset < end:
            try:
                sent = os.sendfile(pipe, span.fd, offset, min(WRITE_SLICE, end - offset))
            except OSError as exc:
                if offset == span.offset and exc.errno in NO_SENDFILE:
                    return False
                raise
            if sent == 0:
                raise TransferError(f"{span.path}: file shrank while being sent; try again")
            offset += sent
            self.watch.touch()
        return True

    def finish(self, watch: _Watch, wait: bool) -> None:
        while wait and self.thread.is_alive():
            self.thread.join(TICK_S)
            watch.check()
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
