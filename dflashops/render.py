"""Human output: sizes, durations, progress bars (always on stderr)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

BIG_TRANSFER = 32 << 20


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


@contextmanager
def progress(
    label: str, total: int | None, *, enabled: bool = True
) -> Iterator[Callable[[int], None]]:
    """A byte-counting progress bar on stderr; a line every few seconds when not a terminal."""
    if not enabled:
        yield lambda n: None
        return
    if not sys.stderr.isatty():
        yield _PlainProgress(label, total).advance
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    bar = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        transient=True,
    )
    with bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


class Stopwatch:
    def __init__(self) -> None:
        self.start = time.monotonic()

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.start


class _PlainProgress:
    """Progress for logs: one line every `every` seconds."""

    def __init__(self, label: str, total: int | None, every: float = 5.0) -> None:
        self.label, self.total, self.every = label, total, every
        self.done = 0
        self.last = time.monotonic()

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
            sys.stderr.write(
                f"{self.label}: {human_bytes(self.done)} of {human_bytes(self.total)}{share}\n"
            )
            sys.stderr.flush()
